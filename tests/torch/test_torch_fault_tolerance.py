"""Fault-tolerant replica groups on torchft: real nodes (2 processes each) and a real lighthouse, one node killed.

Each node is its own torch.distributed world (its own store on 127.0.0.1) and
a torchft replica group; the lighthouse runs from the torchft wheel.  A node is
killed with SIGKILL (every rank) in the middle of training and started again
as torchrun --max-restarts would; the other node must train on, the restarted
one must heal from it, and the run must end with every rank's weights equal.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from ft_job import FaultJob

torch = pytest.importorskip("torch")
pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parents[2]
NODE = ROOT / "tests" / "torch" / "bx_ft_node.py"
RANKS = 2  # per node


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job(FaultJob):
    """A lighthouse and the nodes of one run (RANKS processes each, torchrun-style variables)."""

    def __init__(self, tmp: Path, algorithm: str, target: int, delay: float):
        super().__init__(tmp)
        self.algorithm, self.target, self.delay = algorithm, target, delay

    def start(self, node: int, **extra_env: str) -> None:
        port, procs = _port(), []
        for rank in range(RANKS):
            env = dict(os.environ, **extra_env, RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       REPLICA_GROUP_ID=f"node{node}", TORCHFT_LIGHTHOUSE=self.address,
                       PYTHONPATH=str(ROOT), RUST_LOG="warn")
            procs.append(subprocess.Popen([sys.executable, str(NODE), self.algorithm, str(self.target),
                                           str(self.log(node, rank)), str(self.delay)],
                                          env=env, stdout=open(self.out(node, rank), "a"), stderr=subprocess.STDOUT))
        self.procs[node] = procs


@pytest.fixture
def job_factory(tmp_path):
    jobs = []

    def make(algorithm: str, target: int, delay: float = 0.03) -> Job:
        jobs.append(Job(tmp_path, algorithm, target, delay))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


def _final(job: Job, what: str) -> list[dict]:
    """Every rank's final ``what`` ("model": its weights; "algorithm": its algorithm_state_dict()), flat."""
    out = []
    for node in (0, 1):
        for rank in range(RANKS):
            saved = torch.load(f"{job.log(node, rank)}.pt")[what]
            out.append(dict(_flat(saved)))
    return out


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flat(v, f"{prefix}/{i}")
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree


