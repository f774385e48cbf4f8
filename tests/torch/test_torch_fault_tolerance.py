"""Fault-tolerant replica groups on torchft: real nodes (2 processes each) and a real lighthouse, one node killed.

Each node is its own torch.distributed world (its own store on 127.0.0.1) and
a torchft replica group; the lighthouse runs from the torchft wheel.  A node is
killed with SIGKILL (every rank) in the middle of training and started again
as torchrun --max-restarts would; the other node must train on, the restarted
one must heal from it, and the run must end with every rank's weights equal.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parents[2]
NODE = ROOT / "tests" / "torch" / "bx_ft_node.py"
RANKS = 2  # per node


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """A lighthouse and the nodes of one run, all killed at the end whatever happens."""

    def __init__(self, tmp: Path, algorithm: str, target: int, delay: float):
        self.tmp, self.algorithm, self.target, self.delay = tmp, algorithm, target, delay
        self.procs: dict[int, list[subprocess.Popen]] = {}
        code = ("import time\nfrom torchft._torchft import LighthouseServer\n"
                "lh = LighthouseServer(bind='[::]:0', min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=3000)\n"
                "print(lh.address().rsplit(':', 1)[1], flush=True)\ntime.sleep(3600)\n")
        self.lighthouse = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                           stderr=open(tmp / "lighthouse.err", "w"), text=True)
        self.address = f"http://127.0.0.1:{self.lighthouse.stdout.readline().strip()}"

    def log(self, node: int, rank: int = 0) -> Path:
        return self.tmp / f"node{node}-rank{rank}.jsonl"

    def start(self, node: int) -> None:
        port, procs = _port(), []
        for rank in range(RANKS):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       REPLICA_GROUP_ID=f"node{node}", TORCHFT_LIGHTHOUSE=self.address,
                       PYTHONPATH=str(ROOT), RUST_LOG="warn")
            out = open(self.tmp / f"node{node}-rank{rank}.out", "a")
            procs.append(subprocess.Popen([sys.executable, str(NODE), self.algorithm, str(self.target),
                                           str(self.log(node, rank)), str(self.delay)],
                                          env=env, stdout=out, stderr=subprocess.STDOUT))
        self.procs[node] = procs

    def kill(self, node: int) -> float:
        for p in self.procs[node]:
            p.send_signal(signal.SIGKILL)
        for p in self.procs[node]:
            p.wait()
        return time.time()

    def lines(self, node: int, rank: int = 0) -> list[dict]:
        path = self.log(node, rank)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while not predicate():
            for node, procs in self.procs.items():
                for p in procs:
                    if p.poll() not in (None, 0, -signal.SIGKILL):
                        raise AssertionError(f"node {node} exited with {p.returncode} while waiting for {what}:\n"
                                             + self.output(node))
            if time.time() > deadline:
                raise AssertionError(f"no {what} within {timeout} s:\n" + self.output(0) + self.output(1))
            time.sleep(0.05)

    def finish(self, timeout: float) -> None:
        for node, procs in self.procs.items():
            for p in procs:
                try:
                    rc = p.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"node {node} did not finish within {timeout} s:\n" + self.output(node))
                assert rc == 0, f"node {node} exited with {rc}:\n" + self.output(node)

    def output(self, node: int) -> str:
        tails = []
        for rank in range(RANKS):
            path = self.tmp / f"node{node}-rank{rank}.out"
            lines = path.read_text().splitlines() if path.exists() else []
            tails.append(f"--- node {node} rank {rank} ---\n" + "\n".join(
                [line for line in lines if "torchft::" not in line][-30:]))
        return "\n".join(tails) + "\n"

    def close(self) -> None:
        for procs in self.procs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
        self.lighthouse.kill()


@pytest.fixture
def job_factory(tmp_path):
    jobs = []

    def make(algorithm: str, target: int, delay: float = 0.03) -> Job:
        jobs.append(Job(tmp_path, algorithm, target, delay))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


def _final_weights(job: Job) -> list[dict]:
    return [torch.load(f"{job.log(node, rank)}.pt") for node in (0, 1) for rank in range(RANKS)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm", ["allreduce", "bytegrad"])
def test_a_killed_node_heals_while_the_other_trains_on(job_factory, algorithm):
    """kill -9 of every rank of node 1 mid-run: node 0 commits again within 30 s without restarting; node 1,
    started again, heals from node 0 and trains with it within 60 s; the weights end equal on every rank, and
    the committed steps consume the global batch count exactly once (no batch lost or seen twice)."""
    job = job_factory(algorithm, target=260)
    job.start(0)
    job.start(1)
    job.wait_for(lambda: any(e["committed"] and e["nodes"] == 2 and e["step"] >= 40 for e in job.lines(1)),
                 120, "two-node steps before the kill")
    killed_at = job.kill(1)
    job.wait_for(lambda: any(e["committed"] and e["time"] > killed_at for e in job.lines(0)), 30,
                 "commit on node 0 after the kill")
    survivor_resumed = min(e["time"] for e in job.lines(0) if e["committed"] and e["time"] > killed_at) - killed_at
    dead_steps = [e["step"] for e in job.lines(0) if e["committed"] and e["time"] > killed_at and e["nodes"] == 1]
    steps_at_kill = max(e["step"] for e in job.lines(0) if e["time"] <= killed_at)
    before = len(job.lines(1))
    restarted_at = time.time()
    job.start(1)
    job.wait_for(lambda: any(e["committed"] and e["nodes"] == 2 for e in job.lines(1)[before:]), 60,
                 "a two-node step of the restarted node")
    rejoined = min(e["time"] for e in job.lines(1)[before:] if e["committed"]) - restarted_at
    job.finish(timeout=120)
    print(f"{algorithm}: node 0 committed again {survivor_resumed:.1f} s after the kill; node 1 trained again "
          f"{rejoined:.1f} s after its restart; {len(dead_steps)} steps alone")

    assert survivor_resumed < 30 and rejoined < 60
    assert dead_steps, "node 0 never committed alone: the kill was not seen"
    after = job.lines(1)[before:]
    assert after[0]["step"] > steps_at_kill, "the restarted node started over instead of healing to node 0's step"
    weights = _final_weights(job)
    for i, w in enumerate(weights[1:], 1):
        assert w.keys() == weights[0].keys()
        for name in w:
            assert torch.equal(w[name], weights[0][name]), (
                f"{name} differs between node 0 rank 0 and node {i // RANKS} rank {i % RANKS} after healing; "
                f"last steps: {job.lines(0)[-3:]} {job.lines(1)[-3:]}")
    # every committed step drew the batches [start, start + nodes) of the global count: contiguous, none twice
    committed = [e for e in job.lines(0) if e["committed"]]
    starts = [e["index"] - e["rank_in_quorum"] for e in committed]
    for previous, entry, start in zip(committed, committed[1:], starts[1:]):
        assert start == previous["index"] - previous["rank_in_quorum"] + previous["nodes"], (previous, entry)
    assert committed[-1]["step"] == job.target
