"""DiLoCo and Streaming DiLoCo through the JAX frontend (4 CPU devices): an optax inner optimizer per device,
``dp.sync_params`` after each step, under ``jax.pmap`` and ``jax.jit(jax.shard_map(...))``, against references
that never touch the wrap (``bx_jax_diloco_workers.reference``: N param copies, numpy DiLoCoWorkers or an optax
Nesterov outer step)."""

import jax
import numpy as np
import pytest

import bx_jax_diloco_workers as dw
import bx_jax_workers as w
from bagua_x.algorithms import DiLoCo, SparseLoCo
from bagua_x.jax import wrap
from bagua_x.testing.reference import step_size

N, STEPS = dw.N, 9

PLAIN = dict(sync_every=3)
STREAMING = dict(sync_every=4, fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5)
SPARSE = dict(sync_every=3, fraction=0.1, chunk=32)  # SparseLoCo: 3 of every 32 entries, 2 bits, error feedback


@pytest.fixture(scope="module")
def setup():
    return w.make_params(0), *w.make_data(STEPS, N)


def assert_history_close(got, want, atol):
    assert len(got) == len(want) == STEPS
    for s, (g, r) in enumerate(zip(got, want)):
        for d in range(N):
            np.testing.assert_allclose(g[d], r[d], rtol=0, atol=atol, err_msg=f"step {s + 1}, device {d}")


def assert_workers_drift_and_meet(history, alg):
    """Between syncs the devices differ (each ran its own steps); right after a full sync (tau 0, alpha 0) they
    are bitwise equal: what separates DiLoCo from both plain data parallelism and no communication."""
    drifted = any(not np.array_equal(h[0], h[1]) for h in history)
    assert drifted
    if alg.fragment_sync_delay == 0 and alg.fragment_update_alpha == 0 and alg.fragments == 1:
        for s in range(alg.sync_every - 1, STEPS, alg.sync_every):
            for d in range(1, N):
                np.testing.assert_array_equal(history[s][d], history[s][0])


@pytest.mark.parametrize("kw", [PLAIN, STREAMING, dict(sync_every=3, fragments=3), SPARSE],
                         ids=["diloco", "streaming", "fragments3", "sparse"])
@pytest.mark.parametrize("mode", ["pmap", "shard_map"])
def test_matches_numpy_reference(setup, kw, mode):
    params, x, y = setup
    alg = SparseLoCo(**kw) if kw is SPARSE else DiLoCo(**kw)
    dp = wrap(params, algorithm=alg)
    if mode == "pmap":
        got = dw.diloco_pmap(dp, params, x, y)
    else:
        got = dw.diloco_shard_map(dp, params, x, y, jax.make_mesh((N,), ("batch",)))
    want = dw.reference(dp, alg, params, x, y)
    # float32 mean of 4 vs the reference's float64 one, through 3 outer steps and adam: seen <= 3e-7
    assert_history_close(got, want, atol=1e-6)
    assert_workers_drift_and_meet(got, alg)


