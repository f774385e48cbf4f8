"""The jit-first style: ``jax.jit`` over a mesh, the batch sharded, ``dp.value_and_grad`` in place of
``jax.value_and_grad`` (bagua_x runs its own ``shard_map``: :mod:`bagua_x.jax.mesh_step`).

GradientAllReduce against XLA's own reduction (plain ``jax.value_and_grad`` of
the global batch's loss); every algorithm against its pmap loop, which the other
tests hold to the numpy references; both on 4 devices of one process and on
2 processes x 2 devices.  Plain SGD throughout: Adam would hide a gradient of
the wrong scale (n times the mean, the sum JAX adds inside shard_map).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import bx_jax_workers as w
from bagua_x.algorithms import ByteGrad, DiLoCo, GradientAllReduce, Target
from bagua_x.core import BaguaXError
from bagua_x.jax import wrap
from launch import run_workers

HERE = os.path.dirname(os.path.abspath(__file__))
MULTI_ENV = {"PYTHONPATH": HERE, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
             "LOCAL_WORLD_SIZE": "1"}
N, STEPS, LR = 4, 5, 5e-2


@pytest.fixture(scope="module")
def setup():
    return w.make_params(0), *w.make_data(STEPS, N), jax.make_mesh((N,), ("batch",))


def global_batch(a, mesh):
    """``(ndev, per_device, ...)`` rows as one global batch sharded along "batch" (device d: block d)."""
    return jax.device_put(a.reshape((-1,) + a.shape[2:]), NamedSharding(mesh, P("batch")))


def test_gradient_allreduce_equals_xla_reduction(setup):
    """The gradients and loss of the jit-first step equal plain ``jax.value_and_grad`` on the global batch."""
    params, x, y, _ = setup
    # Auto axes: XLA's own step over an explicit axis needs out_sharding= for the contraction over the batch
    mesh = jax.make_mesh((N,), ("batch",), axis_types=(AxisType.Auto,))
    dp = wrap(params, algorithm=GradientAllReduce(), mesh=mesh)
    ours = jax.jit(lambda p, st, xb, yb: dp.value_and_grad(w.loss_fn)(p, xb, yb, state=st))
    xla = jax.jit(jax.value_and_grad(w.loss_fn))
    p, q, st = dp.replicate(params), params, dp.init()
    for s in range(STEPS):  # along a training trajectory, each side on its own params
        xb, yb = global_batch(x[s], mesh), global_batch(y[s], mesh)
        (loss, grads), st = ours(p, st, xb, yb)
        want_loss, want = xla(q, xb, yb)
        assert loss.shape == (N,)  # one per device, their mean the global batch's
        # the mean over 32 rows summed in another order: a few float32 ulps
        np.testing.assert_allclose(float(loss.mean()), float(want_loss), rtol=1e-6)
        assert w.max_difference(grads, want) <= 1e-6 * max(float(np.abs(g).max()) for g in jax.tree.leaves(want))
        p, q = (jax.tree.map(lambda a, g: a - LR * g, t, g) for t, g in ((p, grads), (q, want)))
    assert w.max_difference(p, q) <= 1e-5  # seen: 6e-8
    assert w.max_difference(q, params) > 1e-2  # it trained


@pytest.mark.parametrize("name", list(w.jit_first_algorithms()))
def test_every_algorithm_jit_first_equals_its_pmap_loop(setup, name):
    params, x, y, mesh = setup
    algorithm = w.jit_first_algorithms()[name]
    got, losses = w.bagua_jit(wrap(params, algorithm=algorithm, mesh=mesh), params, x, y, mesh, LR)
    want = w.bagua_pmap(wrap(params, algorithm=algorithm), params, x, y, LR, sgd=True)
    assert w.max_difference(got, want) <= 1e-6  # seen: 0 (the same collectives and arithmetic)
    assert w.max_difference(want, params) > 1e-3  # it trained
    assert len(losses) == STEPS and losses[-1] < losses[0]


def test_every_algorithm_jit_first_across_two_processes():
    """2 processes x 2 devices, one mesh over all four: the same equality across gloo, from per-process params
    (``dp.replicate`` broadcasts process 0's)."""
    runs = run_workers("bx_jax_workers:jit_first_worker", nproc=2, args=(STEPS, LR), timeout=420, env=MULTI_ENV)
    assert len(runs) == 2
    for run in runs:
        assert set(run) == set(w.jit_first_algorithms())
        for name, got in run.items():
            assert w.max_difference(got["jit"], got["pmap"]) <= 1e-6, name
            assert len(got["losses"]) == STEPS and got["losses"][-1] < got["losses"][0], name
            if w.jit_first_algorithms()[name].branch_key(0) is not None:  # through dp.step: the branch alone
                assert w.max_difference(got["dp.step"], got["jit"]) <= 1e-6, name
                assert got["conditionals"] == [0] * STEPS, (name, got["conditionals"])
    for name, algorithm in w.jit_first_algorithms().items():  # where every device ends alike, across processes too
        if algorithm.target is not Target.WEIGHT:
            assert w.max_difference(runs[0][name]["jit"], runs[1][name]["jit"]) == 0, name


def test_context_mesh_serves_a_wrap_without_one(setup):
    """Under ``jax.set_mesh`` a wrap without ``mesh=`` shards over the context's mesh (and lays out on it)."""
    params, x, y, mesh = setup
    dp = wrap(params, algorithm=ByteGrad())
    with jax.set_mesh(mesh):
        p, st = dp.replicate(params), dp.init()
        (loss, grads), _ = jax.jit(lambda p, st, xb, yb: dp.value_and_grad(w.loss_fn)(p, xb, yb, state=st))(
            p, st, global_batch(x[0], mesh), global_batch(y[0], mesh))
    want = jax.grad(w.loss_fn)(params, x[0].reshape(-1, w.IN), y[0].reshape(-1, w.OUT))
    assert loss.shape == (N,)
    assert 0 < w.max_difference(grads, want) <= 1e-2  # ByteGrad's 8 bits (0: no compression)


def test_a_layout_on_another_mesh_than_the_steps_is_refused(setup):
    """dp.replicate / dp.init with a mesh that is not the step's (the wrap's, else jax.set_mesh's) raise naming both,
    before JAX refuses the arrays at the step with devices only; the step's own mesh, or none, is accepted."""
    params, _, _, mesh = setup
    devices = jax.devices()[:N]
    other = jax.sharding.Mesh(np.array(devices[::-1]), ("batch",))  # the same axis, the devices in another order
    want = (r"dp.replicate: mesh= \(axes \{'batch': 4\}, devices \[3, 2, 1, 0\]\) is not the mesh the step shards "
            r"over, WHICH: \(axes \{'batch': 4\}, devices \[0, 1, 2, 3\]\); .*pass no mesh")
    dp = wrap(params, algorithm=ByteGrad(), mesh=mesh)
    with pytest.raises(BaguaXError, match=want.replace("WHICH", "the wrap's")):
        dp.replicate(params, mesh=other)
    with pytest.raises(BaguaXError, match=want.replace("WHICH", "the wrap's")):
        dp.init(mesh=other)
    assert jax.tree.leaves(dp.replicate(params, mesh=mesh))[0].sharding.mesh == mesh
    bare = wrap(params, algorithm=ByteGrad())
    with jax.set_mesh(mesh):
        with pytest.raises(BaguaXError, match=want.replace("WHICH", "the one of jax.set_mesh")):
            bare.replicate(params, mesh=other)
    bare.replicate(params, mesh=other)  # no step mesh to differ from: laid out as asked


def test_jit_level_misuse_is_a_clear_error(setup):
    params, x, y, mesh = setup
    xb, yb = global_batch(x[0], mesh), global_batch(y[0], mesh)
    dp = wrap(params, algorithm=GradientAllReduce(), mesh=mesh)
    tx = optax.chain(dp.gradient_transformation(), optax.sgd(LR))
    # the transformation at jit level would reduce XLA's already reduced gradients
    with pytest.raises(BaguaXError, match=r"gradient_transformation\(\)'s update was called where axis 'batch' is "
                                          r"not bound.*already XLA's mean.*dp.value_and_grad\(loss_fn\)"):
        jax.jit(lambda p, o: tx.update(jax.grad(w.loss_fn)(p, xb, yb), o, p))(dp.replicate(params), tx.init(params))
    # no mesh: neither the wrap's nor a context one
    bare = wrap(params, algorithm=GradientAllReduce())
    with pytest.raises(BaguaXError, match=r"without a mesh.*wrap\(mesh=\.\.\.\) or of jax.set_mesh"):
        jax.jit(lambda p, st: bare.value_and_grad(w.loss_fn)(p, xb, yb, state=st))(params, bare.init_state())
    # the state at jit level is dp.init()'s, one per device
    powersgd = wrap(params, algorithm=w.jit_first_algorithms()["powersgd"], mesh=mesh)
    with pytest.raises(BaguaXError, match=r"takes the state of dp.init\(\): one per device.*pass dp.init\(\)"):
        jax.jit(lambda p, st: powersgd.value_and_grad(w.loss_fn)(p, xb, yb, state=st))(
            powersgd.replicate(params), powersgd.init_state())
    # a weight algorithm's params at jit level are one copy per device
    average = wrap(params, algorithm=DiLoCo(sync_every=2), mesh=mesh)
    with pytest.raises(BaguaXError, match=r"one copy per device .* stacked along a leading axis of axis 'batch''s 4 "
                                          r"devices, but leaf \"\['l1'\]\['b'\]\" has shape \(16,\), not \(4, 16\)"):
        jax.jit(lambda p, st: average.sync_params(p, st))(average.replicate(params), average.init())


def test_typed_shard_map_gradients_of_replicated_params_are_refused(setup):
    """Inside a typed shard_map, ``jax.grad`` with respect to params passed with ``P()`` is JAX's sum over the
    axis; bagua_x refuses it (it would average n equal sums: n times the gradient), and a per-device copy
    (``jax.lax.pcast``, which ``dp.value_and_grad`` does) gives the mean."""
    params, x, y, mesh = setup
    dp = wrap(params, algorithm=GradientAllReduce(), mesh=mesh)

    def step(cast):
        def body(p, st, xb, yb):
            g = jax.grad(w.loss_fn)(jax.lax.pcast(p, "batch", to="varying") if cast else p, xb, yb)
            return dp.reduce_gradients(g, jax.tree.map(lambda a: a[0], st))[0]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("batch"), P("batch"), P("batch")),
                                     out_specs=P()))

    args = (dp.replicate(params), dp.init(), global_batch(x[0], mesh), global_batch(y[0], mesh))
    with pytest.raises(BaguaXError, match=r"types the gradients .* as the same on every device of axis 'batch'.*"
                                          r"jax.lax.pcast\(params, 'batch', to='varying'\)"):
        step(cast=False)(*args)
    want = jax.grad(w.loss_fn)(params, x[0].reshape(-1, w.IN), y[0].reshape(-1, w.OUT))
    assert w.max_difference(step(cast=True)(*args), want) <= 1e-6


