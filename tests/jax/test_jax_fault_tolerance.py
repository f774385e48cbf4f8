"""Fault-tolerant JAX nodes: each node one JAX process (2 CPU devices) of its own, DiLoCo's exchange between nodes
on the host through torchft, a real lighthouse; one node killed with SIGKILL and started again.

The nodes are independent JAX jobs (no jax.distributed): only torchft's group joins them, so losing one leaves
the other training, and the restarted one heals from it.  The parity test runs the same job without faults
against an independent reference (two optax inner loops and an optax Nesterov outer step, no bagua_x).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("torchft")
from ft_job import FaultJob  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NODE = ROOT / "tests" / "jax" / "bx_ft_jax_node.py"


class Job(FaultJob):
    """A lighthouse and one JAX process per node."""

    def __init__(self, tmp: Path, algorithm: str, sync_every: int, target: int, min_replicas: int = 1,
                 delay: float = 0.0):
        super().__init__(tmp, min_replicas)
        self.args, self.delay = [algorithm, str(sync_every), str(target)], delay

    def start(self, node: int, **env: str) -> None:
        env = dict(os.environ, **env, REPLICA_GROUP_ID=f"node{node}", TORCHFT_LIGHTHOUSE=self.address,
                   PYTHONPATH=str(ROOT), RUST_LOG="warn")
        env.pop("XLA_FLAGS", None)  # the node sets its own 2 devices
        self.procs[node] = [subprocess.Popen([sys.executable, str(NODE), *self.args, str(self.log(node)), str(self.delay)],
                                             env=env, stdout=open(self.out(node), "a"), stderr=subprocess.STDOUT)]

    def final(self, node: int) -> dict:
        """Node ``node``'s saved params (row 0) and algorithm state, by key path."""
        saved = np.load(f"{self.log(node)}.npz")
        n = int(saved["n_params"])
        arrays = [saved[f"arr_{i}"] for i in range(len(saved.files) - 2)]
        return {"params": arrays[:n], "state": dict(zip(saved["state_names"], arrays[n:]))}


@pytest.fixture
def jobs(tmp_path):
    made = []

    def make(*args, **kwargs) -> Job:
        made.append(Job(tmp_path, *args, **kwargs))
        return made[-1]

    yield make
    for job in made:
        job.close()


def _reference(sync_every: int, steps: int, nodes: int = 2) -> list[np.ndarray]:
    """``nodes`` DiLoCo workers without bagua_x: each its own optax SGD (momentum) on its own stream, the whole
    node batch's gradient; every H steps an optax Nesterov SGD step on the global copy with gradient
    ``global - mean(local)``, and every worker restarts from it.  The final weights, one array per leaf."""
    import jax
    import optax

    import bx_ft_jax_node as node

    tx, outer = optax.sgd(node.LR, momentum=node.MOMENTUM), optax.sgd(0.7, momentum=0.9, nesterov=True)
    local = [jax.tree.map(np.asarray, node.make_params(0)) for _ in range(nodes)]
    opts = [tx.init(p) for p in local]
    global_weights = node.make_params(0)
    outer_state = outer.init(global_weights)
    for t in range(steps):
        for n in range(nodes):
            grads = jax.grad(node.loss_fn)(local[n], *node.batch(n, t))
            updates, opts[n] = tx.update(grads, opts[n], local[n])
            local[n] = optax.apply_updates(local[n], updates)
        if (t + 1) % sync_every == 0:
            pseudo = jax.tree.map(lambda g, *ls: g - sum(ls) / nodes, global_weights, *local)
            updates, outer_state = outer.update(pseudo, outer_state, global_weights)
            global_weights = optax.apply_updates(global_weights, updates)
            local = [global_weights] * nodes
    return [np.asarray(a) for a in jax.tree.leaves(local[0])]


@pytest.mark.timeout(180)
def test_two_jax_nodes_equal_the_diloco_reference(jobs):
    """Two fault-tolerant JAX nodes without faults, from one seed (``init_sync=False``; the lighthouse waits for
    both at every outer step): both end
    with bitwise equal weights, equal to two plain optax DiLoCo workers to float32 rounding; a node that
    skipped the exchange or averaged wrongly would be far off (the two streams differ)."""
    sync_every, target = 4, 12
    job = jobs("diloco", sync_every, target, min_replicas=2)
    job.start(0, BX_FT_SEED="0")
    job.start(1, BX_FT_SEED="0")
    job.finish(timeout=150)
    expected = _reference(sync_every, target)
    finals = [job.final(n)["params"] for n in (0, 1)]
    assert len(finals[0]) == len(finals[1]) == len(expected) == 4
    for a, b, e in zip(*finals, expected):
        assert np.array_equal(a, b), "the nodes hold different weights after an outer step"
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
    for n in (0, 1):
        outer = [e for e in job.lines(n) if e["committed"]]
        assert [e["inner"] for e in outer] == [4, 8, 12] and all(e["nodes"] == 2 for e in outer), job.lines(n)
        assert job.lines(n)[-1]["discarded"] == 0


