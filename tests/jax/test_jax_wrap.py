"""bagua_x.jax.wrap: parity with a plain pmean loop, compile-once, placement and errors."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bx_jax_workers as w
from bagua_x.algorithms import ByteGrad, Decentralized, GradientAllReduce, LowPrecisionDecentralized
from bagua_x.core import BaguaXError
from bagua_x.jax import wrap
from launch import run_workers

HERE = os.path.dirname(os.path.abspath(__file__))
MULTI_ENV = {"PYTHONPATH": HERE, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
             "LOCAL_WORLD_SIZE": "1"}  # each process its own "node", for GradientAllReduce(hierarchical=True)
STEPS = 5


def assert_trees_close(a, b, atol=1e-6):
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for (path, x), y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def setup():
    params = w.make_params(0)
    x, y = w.make_data(STEPS, 4)
    return params, x, y, w.reference_pmap(params, x, y)


@pytest.mark.parametrize("pack", [False, True], ids=["per-leaf", "packed"])
@pytest.mark.parametrize("cap_mb", [25.0, 0.0005], ids=["one-bucket", "small-buckets"])
def test_pmap_and_chain_match_pmean(setup, pack, cap_mb):
    params, x, y, ref = setup
    dp = wrap(params, bucket_cap_mb=cap_mb, pack_buckets=pack)
    assert len(dp.bucket_leaves) == (1 if cap_mb == 25.0 else 2)
    traces = []
    assert_trees_close(w.bagua_pmap(dp, params, x, y, traces=traces), ref)
    assert len(traces) == 1, "the step must compile once: the state layout may not change across steps"
    assert_trees_close(w.bagua_pmap(dp, params, x, y, chain=True), ref)


@pytest.mark.parametrize("algorithm", [GradientAllReduce(), GradientAllReduce(hierarchical=None), ByteGrad()],
                         ids=["allreduce", "hierarchical", "bytegrad"])  # shard_map: hierarchical=None runs flat
def test_shard_map_matches_pmean(setup, algorithm):
    params, x, y, ref = setup
    dp = wrap(params, algorithm=algorithm)
    out = w.bagua_shard_map(dp, params, x, y, jax.make_mesh((4,), ("batch",)))
    assert_trees_close(out, ref, atol=1e-6 if isinstance(algorithm, GradientAllReduce) else 0.05)


@pytest.mark.parametrize("algorithm", [Decentralized(peer_selection_mode="shift_one"), LowPrecisionDecentralized()],
                         ids=["decentralized", "lowprec"])
def test_shard_map_weight_algorithms_match_pmap(setup, algorithm):
    params, x, y, _ = setup
    dp = wrap(params, algorithm=algorithm)
    mesh = jax.make_mesh((4,), ("batch",))
    assert_trees_close(w.bagua_shard_map(dp, params, x, y, mesh), w.bagua_pmap(dp, params, x, y), atol=1e-5)


def test_auto_strategy_in_one_process_packs_small_leaves_and_whatever_needs_padding():
    from bagua_x.jax.wrap import SMALL_LEAF_BYTES

    params = w.make_params(0)
    assert wrap(params).pack_buckets  # small leaves: one collective each costs more than the copies
    big = {f"w{i}": jnp.zeros((SMALL_LEAF_BYTES // 4,), jnp.float32) for i in range(3)}
    assert not wrap(big).pack_buckets  # large leaves: XLA's per-leaf allreduce beats the copies
    assert wrap(big, algorithm=ByteGrad()).pack_buckets
    with pytest.raises(BaguaXError, match="only with GradientAllReduce"):
        wrap(params, algorithm=ByteGrad(), pack_buckets=False)


def test_mixed_dtypes_and_int_leaves():
    params = {"a": jnp.ones((3, 5), jnp.bfloat16), "b": jnp.ones(7), "count": jnp.array(3, jnp.int32)}
    dp = wrap(params, algorithm=ByteGrad())
    assert sorted(layout.dtype for layout in dp.layouts) == ["bfloat16", "float32"]
    assert all(layout.padded_numel % 4 == 0 for layout in dp.layouts)

    def step(p, st):
        scale = (jax.lax.axis_index("batch") + 1).astype(jnp.float32)
        g = jax.tree.map(lambda v: v * scale.astype(v.dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v, p)
        return dp.reduce_gradients(g, st)

    g, _ = jax.pmap(step, axis_name="batch")(dp.replicate(params), dp.init())
    assert g["a"].dtype == jnp.bfloat16 and g["count"].dtype == jnp.int32
    np.testing.assert_allclose(np.asarray(g["b"], np.float32), 2.5, atol=0.02)
    np.testing.assert_allclose(np.asarray(g["a"], np.float32), 2.5, atol=0.03)
    np.testing.assert_array_equal(g["count"], 3)


def test_replicate_unreplicate_roundtrip():
    params = w.make_params(3)
    dp = wrap(params)
    rep = dp.replicate(params)
    assert rep["l1"]["w"].shape == (4, w.IN, w.HIDDEN)
    assert len(rep["l1"]["w"].sharding.device_set) == 4
    assert_trees_close(dp.unreplicate(rep), params, atol=0)
    mesh = jax.make_mesh((4,), ("batch",))
    assert_trees_close(dp.unreplicate(dp.replicate(params, mesh)), params, atol=0)


@pytest.mark.skipif(not hasattr(jax.sharding, "get_mesh"), reason="jax.set_mesh needs JAX >= 0.8")
def test_replicate_follows_the_mesh_of_set_mesh():
    """Under ``jax.set_mesh`` a step reads its arguments on that mesh: not the pmap layout, with its extra axis."""
    params = w.make_params(3)
    dp = wrap(params)
    mesh = jax.make_mesh((4,), ("batch",))
    with jax.set_mesh(mesh):
        rep, per = dp.replicate(params), dp.replicate(params, per_device=True)
    assert rep["l1"]["w"].shape == (w.IN, w.HIDDEN) and rep["l1"]["w"].sharding.mesh.shape == mesh.shape
    assert rep["l1"]["w"].sharding.spec == jax.sharding.PartitionSpec()
    assert per["l1"]["w"].shape == (4, w.IN, w.HIDDEN) and per["l1"]["w"].sharding.spec[0] == "batch"
    assert_trees_close(dp.unreplicate(rep), params, atol=0)
    with pytest.raises(BaguaXError, match=r"the mesh has axes \['data'\], not 'batch' of the wrap's axis_name 'batch'"):
        dp.init(mesh=jax.make_mesh((4,), ("data",)))
    with jax.set_mesh(jax.make_mesh((4,), ("data",))):
        with pytest.raises(BaguaXError, match=r"has axes \['data'\], not 'batch' of the wrap's axis_name 'batch'"):
            dp.replicate(params)


def test_outside_pmap_is_a_clear_error():
    """Outside pmap / shard_map: gradients are XLA's mean already (dp.value_and_grad is the call there), and a
    weight algorithm's own shard_map needs a mesh."""
    params = w.make_params(0)
    with pytest.raises(BaguaXError, match=r"at jit level the gradients are already XLA's mean.*dp.value_and_grad"):
        wrap(params).reduce_gradients(params, wrap(params).init_state())
    dp = wrap(params, algorithm=Decentralized())
    with pytest.raises(BaguaXError, match=r"is not bound.*and without a mesh.*wrap\(mesh=\.\.\.\) or of jax.set_mesh"):
        dp.sync_params(params, dp.init_state())


