"""Two levels on a 2-D mesh: ``wrap(axis_name=("node", "local"), mesh=mesh)`` reduces over "local" and
exchanges over "node" with plain collectives, under ``shard_map`` and jit-first, no ``axis_index_groups``
(so no ``pmap`` needed).

Each algorithm's two-level form on the mesh equals its pmap form with node
groups (which tests/jax/test_jax_hierarchical*.py hold to the numpy references),
on one process (2 nodes of 2 devices) and across 2 processes (a process a node);
and it is not the flat form, so a mesh that silently ran flat would fail.
"""

import dataclasses
import os

import jax
import numpy as np
import pytest

import bx_jax_workers as w
from bagua_x.algorithms import Target
from bagua_x.core import BaguaXError
from bagua_x.jax import AxisCommunicator, wrap
from launch import run_workers

HERE = os.path.dirname(os.path.abspath(__file__))
MULTI_ENV = {"PYTHONPATH": HERE, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
             "LOCAL_WORLD_SIZE": "1"}
STEPS, LR = 5, 5e-2
AXES = ("node", "local")


@pytest.fixture(scope="module")
def setup():
    return w.make_params(0), *w.make_data(STEPS, 4), jax.make_mesh((2, 2), AXES)


# where the two forms give different numbers (allreduce's differ only by summation order; one
# decentralized round with all peers averages the same values either way); seen: ByteGrad 6e-4 (8-bit
# codes of other sums), QAdam 6e-3, DiLoCo 1e-2 (2 workers instead of 4)
DIFFERS_FROM_FLAT = {"bytegrad": 1e-4, "diloco": 1e-3, "qadam": 1e-3}


@pytest.mark.parametrize("name", list(w.two_level_algorithms()))
def test_two_levels_on_a_2d_mesh_equal_pmap_node_groups(setup, name):
    params, x, y, mesh = setup
    algorithm = w.two_level_algorithms()[name]
    got, losses = w.bagua_jit(wrap(params, algorithm=algorithm, axis_name=AXES, mesh=mesh), params, x, y, mesh, LR)
    want = w.bagua_pmap(wrap(params, algorithm=algorithm, devices_per_node=2), params, x, y, LR, sgd=True)
    assert w.max_difference(got, want) <= 1e-6  # seen: 0 (the same collectives, over axes instead of groups)
    assert len(losses) == STEPS and losses[-1] < losses[0]
    if name in DIFFERS_FROM_FLAT:
        flat = w.bagua_pmap(wrap(params, algorithm=dataclasses.replace(algorithm, hierarchical=False)),
                            params, x, y, LR, sgd=True)
        assert w.max_difference(got, flat) > DIFFERS_FROM_FLAT[name]


def test_the_mesh_axes_are_the_node_groups(setup):
    """``within`` is the "local" axis, ``across`` the "node" axis: their sums over a node-major rank."""
    from jax.sharding import PartitionSpec as P

    _, _, _, mesh = setup

    def body(r):
        comm = AxisCommunicator(AXES)
        assert comm.size == 4 and comm.local_size == 2 and comm.within.size == 2 and comm.across.size == 2
        return (comm.within.allreduce(r), comm.across.allreduce(r), comm.rank[None], comm.within.rank[None])

    ranks = jax.device_put(np.arange(4, dtype=np.float32), jax.sharding.NamedSharding(mesh, P(AXES)))
    within, across, rank, local_rank = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES),
                                                             check_vma=False))(ranks)
    np.testing.assert_array_equal(rank, [0, 1, 2, 3])
    np.testing.assert_array_equal(local_rank, [0, 1, 0, 1])
    np.testing.assert_array_equal(within, [1, 1, 5, 5])  # nodes {0, 1} and {2, 3}
    np.testing.assert_array_equal(across, [2, 4, 2, 4])  # places {0, 2} and {1, 3}


def test_a_2d_axis_name_needs_a_mesh_with_both_axes(setup):
    params, _, _, mesh = setup
    with pytest.raises(BaguaXError, match=r"has axes \['node', 'local'\], not 'rack' of the wrap's axis_name "
                                          r"\('rack', 'local'\)"):
        wrap(params, axis_name=("rack", "local"), mesh=mesh)
    with pytest.raises(BaguaXError, match=r"names the axes of a 2-D mesh, and there is no mesh here"):
        wrap(params, axis_name=AXES).replicate(params)


def test_two_levels_on_a_2d_mesh_across_processes():
    """2 processes x 2 devices, the mesh's nodes the processes: equal to pmap with a process a node."""
    runs = run_workers("bx_jax_workers:two_level_mesh_worker", nproc=2, args=(STEPS, LR), timeout=420,
                       env=MULTI_ENV)
    assert len(runs) == 2
    for run in runs:
        assert set(run) == set(w.two_level_algorithms())
        for name, got in run.items():
            assert w.max_difference(got["jit"], got["pmap"]) <= 1e-6, name
            assert len(got["losses"]) == STEPS and got["losses"][-1] < got["losses"][0], name
    for name, algorithm in w.two_level_algorithms().items():
        if algorithm.target is not Target.WEIGHT:
            assert w.max_difference(runs[0][name]["jit"], runs[1][name]["jit"]) == 0, name
