import subprocess
import sys


def test_core_algorithms_and_nccl_import_neither_torch_nor_jax():
    code = (
        "import sys, bagua_x.core, bagua_x.algorithms, bagua_x.nccl;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'jax', 'jaxlib'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"frameworks imported: {out.stdout} {out.stderr}"
