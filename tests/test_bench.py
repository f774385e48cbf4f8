"""``bagua-x bench``: from an installed wheel, and its JAX rows on a ``bagua-x cluster``.

Its scripts ship in the package, so it runs outside a source checkout.  The wheel goes into a fresh venv that sees this environment's packages
(torch, jax, ...) through a ``.pth`` line but not its editable bagua_x (the
editable finder is a ``.pth`` *import*, which a path line does not run), and
the bench runs from a directory outside the checkout.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from bagua_x.apps import cluster

ROOT = Path(__file__).resolve().parents[1]


def _ok(cmd, cwd, timeout, env=None):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc.stdout


def test_bench_runs_from_an_installed_wheel(tmp_path):
    src, dist, venv, work = tmp_path / "src", tmp_path / "dist", tmp_path / "venv", tmp_path / "elsewhere"
    work.mkdir()
    # built from a copy: setuptools writes build/ next to the sources, and the checkout stays untouched
    shutil.copytree(ROOT / "bagua_x", src / "bagua_x", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    _ok([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, src], tmp_path,
        120)
    _ok([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, 60)
    python = venv / "bin" / "python"
    site = Path(_ok([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], work, 30).strip())
    (site / "outer_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _ok([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", *dist.glob("*.whl")],
        tmp_path, 120)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = _ok([python, "-c", "import bagua_x.apps.benchmarks as b; print(b.__file__)"], work, 60, env).strip()
    assert where.startswith(str(site)), where  # the wheel's copy, not the checkout's
    assert "--nodes" in _ok([venv / "bin" / "bagua-x", "bench", "--help"], work, 60, env)
    _ok([venv / "bin" / "bagua-x", "bench", "--quick", "--no-jax", "--no-capped", "--models", "mlp",
         "--algorithms", "bytegrad", "--out", "out"], work, 240, {**env, "OMP_NUM_THREADS": "1"})
    rows = json.loads((work / "out" / "bench.json").read_text())
    assert [(r["frontend"], r["link"], r["model"], r["what"], r["baseline"]) for r in rows] == [
        ("torch", "loopback", "mlp", "bytegrad", "DDP")]
    assert 0.1 < rows[0]["ratio"] < 10, rows


@pytest.mark.skipif(os.geteuid() != 0 or cluster.missing_prerequisite() is not None,
                    reason="bagua-x cluster needs root and ip, tc, unshare, mount, hostname (network namespaces)")
def test_jax_rows_on_a_cluster(tmp_path):
    """Every system of the JAX job ran on the 2-node cluster and each row holds its own two times (not a timing)."""
    _ok([sys.executable, "-m", "bagua_x.cli", "bench", "--nodes", "2", "--nproc-per-node", "1", "--no-torch",
         "--models", "mlp", "--algorithms", "bytegrad", "--quick", "--out", tmp_path], ROOT, 240,
        {**os.environ, "OMP_NUM_THREADS": "1"})
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["what"], r["baseline"]) for r in rows] == [
        ("bytegrad", "per-leaf pmean"), ("bytegrad", "bagua_x allreduce"), ("bytegrad", "compute only"),
        ("jit:allreduce", "XLA's reduction (jit)"), ("jit:bytegrad", "XLA's reduction (jit)"),
        ("jit:bytegrad/mesh2d", "XLA's reduction (jit)")]
    assert {(r["frontend"], r["link"], r["model"]) for r in rows} == {("jax", "2x1 1gbit", "mlp")}
    jit_rows, rows = rows[3:], rows[:3]
    xla = jit_rows[0]["baseline_ms"]
    assert all(r["baseline_ms"] == xla and r["ratio"] == pytest.approx(r["bagua_x_ms"] / xla) for r in jit_rows)
    assert len({r["bagua_x_ms"] for r in jit_rows} | {xla}) == 4, jit_rows  # four systems timed
    bytegrad = rows[0]["bagua_x_ms"]
    for r in rows:
        assert r["bagua_x_ms"] == bytegrad and r["ratio"] == pytest.approx(bytegrad / r["baseline_ms"]), r
    pmean, allreduce, compute = (r["baseline_ms"] for r in rows)
    assert len({pmean, allreduce, compute}) == 3, rows  # three systems timed, not one time copied
    assert compute < min(pmean, allreduce), rows  # 50 MB of gradient a step over 1 Gbit/s: the floor is below both


def test_without_matplotlib_the_table_stands_and_the_plot_says_what_to_install(tmp_path, monkeypatch):
    from bagua_x.apps import bench

    rows = [{"frontend": "torch", "link": "loopback", "model": "mlp", "what": "bytegrad", "baseline": "DDP",
             "baseline_ms": 10.0, "bagua_x_ms": 8.0, "ratio": 0.8}]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ModuleNotFoundError
    note = bench.plotted(rows, tmp_path / "bench.png")
    assert "matplotlib is not installed" in note and "bagua-x[demo]" in note
    assert not (tmp_path / "bench.png").exists()
