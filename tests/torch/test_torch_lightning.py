"""BaguaXStrategy in a real Lightning Trainer (devices=2 on CPU, processes started by Lightning's launcher)."""

import os
import pickle
import signal
import subprocess
import sys

import numpy as np
import pytest

from launch import ROOT, free_port

pytest.importorskip("lightning")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bx_lightning_script.py")


def run_lightning(scenario, tmp_path, timeout=150, nodes=1):
    """Run the script as each node's local rank 0 (``NODE_RANK``); Lightning re-runs it for local rank 1.

    Returns each rank's results (``nodes`` x 2 ranks).
    """
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, SCRIPT, scenario, str(tmp_path), str(nodes)],
                              env={**env, "NODE_RANK": str(n)}, cwd=str(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True) for n in range(nodes)]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout)[0].decode(errors="replace"))
    except subprocess.TimeoutExpired:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)  # each node's rank 1 is in its rank 0's session
        pytest.fail(f"Lightning run {scenario} timed out after {timeout}s:\n"
                    + "\n".join(p.communicate()[0].decode()[-3000:] for p in procs))
    outs = [tmp_path / f"rank{r}.pkl" for r in range(2 * nodes)]
    log = "\n".join(logs)
    assert all(p.returncode == 0 for p in procs) and all(o.exists() for o in outs), \
        f"Lightning run {scenario} failed:\n{log[-6000:]}"
    return [pickle.loads(o.read_bytes()) for o in outs]


def max_diff(a, b):
    assert len(a) == len(b) == 4  # two Linear layers
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def test_gradient_allreduce_equals_lightning_ddp(tmp_path):
    for r in run_lightning("ddp_vs_allreduce", tmp_path):
        assert r["ddp"]["trained_by"] == "DistributedDataParallel"
        assert r["bagua_x"]["trained_by"] == "GradientAllReduce"
        assert r["ddp"]["steps"] == r["bagua_x"]["steps"] == 44
        assert max_diff(r["ddp"]["params"], r["bagua_x"]["params"]) <= 1e-6  # 0.0 seen
        assert np.mean(r["bagua_x"]["losses"][-5:]) < 0.5 * np.mean(r["bagua_x"]["losses"][:5])


def test_every_algorithm_trains(tmp_path):
    ranks = run_lightning("algorithms", tmp_path)
    local = max_diff(ranks[0]["local"]["params"], ranks[1]["local"]["params"])  # ranks never averaged
    names = ["ByteGrad", "Decentralized", "LowPrecisionDecentralized", "ModelAverage", "AsyncModelAverage", "QAdam",
             "DiLoCo", "DiLoCo-sparse"]
    for name in names:
        for r in ranks:
            run = r[name]
            assert run["trained_by"] == name.removesuffix("-sparse") and run["steps"] == 44
            first, last = np.mean(run["losses"][:5]), np.mean(run["losses"][-5:])
            # DiLoCo's outer Nesterov step (0.7 x 1.9 of the pseudo-gradient at first) overshoots for a few inner
            # steps after each sync on this small problem: seen 2.305 -> 0.677, held-out accuracy 0.869
            assert last < (0.4 if name.startswith("DiLoCo") else 0.25) * first, f"{name}: loss {first:.3f} -> {last:.3f}"
            # the sparse exchange sends a tenth of each chunk per outer step, and only 11 outer steps fit in 44
            # steps: what error feedback still holds has not landed (seen 0.844, loss 2.3 -> 0.43)
            floor = 0.8 if name == "DiLoCo-sparse" else 0.85
            assert run["accuracy"] > floor, f"{name}: held-out accuracy {run['accuracy']:.3f}"
        apart = max_diff(ranks[0][name]["params"], ranks[1][name]["params"])
        # ModelAverage(period=4) and DiLoCo(sync_every=4): 44 steps end on an average / an outer step
        if name in ("ByteGrad", "QAdam", "ModelAverage", "DiLoCo", "DiLoCo-sparse"):
            assert apart == 0.0, f"{name}: ranks differ by {apart}"
        elif name == "AsyncModelAverage":  # averages on a clock: how many rounds land in 44 steps depends on load
            assert 0 < apart < local, f"{name}: ranks {apart} apart, {local} without averaging"  # = local if none
        else:  # decentralized averaging each step keeps ranks close, not equal
            assert 0 < apart < 0.5 * local, f"{name}: ranks {apart} apart, {local} without averaging"


def test_checkpoint_resume_keeps_algorithm_state(tmp_path):
    ranks = run_lightning("resume:LowPrecisionDecentralized", tmp_path)
    for r in ranks:
        saved = r["saved"]  # each rank wrote its own file; the checkpoint itself names the algorithm only
        assert saved["main"] == {"algorithm": ranks[0]["saved"]["main"]["algorithm"], "world_size": 2}
        assert [f.rsplit(".", 1)[1] for f in saved["rank_files"]] == ["bagua_x-rank0", "bagua_x-rank1"]
        assert saved["algorithm_state"] == [["left", "right", "step", "w"]] * 2
        whole, resumed = r["uninterrupted"], r["resumed"]
        assert whole["steps"] == resumed["steps"] == 44 and len(resumed["losses"]) == 22
        assert resumed["losses"] == whole["losses"][22:]  # the second epoch again, bitwise
        assert max_diff(whole["params"], resumed["params"]) == 0.0  # 0.017 if the algorithm state is not restored
    assert max_diff(ranks[0]["resumed"]["params"], ranks[1]["resumed"]["params"]) > 0  # per-rank weights restored


def test_gradient_accumulation_communicates_once_per_step(tmp_path):
    ranks = run_lightning("accumulate", tmp_path, timeout=240)
    for r in ranks:
        ddp, bx = r["ddp"], r["GradientAllReduce"][2]
        assert ddp["steps"] == bx["steps"] == 12 and len(bx["losses"]) == 24
        assert bx["losses"] == ddp["losses"]  # bitwise: DDP with no_sync on the first micro-batch of each step
        assert max_diff(ddp["params"], bx["params"]) == 0.0
        for name in ("GradientAllReduce", "ByteGrad", "Decentralized", "LowPrecisionDecentralized", "ModelAverage",
                     "QAdam"):
            once, twice = (np.diff([0, *r[name][k]["calls"]]) for k in (1, 2))
            assert len(once) == 12 and len(twice) == 24 and once.sum() > 0, name
            # nothing on a micro-batch without a step; per step, what the run without accumulation does
            assert list(twice[0::2]) == [0] * 12, (name, list(twice))
            assert list(twice[1::2]) == list(once), (name, list(twice), list(once))


def test_hierarchical_variants_over_lightning_nodes(tmp_path):
    ranks = run_lightning("nodes", tmp_path, timeout=240, nodes=2)  # 2 nodes x 2 ranks
    for rank, r in enumerate(ranks):
        for name in ("allreduce", "bytegrad"):  # both forced over nodes: the strategy's node layout is used
            nodes = r[name]["nodes"]
            assert nodes["within"][0] == nodes["across"][0] == 2, (name, nodes)
            assert nodes["within"][1] > 0 and nodes["across"][1] > 0 and nodes["flat"] == 0, (name, nodes)
            assert r[name]["steps"] == 10
        # DDP's allreduce in another summation order
        for a, b in zip(r["ddp"]["params"], r["allreduce"]["params"]):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
        assert max_diff(r["bytegrad"]["params"], ranks[0]["bytegrad"]["params"]) == 0.0
