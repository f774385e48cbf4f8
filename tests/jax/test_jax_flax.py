"""flax.nnx with bagua_x: an nnx.Optimizer over ``optax.chain(dp.gradient_transformation(), adam)``, the model
and optimizer split into one state pytree (nnx.split / nnx.merge) around a jax.pmap or jax.shard_map step,
against the same loop with ``jax.lax.pmean`` of the gradients instead (4 CPU devices)."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import bx_jax_workers as w
from bagua_x.algorithms import ByteGrad, GradientAllReduce
from bagua_x.core import BaguaXError
from bagua_x.jax import wrap

nnx = pytest.importorskip("flax.nnx", reason="needs flax: pip install -e '.[flax]'")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/jax_flax_nnx_train.py"
STEPS, LR = 8, 1e-2
MODES = ["pmap", "shard_map"]


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(w.IN, w.HIDDEN, rngs=rngs)
        self.l2 = nnx.Linear(w.HIDDEN, w.OUT, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def train(algorithm, mode: str, x, y):
    """``STEPS`` steps of nnx training; ``algorithm=None`` is the reference (grads pmean'd, plain adam).

    Returns every device's copy of the params (leading axis: device) and the losses.
    """
    model = MLP(nnx.Rngs(0))
    mesh = jax.make_mesh((4,), ("batch",))
    if algorithm is None:
        tx, reduce = optax.adam(LR), lambda g: jax.lax.pmean(g, "batch")
        place = ((lambda t: jax.tree.map(lambda a: np.stack([np.asarray(a)] * 4), t)) if mode == "pmap" else
                 (lambda t: jax.device_put(t, NamedSharding(mesh, P()))))
    else:
        dp = wrap(nnx.as_pure(nnx.state(model, nnx.Param)), algorithm=algorithm)
        tx, reduce = optax.chain(dp.gradient_transformation(), optax.adam(LR)), lambda g: g
        place = (lambda t: dp.replicate(t, None if mode == "pmap" else mesh))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))

    def step(state, xb, yb):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, xb, yb)
        optimizer.update(model, reduce(grads))
        return nnx.state((model, optimizer)), jax.lax.pmean(loss, "batch")

    if mode == "pmap":
        f, batch = jax.pmap(step, axis_name="batch"), (lambda a: a)
        copies = np.asarray
    else:
        # untyped (check_vma=False): each device's own gradient, not JAX's sum over the axis (docs/jax.md)
        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("batch"), P("batch")), out_specs=(P(), P()),
                                  check_vma=False))
        batch = lambda a: jax.device_put(a.reshape((-1,) + a.shape[2:]), NamedSharding(mesh, P("batch")))  # noqa: E731
        copies = lambda a: np.stack([np.asarray(s.data) for s in a.addressable_shards])  # noqa: E731
    state = place(state)
    losses = []
    for s in range(STEPS):
        state, loss = jax.block_until_ready(f(state, batch(x[s]), batch(y[s])))  # see w._one_step_in_flight
        losses.append(float(np.asarray(loss).reshape(-1)[0]))
    model, optimizer = nnx.merge(graphdef, state)
    assert int(np.asarray(optimizer.step[...]).reshape(-1)[0]) == STEPS
    return jax.tree.map(copies, nnx.as_pure(nnx.state(model, nnx.Param))), losses


def test_typed_shard_map_gradients_summed_by_jax_are_refused(data):
    """Under a typed shard_map (check_vma=True, the default) nnx.value_and_grad of a model passed with P() is
    the sum over the devices, which JAX adds itself: bagua_x refuses it rather than average n equal sums."""
    model = MLP(nnx.Rngs(0))
    dp = wrap(nnx.as_pure(nnx.state(model, nnx.Param)), algorithm=ByteGrad())
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.chain(dp.gradient_transformation(),
                                                                          optax.adam(LR)), wrt=nnx.Param)))

    def step(state, xb, yb):
        model, optimizer = nnx.merge(graphdef, state)
        optimizer.update(model, nnx.grad(loss_fn)(model, xb, yb))
        return nnx.state((model, optimizer))

    mesh = jax.make_mesh((4,), ("batch",))
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("batch"), P("batch")), out_specs=P()))
    x, y = (jax.device_put(a[0].reshape((-1,) + a.shape[2:]), NamedSharding(mesh, P("batch"))) for a in data)
    with pytest.raises(BaguaXError, match=r"types the gradients .*\['l1'\]\['bias'\].* as the same on every "
                                          r"device of axis 'batch'.*n times the gradient"):
        f(dp.replicate(state, mesh), x, y)


def max_error(got, ref):
    """The largest difference between any device's copy and the reference's first device, leaf by leaf."""
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
    assert len(pairs) == 4  # two Linear layers: kernel and bias each
    for g, r in pairs:
        assert g.shape == r.shape and g.shape[0] == 4, (g.shape, r.shape)
    return max(float(np.abs(g - r[0]).max()) for g, r in pairs)


@pytest.fixture(scope="module")
def data():
    return w.make_data(STEPS, 4)


@pytest.fixture(scope="module")
def reference(data):
    return {mode: train(None, mode, *data) for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_gradient_allreduce_matches_pmean(reference, data, mode):
    ref, ref_losses = reference[mode]
    got, losses = train(GradientAllReduce(), mode, *data)
    assert max_error(got, ref) <= 1e-6  # seen: 0 (the same sums in the same order)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_bytegrad_trains_close_to_pmean(reference, data, mode):
    ref, ref_losses = reference[mode]
    got, losses = train(ByteGrad(), mode, *data)
    for leaf in jax.tree.leaves(got):  # ByteGrad ends with the same dequantised values on every device
        np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))
    error = max_error(got, ref)
    assert 0 < error < 0.02, error  # seen: 1.0e-2 (8-bit quantisation, through Adam); 0: no compression
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=5e-4)  # seen: 2.8e-4
    assert losses[-1] < 0.5 * losses[0], losses  # seen: 0.43 -> 0.16


def test_nnx_jit_step_equals_plain_nnx_jit():
    """``examples/jax_nnx_jit_train.py``'s ``nnx.jit`` step with GradientAllReduce and SGD against the same
    ``nnx.jit`` loop with ``nnx.value_and_grad`` over the sharded batch (XLA's own reduction)."""
    import importlib.util

    from jax.sharding import AxisType

    spec = importlib.util.spec_from_file_location("jax_nnx_jit_train", ROOT / "examples/jax_nnx_jit_train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    mesh = jax.make_mesh((4,), ("batch",), axis_types=(AxisType.Auto,))  # XLA's own step: no out_sharding needed
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(STEPS, 32, 8)).astype(np.float32)
    ys = np.sin(xs.sum(-1, keepdims=True))
    batch = lambda a: jax.device_put(a, NamedSharding(mesh, P("batch")))  # noqa: E731

    @nnx.jit
    def plain_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    plain = example.MLP(nnx.Rngs(0))
    plain_opt = nnx.Optimizer(plain, optax.sgd(0.1), wrt=nnx.Param)
    ours = example.MLP(nnx.Rngs(0))
    dp = wrap(nnx.to_pure_dict(nnx.state(ours, nnx.Param)), algorithm=GradientAllReduce(), mesh=mesh)
    ours_opt, step, state = nnx.Optimizer(ours, optax.sgd(0.1), wrt=nnx.Param), example.train_step(dp), dp.init()
    for x, y in zip(xs, ys):
        want = plain_step(plain, plain_opt, batch(x), batch(y))
        loss, state = step(ours, ours_opt, state, batch(x), batch(y))
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    got, ref = (jax.tree.leaves(nnx.to_pure_dict(nnx.state(m, nnx.Param))) for m in (ours, plain))
    start = jax.tree.leaves(nnx.to_pure_dict(nnx.state(example.MLP(nnx.Rngs(0)), nnx.Param)))
    assert len(got) == len(ref) == len(start) == 4
    assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(got, ref)) <= 1e-6  # seen: 0
    assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(ref, start)) > 1e-2  # it trained


@pytest.mark.parametrize("example", [EXAMPLE, "examples/jax_nnx_jit_train.py"])
def test_example_runs(example):
    """``python examples/...`` puts examples/ first on sys.path, not the checkout: PYTHONPATH makes the run
    import this checkout's bagua_x rather than whichever one is installed."""
    out = subprocess.run([sys.executable, example], cwd=ROOT, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
                              "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in out.stdout.splitlines() if "loss" in line]
    assert len(losses) == 5 and losses[-1] < losses[0], out.stdout