@pytest.mark.timeout(120)
def test_a_lone_jax_node_under_pmap_equals_one_diloco_worker(jobs):
    """The same protocol with the step under ``jax.pmap`` (the node's params laid out per device by pmap), one
    node alone in the quorum: it equals one plain optax DiLoCo worker (its own pseudo-gradient as the mean)."""
    job = jobs("diloco", 3, 9)
    job.start(0, BX_FT_SEED="0", BX_FT_PMAP="1")
    job.finish(timeout=100)
    final, expected = job.final(0)["params"], _reference(3, 9, nodes=1)
    assert len(final) == len(expected) == 4
    for a, e in zip(final, expected):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
    assert [e["inner"] for e in job.lines(0) if e["committed"]] == [3, 6, 9]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ["diloco", "sparseloco"])
def test_a_killed_jax_node_heals_while_the_other_trains_on(jobs, algorithm):
    """kill -9 of node 1's process mid-run: node 0 commits its next outer step alone within 30 s and never
    restarts; node 1, started again, heals from node 0 (weights, optimizer state, DiLoCo's global copy and
    momentum, the data position) and commits with it; both end (at an outer step) with bitwise equal weights and
    algorithm state (not the inner optimizer's, nor SparseLoCo's error feedback: each worker's own), and node
    0's outer steps are committed once each, none skipped."""
    job = jobs(algorithm, 4, 400, delay=0.02)  # node 0 alone trains on for >= 8 s: more than node 1's restart
    measured = job.kill_and_restart(after=3, rejoin_timeout=90, TORCHELASTIC_RESTART_COUNT="1")
    assert measured["survivor_resumed"] < 30 and measured["rejoined"] < 90, measured
    assert measured["alone"], "node 0's first commit after the kill had two nodes: the kill was not seen"
    # healed: the data position is the peer's, far past the restarted node's own first outer step (4)
    assert measured["first_commit_after_restart"]["inner"] > 8, measured
    finals = [job.final(n) for n in (0, 1)]
    for a, b in zip(finals[0]["params"], finals[1]["params"]):
        assert np.array_equal(a, b)
    names = list(finals[0]["state"])
    assert any("global_weights" in n for n in names) and any("momentum" in n for n in names), names
    for name in names:
        if not name.endswith(".error"):
            assert np.array_equal(finals[0]["state"][name], finals[1]["state"][name]), name
    steps = [e["step"] for e in job.lines(0) if e["committed"]]
    assert steps == list(range(steps[0], steps[0] + len(steps))), "an outer step was committed twice or skipped"
    assert job.procs[0][0].returncode == 0


@pytest.mark.timeout(120)
def test_a_jax_node_with_another_model_is_refused_when_it_heals(jobs):
    """A node that joins a running job with another model cannot heal from it: it raises a BaguaXError naming
    what differs, while the job trains on."""
    job = jobs("diloco", 4, 100_000, delay=0.02)
    job.start(0)
    job.wait_for(lambda: sum(e["committed"] for e in job.lines(0)) >= 2, 60, "outer steps of node 0")
    job.start(1, BX_FT_HIDDEN="8")
    job.procs[1][0].wait(timeout=60)
    text = job.out(1).read_text()
    assert job.procs[1][0].returncode != 0
    assert "BaguaXError" in text and "cannot heal from its peer: the model differs" in text, job.output(1)
    job.procs.pop(1)
    trained = len(job.lines(0))
    job.wait_for(lambda: len(job.lines(0)) > trained + 8, 30, "node 0 training on")
    assert job.procs[0][0].poll() is None


def test_fault_tolerance_is_refused_where_it_cannot_work():
    """Before any connection: a gradient algorithm (it would cross nodes on the host every step) and DiLoCo's
    exchange in flight across steps are refused, naming what runs instead; an unreachable lighthouse is named
    within the timeout."""
    import jax.numpy as jnp

    import bagua_x.jax as bxj
    from bagua_x.algorithms import ByteGrad, DiLoCo
    from bagua_x.core.errors import BaguaXError

    params = {"w": jnp.ones((4, 4))}
    ft = bxj.FaultTolerance(lighthouse="http://127.0.0.1:1", replica_id="node0")
    with pytest.raises(BaguaXError, match="ByteGrad would cross nodes on the host at every step: use DiLoCo"):
        bxj.wrap(params, algorithm=ByteGrad(), fault_tolerance=ft)
    with pytest.raises(BaguaXError, match="fragment_sync_delay"):
        bxj.wrap(params, algorithm=DiLoCo(sync_every=8, fragments=2, fragment_sync_delay=1), fault_tolerance=ft)
    with pytest.raises(BaguaXError, match="this wrap has no fault_tolerance"):
        bxj.wrap(params, algorithm=DiLoCo()).sync_replicas(params, None, ())
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    unreachable = bxj.FaultTolerance(lighthouse=f"http://127.0.0.1:{port}", replica_id="node0", timeout=1)
    with pytest.raises(BaguaXError, match="the lighthouse .* cannot be reached .*start it first"):
        bxj.wrap(params, algorithm=DiLoCo(), fault_tolerance=unreachable)