def _assert_equal_everywhere(job: Job, values: list[dict], what: str, own: tuple = ()) -> None:
    """``values`` (one per rank, node-major) bitwise equal on every rank; entries named ``own`` (a worker's own
    state) only on the ranks of one node."""
    assert values[0], f"no {what} saved"
    for i, v in enumerate(values[1:], 1):
        assert v.keys() == values[0].keys()
        for name in v:
            first = values[0] if not name.endswith(own) or not own else values[i // RANKS * RANKS]
            assert torch.equal(v[name], first[name]), (
                f"{what} {name} differs between rank 0 and node {i // RANKS} rank {i % RANKS} after "
                f"healing; last steps: {job.lines(0)[-3:]} {job.lines(1)[-3:]}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", ["allreduce", "bytegrad"])
def test_a_killed_node_heals_while_the_other_trains_on(job_factory, algorithm):
    """kill -9 of every rank of node 1 mid-run: node 0 commits again within 30 s without restarting; node 1,
    started again, heals from node 0 and trains with it within 60 s; the weights end equal on every rank, and
    the committed steps consume the global batch count exactly once (no batch lost or seen twice)."""
    job = job_factory(algorithm, target=260)
    measured = job.kill_and_restart(after=40, rejoin_timeout=60)
    assert measured["survivor_resumed"] < 30 and measured["rejoined"] < 60
    assert measured["alone"], "node 0's first commit after the kill had two nodes: the kill was not seen"
    after = job.lines(1)[measured["before"]:]
    assert after[0]["step"] > measured["steps_at_kill"], "the restarted node started over instead of healing"
    _assert_equal_everywhere(job, _final(job, "model"), "weight")
    # every committed step drew the batches [start, start + nodes) of the global count: contiguous, none twice
    committed = [e for e in job.lines(0) if e["committed"]]
    starts = [e["index"] - e["rank_in_quorum"] for e in committed]
    for previous, entry, start in zip(committed, committed[1:], starts[1:]):
        assert start == previous["index"] - previous["rank_in_quorum"] + previous["nodes"], (previous, entry)
    assert committed[-1]["step"] == job.target


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", ["diloco", "sparseloco"])
def test_diloco_survives_a_killed_node_and_heals_its_outer_state(job_factory, algorithm):
    """DiLoCo (H=4) and SparseLoCo: the survivor's next outer step goes on alone (a step that the kill caught in
    flight is discarded, rolled back and retried; here the quorum usually leaves the dead node out first: the
    survivor discarded none in this session's runs); the restarted node heals at its first outer step (the global copy, the outer momentum, the
    error feedback, the inner optimizer and the data position) and from there every rank holds the same global
    weights and outer state, bit for bit."""
    job = job_factory(algorithm, target=480)
    measured = job.kill_and_restart(after=12, rejoin_timeout=60)
    assert measured["survivor_resumed"] < 30 and measured["rejoined"] < 60
    assert measured["alone"]
    states = _final(job, "algorithm")
    assert any("global_weights" in k for k in states[0]), list(states[0])
    # the error feedback is each node's own (what it has not sent): equal inside a node, apart between nodes
    _assert_equal_everywhere(job, states, "algorithm state", own=("/error",))
    if algorithm == "sparseloco":
        errors = [v for k, v in states[0].items() if k.endswith("/error")]
        assert errors and any(e.abs().sum() > 0 for e in errors)
    committed = [e for e in job.lines(0) if e["committed"]]
    outer = [e["step"] for e in committed]
    assert outer == list(range(outer[0], outer[0] + len(outer))), "an outer step was committed twice or skipped"


@pytest.mark.timeout(120)
def test_a_node_with_another_model_is_refused_when_it_heals(job_factory):
    """A node that joins a running job with another model cannot heal from it: each of its ranks raises a
    BaguaXError naming what differs, while the job trains on."""
    job = job_factory("allreduce", target=100_000)
    job.start(0)
    job.wait_for(lambda: len(job.lines(0)) >= 5, 60, "steps of node 0")
    job.start(1, BX_FT_WIDTH="16")
    for p in job.procs[1]:
        p.wait(timeout=60)
    for rank in range(RANKS):
        assert job.procs[1][rank].returncode != 0
        text = job.out(1, rank).read_text()
        assert "BaguaXError" in text and "cannot heal from its peer: the model differs" in text, job.output(1)
    job.procs.pop(1)  # gone, as it should be
    trained = len(job.lines(0))
    job.wait_for(lambda: len(job.lines(0)) > trained + 5, 30, "node 0 training on")
    assert all(p.poll() is None for p in job.procs[0])


@pytest.mark.timeout(120)
def test_an_unreachable_lighthouse_is_named_on_every_rank():
    from launch import run_workers

    results = run_workers("bx_fault_workers:ft_without_lighthouse", nproc=2, expect_failure=True, timeout=90,
                          env={"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{_port()}", "REPLICA_GROUP_ID": "node0",
                               "PYTHONPATH": str(ROOT / "tests" / "torch")})
    assert len(results) == 2
    for status, text in results:
        assert status == "error" and "BaguaXError" in text and "cannot be reached" in text, text


def test_settings_and_algorithms_are_checked_before_any_connection(monkeypatch):
    from bagua_x.algorithms import ByteGrad, DiLoCo, GradientAllReduce, PowerSGD, SparseLoCo
    from bagua_x.core.errors import BaguaXError
    from bagua_x.torch import FaultTolerance
    from bagua_x.ft import reachable_address
    from bagua_x.torch.fault_tolerance import check_supported

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    with pytest.raises(BaguaXError, match="lighthouse .*and replica_id .*not set"):
        FaultTolerance().resolved()
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")
    monkeypatch.setenv("REPLICA_GROUP_ID", "node3")
    settings = FaultTolerance().resolved()
    assert (settings.lighthouse, settings.replica_id, settings.address) == ("http://127.0.0.1:29510", "node3",
                                                                            "127.0.0.1")
    assert reachable_address("http://127.0.0.1:1") == "127.0.0.1"
    with pytest.raises(BaguaXError, match="min_replicas"):
        FaultTolerance(min_replicas=0).resolved()
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(BaguaXError, match="declare elastic_nodes .GradientAllReduce, ByteGrad, DiLoCo.*not PowerSGD"):
        check_supported(PowerSGD(), optimizer)
    with pytest.raises(BaguaXError, match="exchange_lag 1: DiLoCo's fragment_sync_delay"):
        check_supported(DiLoCo(sync_every=8, fragments=2, fragment_sync_delay=1), optimizer)
    with pytest.raises(BaguaXError, match="needs the optimizer"):
        check_supported(GradientAllReduce(), None)
    # a node is one worker: every supported algorithm runs over nodes, its other settings kept
    for algorithm in (GradientAllReduce(average=False), ByteGrad(hierarchical=False), SparseLoCo(sync_every=5)):
        ran = check_supported(algorithm, optimizer)
        assert ran.hierarchical is True and type(ran) is type(algorithm)
        assert {**ran.hyperparameters(), "hierarchical": None} == {**algorithm.hyperparameters(), "hierarchical": None}


@pytest.mark.timeout(120)
def test_a_restarted_node_alone_never_trains_from_its_initial_weights(job_factory):
    """A node restarted by torchrun (TORCHELASTIC_RESTART_COUNT > 0) that finds no live node waits for one
    (quorum_timeout), then every rank raises: it must not become the quorum and overwrite the job's progress.
    (At the job's start, restart count 0, a node alone trains, as the other tests' first steps show.)"""
    job = job_factory("allreduce", target=50)
    job.start(1, TORCHELASTIC_RESTART_COUNT="1", BX_FT_QUORUM_TIMEOUT="4")
    for p in job.procs[1]:
        p.wait(timeout=90)
    job.procs.pop(1)
    assert job.lines(1) == [], "the restarted node trained alone"
    for rank in range(RANKS):
        text = job.out(1, rank).read_text()
        assert "was restarted and found no live node to heal from" in text, text[-3000:]