def test_a_model_with_batch_statistics_trains_jit_first_as_under_pmap():
    """BatchNorm's running statistics are state beside the params: an argument the same on every device
    (``batch_argnums`` names the batch), returned as ``aux`` one per device, and averaged; equal to the pmap
    loop that pmeans gradients and statistics (each device normalises by its own part of the batch)."""
    nnx = pytest.importorskip("flax.nnx", reason="needs flax: pip install -e '.[flax]'")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=rngs)
            self.bn = nnx.BatchNorm(8, momentum=0.5, rngs=rngs)
            self.head = nnx.Linear(8, 4, rngs=rngs)

        def __call__(self, x):
            return self.head(jax.nn.relu(self.bn(self.conv(x))).mean(axis=(1, 2)))

    graphdef, params, stats = nnx.split(Net(nnx.Rngs(0)), nnx.Param, ...)
    params, stats = nnx.to_pure_dict(params), nnx.to_pure_dict(stats)

    def loss(p, stats, x, y):
        model = nnx.merge(graphdef, p, stats)
        logits = model(x)
        return (optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
                nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(4, N, 4, 6, 6, 3)).astype(np.float32) * (1 + np.arange(N))[:, None, None, None, None]
    ys = rng.integers(0, 4, (4, N, 4)).astype(np.int32)

    def reference():
        def step(p, s, x, y):
            g, s = jax.grad(loss, has_aux=True)(p, s, x, y)
            g, s = jax.lax.pmean((g, s), "batch")
            return jax.tree.map(lambda a, b: a - LR * b, p, g), s
        f = jax.pmap(step, axis_name="batch")
        p, s = (jax.tree.map(lambda a: np.stack([np.asarray(a)] * N), t) for t in (params, stats))
        for x, y in zip(xs, ys):
            p, s = f(p, s, x, y)
        return jax.tree.map(lambda a: np.asarray(a[0]), (p, s))

    mesh = jax.make_mesh((N,), ("batch",))

    def jit_first(algorithm):
        dp = wrap(params, algorithm=algorithm, mesh=mesh)

        @jax.jit
        def step(p, s, st, x, y):
            ((_, s), g), st = dp.value_and_grad(loss, has_aux=True, batch_argnums=(2, 3))(p, s, x, y, state=st)
            assert jax.tree.leaves(s)[0].shape[0] == N  # one per device
            return jax.tree.map(lambda a, b: a - LR * b, p, g), jax.tree.map(lambda a: a.mean(0), s), st

        p, s, st = dp.replicate(params), dp.replicate(stats), dp.init()
        for x, y in zip(xs, ys):
            p, s, st = step(p, s, st, global_batch(x, mesh), global_batch(y, mesh))
        return jax.tree.map(np.asarray, (p, s))

    want = reference()
    moved = max(float(np.abs(a - np.asarray(b)).max()) for a, b in zip(jax.tree.leaves(want[1]),
                                                                          jax.tree.leaves(stats)))
    assert moved > 0.1  # the running statistics moved (the inputs' scale differs per device)
    # seen: 7e-9 (summation order), and 5e-4 for ByteGrad's 8 bits
    for algorithm, tolerance in ((GradientAllReduce(), 1e-6), (ByteGrad(), 5e-3)):
        got = jit_first(algorithm)
        assert len(jax.tree.leaves(got)) == len(jax.tree.leaves(want)) == 7  # 5 params, the mean and the var
        errors = [float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
        assert max(errors) <= tolerance, (type(algorithm).__name__, errors)
    assert max(errors) > 0  # ByteGrad's 8 bits are not allreduce
