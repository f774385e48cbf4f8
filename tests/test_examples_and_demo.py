"""The examples (which the docs include from examples/) and ``bagua-x demo`` run end to end, so they never rot."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bagua_x.apps import cluster
from bagua_x.apps.launch import can_cap
from launch import free_port

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd, timeout, env=None):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _losses(text):
    return [float(x) for x in re.findall(r"loss\s+([0-9.]+)", text)]


def test_torch_example_under_torchrun():
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "examples/torch_train.py", "bytegrad"],
               timeout=180)
    losses = _losses(out)
    assert len(losses) >= 2 and losses[-1] < 0.5 * losses[0], out


@pytest.mark.parametrize("example", ["examples/jax_pmap_train.py", "examples/jax_shard_map_train.py",
                                     "examples/jax_jit_train.py"])
def test_jax_examples_one_process_four_devices(example):
    out = _run([sys.executable, example], timeout=180,
               env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    losses = _losses(out)
    assert len(losses) >= 2 and losses[-1] < losses[0], out


def test_demo_end_to_end(tmp_path):
    """The demo's torch and JAX jobs on the best setting this machine allows (the 2x2 cluster as root), at a first
    link and a slower one, where every run stops at its settled step (``--cap 0``) and the rest is projected."""
    algorithms = ("allreduce", "bytegrad", "diloco", "sparseloco")  # the demo's own set
    out = _run([sys.executable, "-m", "bagua_x.cli", "demo", "--steps", "48", "--seconds", "0", "--cap", "0",
                "--hidden", "256", "--target", "0.5", "--links", "1gbit", "100mbit", "--algorithms", *algorithms,
                "--out", str(tmp_path)], timeout=420)
    assert "[Gloo]" not in out, out  # gloo's C++ connection lines are filtered out of the demo's output
    assert "to 50% acc" in out and "speedup" in out, out
    table = json.loads((tmp_path / "demo.json").read_text())
    cluster_here = os.geteuid() == 0 and cluster.missing_prerequisite() is None
    assert table["setting"] == ("cluster" if cluster_here else "capped" if can_cap() else "loopback"), table
    assert table["target_accuracy"] == 0.5
    network = {"cluster": "2 nodes x 2 ranks", "capped": "capped at", "loopback": "uncapped loopback"}[table["setting"]]
    assert set(table["description"]) == {"torch", "jax"}, table  # both frontends ran on that network
    assert all(network in title for title in table["description"].values()), table["description"]
    links = ["1gbit", "100mbit"] if table["setting"] != "loopback" else [None]
    assert table["links"] == links and ("note:" in out) == (table["setting"] != "cluster"), out
    runs = {(r["frontend"], r["link"], r["algorithm"]): r for r in table["runs"]}
    assert set(runs) == {(f, link, a) for f in ("torch", "jax") for link in links for a in algorithms}
    for (frontend, link, algorithm), r in runs.items():
        assert len(r["seconds"]) == len(r["losses"]) <= 48, r
        assert r["step_ms"] > 0 and r["seconds"] == sorted(r["seconds"]) and r["seconds"][-1] > 0, r
        base = runs[(frontend, link, "allreduce")]["time_to_target_s"]
        assert r["speedup_vs_allreduce"] == pytest.approx(base / r["time_to_target_s"]), r
        if link != links[0]:
            continue
        assert r["losses"][-1] < r["losses"][0], r
        first = next(step for step, accuracy in r["evals"] if accuracy >= 0.5)  # each reaches 50 %
        assert r["time_to_target_s"] == r["seconds"][first - 1] > 0 and not r["projected"], r
        if len(links) == 1:
            continue
        slow = runs[(frontend, links[1], algorithm)]
        # the same step, stopped once settled (first step, torch ByteGrad's form trial, one exchange period)
        assert slow["reference_step"] == first and slow["window"] == (8 if "loco" in algorithm else 1), slow
        trial = 12 if algorithm == "bytegrad" else 0  # its form trial may time two forms: kept clear of
        settled = 1 + trial + slow["window"]
        assert len(slow["seconds"]) == min(first, settled) and slow["projected"] == (first > settled), slow
        if algorithm in ("allreduce", "diloco"):  # no form chosen by timing: the first link's trajectory
            n = len(slow["losses"])
            assert slow["losses"] == pytest.approx(r["losses"][:n], rel=1e-6), (slow["losses"], r["losses"])
    assert runs[("torch", links[0], "allreduce")]["parameters"] == 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    for frontend in ("torch", "jax"):  # DiLoCo (H = 8) sends allreduce's bytes once per 8 steps; 2 % at 2 bits far less
        allreduce, diloco = runs[(frontend, links[0], "allreduce")], runs[(frontend, links[0], "diloco")]
        assert diloco["bytes_per_step"] == pytest.approx(allreduce["bytes_per_step"] / 8)
        assert runs[(frontend, links[0], "sparseloco")]["bytes_per_step"] < diloco["bytes_per_step"] / 25
    assert (tmp_path / "demo.png").stat().st_size > 10_000
