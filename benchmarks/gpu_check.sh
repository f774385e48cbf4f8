#!/usr/bin/env bash
# The GPU check on a machine that already has torch, JAX with CUDA, Triton, NCCL, flax and lightning
# (nothing is downloaded: these machines have no network).  About 5 minutes on one H200.
#
#   bash benchmarks/gpu_check.sh                  # results in $OUT/results.json (default ./gpu_check_out)
#   bash benchmarks/gpu_check.sh --cpu            # the CPU dry run (automatic without CUDA)
#   bash benchmarks/gpu_check.sh --only 7,11      # some checks; any option of benchmarks/gpu_check.py
#   bash benchmarks/gpu_check.sh --gpus 8         # the checks of 8 GPUs (20-30), one process per GPU
#
# PYTHON picks the interpreter (default: python3).  Installs bagua_x from this checkout without
# dependencies (and without build isolation, which would download setuptools), then runs
# benchmarks/gpu_check.py.  Exit status: 0 only if every check passed (in the dry run: none failed).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
export OUT="${OUT:-$REPO/gpu_check_out}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false # JAX shares the GPU with torch

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi unavailable"
# the checks import bagua_x from this checkout either way (PYTHONPATH); the install is what a user would do
"$PY" -m pip install --quiet --no-deps --no-build-isolation -e . ||
  echo "pip install -e . failed; running from the checkout"
exec "$PY" benchmarks/gpu_check.py "$@"
