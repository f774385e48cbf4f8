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
    ("ft", ("jax", "jaxlib", "flax", "optax", "bagua_x.torch", "bagua_x.jax", "bagua_x.apps")),
])
def test_imports_only_point_down(layer, forbidden):
    files = sorted((PACKAGE / layer).rglob("*.py"))
    assert files
    bad = [(str(f.relative_to(PACKAGE)), m) for f in files for m in sorted(imported_modules(f))
           if any(m == name or m.startswith(name + ".") for name in forbidden)
           and (str(f.relative_to(PACKAGE)), m.split(".")[0]) not in BRIDGES]
    assert bad == [], f"imports against the layering: {bad}"


#: the one JAX module that imports torch: fault tolerance's exchange between nodes runs on torchft (bagua_x.ft),
#: and ``bagua_x.jax`` imports it only for ``wrap(fault_tolerance=...)``
BRIDGES = {("jax/fault_tolerance.py", "torch")}


def test_the_jax_frontend_imports_torch_only_for_fault_tolerance():
    code = ("import sys, jax.numpy as jnp, bagua_x.jax as bxj; from bagua_x.algorithms import DiLoCo;"
            "bxj.wrap({'w': jnp.ones(4)}, algorithm=DiLoCo()); sys.exit('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"bagua_x.jax imported torch without fault_tolerance: {out.stderr[-2000:]}"


def test_the_import_scan_sees_relative_and_nested_imports(tmp_path):
    src = tmp_path / "bagua_x" / "jax" / "probe.py"
    src.parent.mkdir(parents=True)
    src.write_text("def f():\n    from ..torch import wrap\n    from . import wrap\n    import torch.nn\n")
    assert imported_modules(src, tmp_path / "bagua_x") == {"bagua_x.torch", "bagua_x.jax", "torch.nn"}


def module_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """bagua_x's modules and the bagua_x modules each imports (``from . import x`` counted as module ``x``;
    a package's own ``__init__`` is not counted as a dependency of the modules inside it)."""
    files = {".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): f
             for f in root.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = ["bagua_x", *path.parent.relative_to(root).parts]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])]
                                if node.level else [node.module])
                candidates = [f"{base}.{a.name}" for a in node.names] + [base]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            for m in candidates:
                while m not in files and "." in m:
                    m = m.rsplit(".", 1)[0]
                if m in files and m != name and not name.startswith(m + "."):
                    deps.add(m)
                    break
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_back_into_itself():
    """No import cycle between bagua_x's modules, counting imports inside functions and under TYPE_CHECKING:
    a reader can follow any module down without meeting it again."""
    assert cycles(module_graph()) == []


def test_only_the_facade_imports_the_torch_integrations():
    """Integrations (Lightning, the DDP hook, Bagua's API) sit on top of the torch frontend: the frontend's own
    modules never import them; only ``bagua_x.torch`` re-exports them."""
    graph = module_graph()
    bad = sorted((name, dep) for name, deps in graph.items() for dep in deps
                 if dep.startswith("bagua_x.torch.integrations") and not name.startswith("bagua_x.torch.integrations")
                 and name != "bagua_x.torch")
    assert bad == []


def test_the_cycle_finder_sees_a_cycle_through_a_function_body(tmp_path):
    root = tmp_path / "bagua_x"
    (root / "torch").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "torch" / "__init__.py").write_text("")
    (root / "torch" / "a.py").write_text("from . import b\n")
    (root / "torch" / "b.py").write_text("def f():\n    from .c import g\n")
    (root / "torch" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n")
    assert cycles(module_graph(root)) == [["bagua_x.torch.a", "bagua_x.torch.b", "bagua_x.torch.c"]]
