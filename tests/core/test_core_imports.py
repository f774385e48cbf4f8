"""The layering of DESIGN.md, checked: core, algorithms, testing and nccl import no framework; the frontends never
import each other (neither at import time nor in any function body)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "bagua_x"


def test_core_algorithms_testing_and_nccl_import_neither_torch_nor_jax():
    code = (
        "import sys, bagua_x.core, bagua_x.algorithms, bagua_x.testing, bagua_x.nccl;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'jax', 'jaxlib'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"frameworks imported: {out.stdout} {out.stderr}"


def imported_modules(path: Path, root: Path = PACKAGE) -> set[str]:
    """Absolute names of every module ``path`` imports, anywhere in the file (relative imports resolved)."""
    package = ["bagua_x", *path.parent.relative_to(root).parts]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            found.add(".".join([*base, node.module] if node.module else base))
    return found


@pytest.mark.parametrize("layer, forbidden", [
    ("core", ("torch", "jax", "jaxlib", "bagua_x.torch", "bagua_x.jax", "bagua_x.algorithms", "bagua_x.apps")),
    ("algorithms", ("torch", "jax", "jaxlib", "bagua_x.torch", "bagua_x.jax", "bagua_x.apps")),
    ("testing", ("torch", "jax", "jaxlib", "bagua_x.torch", "bagua_x.jax", "bagua_x.apps")),
    ("torch", ("jax", "jaxlib", "flax", "optax", "bagua_x.jax", "bagua_x.apps")),
    ("jax", ("torch", "bagua_x.torch", "bagua_x.apps")),
])
def test_imports_only_point_down(layer, forbidden):
    files = sorted((PACKAGE / layer).rglob("*.py"))
    assert files
    bad = [(str(f.relative_to(PACKAGE)), m) for f in files for m in sorted(imported_modules(f))
           if any(m == name or m.startswith(name + ".") for name in forbidden)]
    assert bad == [], f"imports against the layering: {bad}"


def test_the_import_scan_sees_relative_and_nested_imports(tmp_path):
    src = tmp_path / "bagua_x" / "jax" / "probe.py"
    src.parent.mkdir(parents=True)
    src.write_text("def f():\n    from ..torch import wrap\n    from . import wrap\n    import torch.nn\n")
    assert imported_modules(src, tmp_path / "bagua_x") == {"bagua_x.torch", "bagua_x.jax", "torch.nn"}
