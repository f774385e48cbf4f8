"""Bad input refused with a BaguaXError naming the leaf, and random pytrees reduced like per-leaf pmean.

One process, 4 CPU devices (tests/jax/conftest.py), pmap over "batch".
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bagua_x.algorithms import Decentralized, GradientAllReduce, ModelAverage, QAdam, Target
from bagua_x.core import BaguaXError
from bagua_x.jax import wrap

NDEV = 4


def params():
    return {"w": jnp.ones((2, 3)), "b": jnp.zeros(3), "count": jnp.zeros((), jnp.int32)}


def reduce_under_pmap(dp, grads_per_device):
    st = dp.init()
    return jax.pmap(lambda g, s: dp.reduce_gradients(g, s)[0], axis_name="batch")(grads_per_device, st)


def per_device(tree):
    return jax.tree.map(lambda a: jnp.stack([a] * NDEV), tree)


# -- refused at wrap or at the step -----------------------------------------------------------------------------


def test_complex_leaf_is_refused_at_wrap():
    with pytest.raises(BaguaXError, match=r"complex leaves \[\"\['z'\]\"\] cannot be communicated"):
        wrap({"w": jnp.ones(3), "z": jnp.ones(2, jnp.complex64)})


@pytest.mark.parametrize("tree", [{"step": jnp.zeros((), jnp.int32)}, {}], ids=["integer only", "empty"])
def test_a_tree_with_nothing_to_communicate_is_refused_at_wrap(tree):
    """Not a wrap of 0 buckets, which would train every device on its own without a word."""
    with pytest.raises(BaguaXError, match=r"no float leaf to communicate \((\['step'\] \(int32\)|no leaves at all)\)"):
        wrap(tree)


def test_integer_gradient_at_a_float_position_is_refused():
    dp = wrap(params())
    grads = {**params(), "w": jnp.ones((2, 3), jnp.int32)}
    with pytest.raises(BaguaXError, match=r"reduce_gradients: leaf \"\['w'\]\" is int32, but wrap registered it as "
                                          r"float32"):
        reduce_under_pmap(dp, per_device(grads))


def test_integer_leaf_wrapped_as_integer_passes_through():
    dp = wrap(params())
    out = reduce_under_pmap(dp, per_device({**params(), "count": jnp.array(7, jnp.int32)}))
    np.testing.assert_array_equal(out["count"], [7] * NDEV)


def test_changed_structure_names_the_leaves():
    dp = wrap(params())
    with pytest.raises(BaguaXError, match=r"missing leaves \[\"\['b'\]\"\], unexpected leaves \[\"\['bias'\]\"\]"):
        reduce_under_pmap(dp, per_device({"w": jnp.ones((2, 3)), "bias": jnp.zeros(3),
                                          "count": jnp.zeros((), jnp.int32)}))


def test_same_paths_in_other_containers_are_named():
    dp = wrap({"layers": [jnp.ones(2), jnp.ones(3)]})
    with pytest.raises(BaguaXError, match="the same leaf paths in other containers"):
        reduce_under_pmap(dp, per_device({"layers": (jnp.ones(2), jnp.ones(3))}))


def test_unbound_axis_names_the_axis():
    dp = wrap(params(), axis_name="data")
    with pytest.raises(BaguaXError, match=r"axis 'data' is not bound, outside jax.pmap\(\.\.\., axis_name='data'\)"):
        reduce_under_pmap(dp, per_device(params()))


CALLS = {  # each call, and the target it communicates for
    "reduce_gradients": (Target.GRAD, lambda dp: dp.reduce_gradients(params(), dp.init_state())),
    "gradient_transformation": (Target.GRAD, lambda dp: dp.gradient_transformation()),
    "sync_params": (Target.WEIGHT, lambda dp: dp.sync_params(params(), dp.init_state())),
    "optimizer": (Target.MOMENTUM, lambda dp: dp.optimizer()),
}
INSTEAD = {Target.GRAD: "dp.reduce_gradients", Target.WEIGHT: "dp.sync_params", Target.MOMENTUM: "dp.optimizer()"}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("algorithm", [GradientAllReduce(), Decentralized(), ModelAverage(), QAdam(lr=0.1)],
                         ids=lambda a: type(a).__name__)
def test_a_call_that_would_communicate_nothing_is_refused_naming_the_one_that_does(call, algorithm):
    """One rule for the four calls: never a silent pass-through (a step that skipped its communication)."""
    target, run = CALLS[call]
    dp = wrap(params(), algorithm=algorithm)
    if algorithm.target is target:  # the call for it: no refusal (outside pmap only the axis or a mesh is missing)
        try:
            run(dp)
        except BaguaXError as e:
            assert "axis 'batch' is not bound" in str(e)
        return
    with pytest.raises(BaguaXError) as e:
        run(dp)
    message = str(e.value)
    assert message.startswith(f"dp.{call}(")
    assert f"{algorithm!r} communicates {algorithm.target.value}s, not {target.value}s" in message
    assert INSTEAD[algorithm.target] in message.split("; use ", 1)[1]


# -- random pytrees: bagua_x's reduction is per-leaf pmean -----------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=["left", "right"], meta_fields=[])
@dataclasses.dataclass
class Pair:
    left: Any
    right: Any


@dataclasses.dataclass(frozen=True)
class Leaf:  # a leaf to be: shape and dtype (not a pytree node, so tree.map reaches it)
    shape: tuple
    dtype: str


leaves = st.builds(Leaf, st.lists(st.integers(0, 3), max_size=3).map(tuple), st.sampled_from(["float32", "bfloat16"]))
trees = st.recursive(
    leaves | st.none(),
    lambda kids: st.one_of(
        st.dictionaries(st.sampled_from("abcd"), kids, max_size=3),
        st.lists(kids, max_size=3),
        st.lists(kids, max_size=3).map(tuple),
        st.builds(Pair, kids, kids),
    ),
    max_leaves=8,
)


@settings(max_examples=15, deadline=None)
@given(spec=trees, pack=st.sampled_from([None, True, False]), cap_mb=st.sampled_from([25.0, 1e-5]),
       seed=st.integers(0, 2**16))
def test_reduce_gradients_equals_per_leaf_pmean(spec, pack, cap_mb, seed):
    rng = np.random.default_rng(seed)
    is_leaf = lambda x: isinstance(x, Leaf)  # noqa: E731
    grads = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=(NDEV, *s.shape)), s.dtype), spec, is_leaf=is_leaf)
    one = jax.tree.map(lambda g: g[0], grads)
    if not jax.tree.leaves(one):  # nothing to communicate: refused at wrap (the test above)
        return
    dp = wrap(one, algorithm=GradientAllReduce(), pack_buckets=pack, bucket_cap_mb=cap_mb)

    def step(g, st, marker):  # marker: pmap needs one mapped argument even for a tree of empty leaves
        out, _ = dp.reduce_gradients(g, st)
        return out, jax.tree.map(lambda x: jax.lax.pmean(x, "batch"), g), marker

    got, want, _ = jax.pmap(step, axis_name="batch")(grads, dp.init(), jnp.zeros(NDEV))
    assert jax.tree.structure(got) == jax.tree.structure(want) == jax.tree.structure(grads)
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves) == len(jax.tree.leaves(grads))
    for path_leaf, a, b in zip(jax.tree_util.tree_leaves_with_path(got), got_leaves, want_leaves):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=jax.tree_util.keystr(path_leaf[0]))