def test_wrong_tree_names_the_leaf():
    params = w.make_params(0)
    dp = wrap(params, algorithm=ByteGrad())
    bad = {"l1": params["l1"], "l2": {"w": params["l2"]["w"], "bias": params["l2"]["b"]}}
    with pytest.raises(BaguaXError, match=r"missing leaves \[\"\['l2'\]\['b'\]\"\]"):
        jax.pmap(lambda g, s: dp.reduce_gradients(g, s), axis_name="batch")(dp.replicate(bad), dp.init())
    wrong_shape = jax.tree.map(lambda v: v, params)
    wrong_shape["l2"]["b"] = jnp.zeros(w.OUT + 1)
    with pytest.raises(BaguaXError, match=r"\['l2'\]\['b'\]"):
        jax.pmap(lambda g, s: dp.reduce_gradients(g, s), axis_name="batch")(dp.replicate(wrong_shape), dp.init())


def test_two_processes_match_pmean_and_start_equal():
    res = run_workers("bx_jax_workers:parity_worker", nproc=2, args=(STEPS,), timeout=240, env=MULTI_ENV)
    for r in res:
        assert r["packed"], "across processes GradientAllReduce must pack buckets"
        for mode in ("pmap", "chain", "shard_map", "hierarchical"):
            assert_trees_close(r[mode], r["ref"])
        assert r["node_size"] == 2  # hierarchical really had 2 nodes of 2 devices, not one node
        assert_trees_close(r["bytegrad"], r["ref"], atol=0.05)
    # the processes started from different random params: replicate() made them equal, and they stay so
    for mode in ("ref", "pmap", "chain", "shard_map", "bytegrad", "hierarchical"):
        assert_trees_close(res[0][mode], res[1][mode], atol=0)


def test_two_processes_mismatched_trees_fail_everywhere():
    res = run_workers("bx_jax_workers:mismatch_worker", nproc=2, timeout=180, env=MULTI_ENV, expect_failure=True)
    for kind, text in res:
        assert kind == "error", text
        assert "BaguaXError" in text and "['l2']['b']" in text and "(3,)" in text and "(4,)" in text, text
