"""AxisCommunicator against numpy: 4 devices in one process, and 2 processes x 2 devices over gloo."""

import os
import re

import numpy as np
import pytest

import bx_jax_workers as w
from launch import run_workers

HERE = os.path.dirname(os.path.abspath(__file__))
MULTI_ENV = {"PYTHONPATH": HERE, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}


def _compare(results, n):
    expected = w.expected_ops(n)
    for mode, got in results.items():
        for name, want in expected.items():
            assert got[name].shape == want.shape, (mode, name, got[name].shape, want.shape)
            assert got[name].dtype.kind == want.dtype.kind or name == "rank", (mode, name, got[name].dtype)
            np.testing.assert_allclose(got[name], want, rtol=1e-6, err_msg=f"{mode} {name}")


def test_ops_single_process_pmap_and_shard_map():
    import jax

    assert jax.device_count() == 4
    _compare(w.run_ops(), 4)


def test_ops_two_processes_gloo():
    results = run_workers("bx_jax_workers:communicator_worker", nproc=2, timeout=180, env=MULTI_ENV)
    for r in results:
        _compare(r, 4)


def test_outside_the_axis_is_a_clear_error():
    import jax.numpy as jnp

    from bagua_x.core import BaguaXError
    from bagua_x.jax import AxisCommunicator

    with pytest.raises(BaguaXError, match="inside jax.pmap"):
        AxisCommunicator("batch")
    import jax

    with pytest.raises(BaguaXError, match="'other' is not bound"):
        jax.pmap(lambda x: AxisCommunicator("other").allreduce(x), axis_name="batch")(jnp.ones(4))


def test_alltoall_needs_axis_sized_rows():
    import jax
    import jax.numpy as jnp

    from bagua_x.core import BaguaXError
    from bagua_x.jax import AxisCommunicator

    with pytest.raises(BaguaXError, match="first dimension is the axis size 4"):
        jax.pmap(lambda x: AxisCommunicator("batch").alltoall(x), axis_name="batch")(jnp.ones((4, 3)))


def test_hierarchical_is_grouped_under_pmap_and_flat_under_shard_map():
    """The numbers match a flat allreduce either way (test_ops_*); here: which collectives run."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from bagua_x.algorithms import EmptyState, GradientAllReduce
    from bagua_x.jax import AxisCommunicator

    def f(v):
        return GradientAllReduce(hierarchical=True).reduce(v, None, EmptyState(), AxisCommunicator("batch", local_size=2))[0]

    pmapped = str(jax.make_jaxpr(jax.pmap(f, axis_name="batch"))(jnp.ones((4, 6))))
    for collective, groups in (("reduce_scatter", "((0, 1), (2, 3))"), ("psum", "((0, 2), (1, 3))"),
                               ("all_gather", "((0, 1), (2, 3))")):
        assert f"{collective}[" in pmapped and f"axis_index_groups={groups}" in pmapped, (collective, pmapped)
    # compiled for CPU, the node's reduce-scatter is an all-to-all and a sum: gloo's reduce-scatter, which
    # XLA:CPU would run across processes, intermittently returns wrong values (test_jax_hierarchical_processes)
    cpu = jax.pmap(f, axis_name="batch").lower(jnp.ones((4, 6))).as_text()
    assert "reduce_scatter" not in cpu and re.search(r"all_to_all.*replica_groups = dense<\[\[0, 1\], \[2, 3\]\]>",
                                                     cpu), cpu
    mesh = jax.make_mesh((4,), ("batch",))
    sharded = jax.device_put(jnp.ones(24), NamedSharding(mesh, P("batch")))
    lowered = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("batch"), out_specs=P())).lower(sharded).as_text()
    assert "all_reduce" in lowered and "reduce_scatter" not in lowered and "all_gather" not in lowered


def test_within_and_across_are_the_collectives_on_nodes_and_places():
    import jax
    import jax.numpy as jnp

    from bagua_x.core import BaguaXError, ReduceOp
    from bagua_x.core.comm import Feature
    from bagua_x.jax import AxisCommunicator

    xs = np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 3) ** 1.5

    def f(x):
        c = AxisCommunicator("batch", local_size=2)  # nodes (0, 1) and (2, 3)
        assert Feature.HIERARCHICAL in c.features and (c.within.size, c.across.size) == (2, 2)
        w, a = c.within, c.across
        return {"ranks": jnp.stack([w.rank, a.rank]), "w_gather": w.allgather(x), "a_gather": a.allgather(x),
                "w_alltoall": w.alltoall(x), "a_rs_avg": a.reduce_scatter(x, ReduceOp.AVG),
                "w_bcast": w.broadcast(x, root=1), "a_swap": a.permute(x, [(0, 1), (1, 0)]),
                "w_max": w.allreduce(x, ReduceOp.MAX)}

    out = jax.tree.map(np.asarray, jax.pmap(f, axis_name="batch")(jnp.asarray(xs)))
    node = lambda r: [r - r % 2, r - r % 2 + 1]  # noqa: E731
    place = lambda r: [r % 2, r % 2 + 2]  # noqa: E731
    for r in range(4):
        assert out["ranks"][r].tolist() == [r % 2, r // 2]
        assert np.array_equal(out["w_gather"][r], xs[node(r)]) and np.array_equal(out["a_gather"][r], xs[place(r)])
        assert np.array_equal(out["w_alltoall"][r], np.stack([xs[s][r % 2] for s in node(r)]))
        assert np.allclose(out["a_rs_avg"][r], np.mean([xs[s][r // 2] for s in place(r)], axis=0), rtol=1e-6)
        assert np.array_equal(out["w_bcast"][r], xs[node(r)[1]])
        assert np.array_equal(out["a_swap"][r], xs[place(r)[1 - r // 2]])
        assert np.array_equal(out["w_max"][r], np.max(xs[node(r)], axis=0))
    with pytest.raises(BaguaXError, match="has no node groups here"):  # one node of 4: nothing to offer
        jax.pmap(lambda x: AxisCommunicator("batch", local_size=4).within.size + x, axis_name="batch")(xs)
