#!/usr/bin/env bash
# One-shot GPU check for a rented CUDA machine (written for one H200; < 5 min on a
# machine with a fast network): installs the GPU stack into a venv, runs every
# test marked @pytest.mark.gpu and the MinMaxUInt8 compression benchmark.
#
#   bash benchmarks/gpu_check.sh                 # from anywhere; OUT=/some/dir to keep the outputs
#
# Settings (environment variables, all optional):
#   OUT              folder for the outputs (default: ./gpu_check_out)
#   PYTHON           interpreter that creates the venv (default: python3)
#   VENV             venv folder (default: .venv-gpu in the repo); reused when present
#   CUDA_MAJOR       12 or 13: picks jax[cudaNN] and nccl4py[cuNN] (default: 12)
#   TORCH_INDEX_URL  pip index for a specific torch CUDA build, e.g. https://download.pytorch.org/whl/cu128
#                    (default: PyPI's torch, which on Linux x86_64 is a CUDA build)
#   SKIP_INSTALL=1   use the current python and its packages as they are (offline machines)
#   WHEELS           a folder of wheels to install from, offline (pip --no-index --find-links)
#   PYTEST_TIMEOUT   seconds for the GPU tests (default: 180); BENCH_TIMEOUT for the benchmark (default: 90)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/gpu_check_out}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
exec > >(tee -a "$LOG") 2>&1

CUDA_MAJOR="${CUDA_MAJOR:-12}"
PYTEST_TIMEOUT="${PYTEST_TIMEOUT:-180}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-90}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false # JAX shares the GPU with torch
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" # bagua_x from this checkout, installed or not

step() { printf '\n=== %s  (%ss)\n' "$*" "$SECONDS"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "nvidia-smi unavailable"

if [[ "${SKIP_INSTALL:-0}" == "1" ]]; then
  PY="${PYTHON:-python3}"
  step "using $PY as it is (SKIP_INSTALL=1)"
else
  VENV="${VENV:-$REPO/.venv-gpu}"
  if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating $VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
  fi
  PY="$VENV/bin/python"
  pip_install() {
    if [[ -n "${WHEELS:-}" ]]; then
      "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "$@"
    else
      "$PY" -m pip install --quiet "$@"
    fi
  }
  step "installing torch"
  if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
    pip_install torch --index-url "$TORCH_INDEX_URL"
  else
    pip_install torch
  fi
  step "installing jax[cuda${CUDA_MAJOR}], optax, nccl4py[cu${CUDA_MAJOR}], test tools and bagua-x"
  pip_install "jax[cuda${CUDA_MAJOR}]" optax "nccl4py[cu${CUDA_MAJOR}]" pytest pytest-timeout hypothesis \
    "array-api-compat>=1.9" numpy
  if [[ -z "${WHEELS:-}" ]]; then
    pip_install --no-deps -e .
  fi
fi

step "versions"
("$PY" - <<'EOF' | tee "$OUT/versions.txt"
import importlib
for name in ("torch", "jax", "jaxlib", "optax", "nccl.core", "cuda.core", "array_api_compat", "numpy"):
    try:
        m = importlib.import_module(name)
        print(f"{name:18} {getattr(m, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001
        print(f"{name:18} MISSING ({type(e).__name__}: {e})")
import torch
print("torch.cuda", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "-", torch.cuda.device_count(), "GPU(s)")
import jax
print("jax devices", jax.devices())
try:
    from nccl.bindings import nccl
    print("libnccl", nccl.get_version())
except Exception as e:  # noqa: BLE001
    print("libnccl MISSING", e)
EOF
) || echo "(version report failed; continuing)"

step "pytest -m gpu"
set +e
timeout "$PYTEST_TIMEOUT" "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs \
  --junitxml="$OUT/pytest_gpu.xml" 2>&1 | tee "$OUT/pytest_gpu.txt"
TEST_RC=${PIPESTATUS[0]}
set -e

step "compression benchmark"
set +e
timeout "$BENCH_TIMEOUT" "$PY" benchmarks/compression_throughput.py --json "$OUT/compression.json" \
  2>&1 | tee "$OUT/compression.txt"
BENCH_RC=${PIPESTATUS[0]}
set -e

step "done: pytest rc=$TEST_RC, benchmark rc=$BENCH_RC, outputs in $OUT"
if [[ "$TEST_RC" -ne 0 ]]; then
  exit "$TEST_RC"
fi
exit "$BENCH_RC"