def test_plain_diloco_matches_optax_outer_nesterov(setup):
    """The ground truth of the issue: optax.sgd(0.7, momentum=0.9, nesterov=True) on global - mean(local)."""
    params, x, y = setup
    alg = DiLoCo(**PLAIN)
    dp = wrap(params, algorithm=alg)
    got = dw.diloco_pmap(dp, params, x, y)
    assert_history_close(got, dw.reference(dp, alg, params, x, y, outer="optax"), atol=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kw", [PLAIN, STREAMING], ids=["diloco", "streaming"])
def test_quantised_within_a_step_of_the_reference(setup, kw, bits):
    params, x, y = setup
    alg = DiLoCo(bits=bits, **kw)
    dp = wrap(params, algorithm=alg)
    got = dw.diloco_pmap(dp, params, x, y)
    want = dw.reference(dp, alg, params, x, y)
    exact = dw.reference(dp, DiLoCo(**kw), params, x, y)
    first_sync = min(alg.offsets()) + alg.fragment_sync_delay - 1
    pseudo = want[first_sync - 1][0] - want[first_sync - 1][1]  # a drift: the size of what is exchanged
    levels = 255 if bits == 8 else 15
    # XLA and numpy may round one value at a tie to the neighbouring code; the result stays within a code
    tol = 2 * alg.outer_lr * (1 + alg.outer_momentum) * step_size(pseudo, levels) + 1e-6
    for s in range(STEPS):
        err = max(np.abs(g - r).max() for g, r in zip(got[s], want[s]))
        assert err <= tol, (s, err, tol)
    # quantised for real: the full-precision run lands measurably elsewhere, further than from the reference
    off_exact = max(np.abs(g - e).max() for g, e in zip(got[-1], exact[-1]))
    off_ref = max(np.abs(g - r).max() for g, r in zip(got[-1], want[-1]))
    assert off_exact > 10 * max(off_ref, 1e-6), (off_exact, off_ref)


def test_flax_nnx_model(setup):
    """An nnx model and nnx.Optimizer (plain adam) under pmap, its Param state through ``dp.sync_params`` after
    ``optimizer.update``: the same weights as the reference on the equivalent pytree model."""
    nnx = pytest.importorskip("flax.nnx", reason="needs flax: pip install -e '.[flax]'")
    import jax.numpy as jnp

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(w.IN, w.HIDDEN, rngs=rngs)
            self.l2 = nnx.Linear(w.HIDDEN, w.OUT, rngs=rngs)

        def __call__(self, x):
            return self.l2(jnp.tanh(self.l1(x)))

    def loss_fn(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    def as_plain(p):  # the nnx Param state as bx_jax_workers' params tree (the same MLP)
        return {k: {"w": np.asarray(p[k]["kernel"]), "b": np.asarray(p[k]["bias"])} for k in ("l1", "l2")}

    _, x, y = setup
    alg = DiLoCo(**STREAMING)
    model = MLP(nnx.Rngs(0))
    dp = wrap(nnx.as_pure(nnx.state(model, nnx.Param)), algorithm=alg)
    graphdef, state = nnx.split((model, nnx.Optimizer(model, dw.inner_optimizer(), wrt=nnx.Param)))

    def step(state, st, xb, yb):
        model, optimizer = nnx.merge(graphdef, state)
        optimizer.update(model, nnx.grad(loss_fn)(model, xb, yb))
        params, st = dp.sync_params(nnx.as_pure(nnx.state(model, nnx.Param)), st)
        nnx.update(model, params)
        return nnx.state((model, optimizer)), st

    f = jax.pmap(step, axis_name="batch")
    state, st = dp.replicate(state), dp.init()
    plain = as_plain(nnx.as_pure(nnx.state(model, nnx.Param)))
    ref_dp = wrap(plain, algorithm=alg)
    got = []
    for s in range(STEPS):
        state, st = jax.block_until_ready(f(state, st, x[s], y[s]))
        per_device = as_plain(jax.tree.map(np.asarray, nnx.as_pure(nnx.state(nnx.merge(graphdef, state)[0],
                                                                              nnx.Param))))
        got.append([dw.flat_of(ref_dp, jax.tree.map(lambda a, d=d: a[d], per_device)) for d in range(N)])
    assert_history_close(got, dw.reference(ref_dp, alg, plain, x, y), atol=1e-6)


ORBAX = {  # (algorithm, total, stop): each stops mid-H
    "diloco": (DiLoCo(sync_every=4), 7, 2),
    "streaming-in-flight": (DiLoCo(**STREAMING), 7, 4),  # fragment 1 launched at step 4, lands at 5
    "4bit": (DiLoCo(sync_every=3, bits=4), 7, 4),
    "sparse": (SparseLoCo(**SPARSE), 7, 4),  # the error buffer holds what step 3's exchange did not send
}


@pytest.mark.parametrize("name", list(ORBAX))
def test_orbax_resume_mid_h_is_bitwise_identical(name, tmp_path):
    """params + optax state + DiLoCo state (step, global copy, momentum, pending) saved with orbax mid-H and
    restored into a fresh wrap with other initial params: the rest of the run is bitwise the uninterrupted one."""
    pytest.importorskip("orbax.checkpoint", reason="needs orbax-checkpoint: pip install -e '.[flax]'")
    from bx_jax_orbax_workers import ITEMS, interrupted

    alg, total, stop = ORBAX[name]
    full, resumed = interrupted(alg, str(tmp_path), total, stop, ITEMS)
    assert jax.tree.structure(full) == jax.tree.structure(resumed)
    leaves = jax.tree_util.tree_flatten_with_path(full)[0]
    assert any("momentum" in jax.tree_util.keystr(p) for p, _ in leaves)
    for (path, a), b in zip(leaves, jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(a, b, err_msg=f"{name}: {jax.tree_util.keystr(path)}")
    # the control: without the DiLoCo state (a fresh step counter, global copy and momentum) it goes elsewhere
    _, fresh = interrupted(alg, str(tmp_path / "control"), total, stop, ("params", "opt_state"))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(full["params"]),
                                                          jax.tree.leaves(fresh["params"])))


@pytest.mark.parametrize("kw", [PLAIN, STREAMING, SPARSE], ids=["diloco", "streaming", "sparse"])
def test_two_levels_a_node_is_one_worker(setup, kw):
    """4 devices as 2 nodes x 2 (pmap, devices_per_node=2), gradients through ``dp.reduce_gradients``: a 2-worker
    DiLoCo whose gradient is the node's mean; both devices of a node bitwise identical at every step."""
    params, x, y = setup
    alg = SparseLoCo(**kw) if kw is SPARSE else DiLoCo(**kw)
    dp = wrap(params, algorithm=alg, devices_per_node=2)
    got = dw.diloco_pmap(dp, params, x, y, node_mean=True)
    want = dw.reference(dp, alg, params, x, y, workers=2)
    for s in range(STEPS):
        for d in range(N):
            np.testing.assert_array_equal(got[s][d], got[s][d // 2 * 2], err_msg=f"step {s + 1}, device {d}")
            np.testing.assert_allclose(got[s][d], want[s][d // 2], rtol=0, atol=1e-6, err_msg=f"step {s + 1}")
    assert any(not np.array_equal(h[0], h[2]) for h in got)  # the two nodes drift apart between syncs


def test_reduce_gradients_without_node_groups_is_the_flat_form(setup):
    """Under shard_map (no node groups) each device is a worker: ``dp.reduce_gradients`` leaves the gradients
    alone, so the same step code gives the 4-worker reference."""
    params, x, y = setup
    alg = DiLoCo(**PLAIN)
    dp = wrap(params, algorithm=alg, devices_per_node=2)
    got = dw.diloco_shard_map(dp, params, x, y, jax.make_mesh((N,), ("batch",)), node_mean=True)
    assert_history_close(got, dw.reference(dp, alg, params, x, y), atol=1e-6)


def test_reduce_gradients_still_refuses_other_weight_algorithms():
    from bagua_x.algorithms import ModelAverage
    from bagua_x.core import BaguaXError

    dp = wrap(w.make_params(0), algorithm=ModelAverage(period=2))
    with pytest.raises(BaguaXError, match="sync_params"):
        jax.pmap(lambda g: dp.reduce_gradients(g, ())[0], axis_name="batch")(dp.replicate(w.make_params(0)))


def test_two_processes(tmp_path):
    """2 processes x 2 devices (gloo), each process a node: flat (hierarchical=False, 4 workers) and two levels
    (the default: 2 workers, gradients averaged inside each process) against the single-process references."""
    import os

    from launch import run_workers

    cases = {"flat": dict(hierarchical=False, **STREAMING), "nodes": dict(PLAIN),
             "sparse-nodes": dict(compression=SparseLoCo(**SPARSE).compression, **PLAIN)}
    env = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__)),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "LOCAL_WORLD_SIZE": "1"}  # one process per host, as on two machines
    results = run_workers("bx_jax_diloco_workers:diloco_worker", nproc=2, args=(cases, STEPS), timeout=240, env=env)
    assert len(results) == 2
    params, x, y = w.make_params(0), *w.make_data(STEPS, N)
    dp = wrap(params)  # only for the flat order of the leaves
    want = {"flat": dw.reference(dp, DiLoCo(**cases["flat"]), params, x, y),
            "nodes": dw.reference(dp, DiLoCo(**cases["nodes"]), params, x, y, workers=2),
            "sparse-nodes": dw.reference(dp, DiLoCo(**cases["sparse-nodes"]), params, x, y, workers=2)}
    for got in results:
        for s in range(STEPS):
            for d in range(N):
                np.testing.assert_allclose(got["flat"][s][d], want["flat"][s][d], rtol=0, atol=1e-6)
                np.testing.assert_allclose(got["nodes"][s][d], want["nodes"][s][d // 2], rtol=0, atol=1e-6)
                np.testing.assert_array_equal(got["nodes"][s][d], got["nodes"][s][d // 2 * 2])
                np.testing.assert_allclose(got["sparse-nodes"][s][d], want["sparse-nodes"][s][d // 2], rtol=0,
                                           atol=1e-6)
