"""Putting trees on the devices the way a pmap or shard_map step reads them.

Three layouts:

* pmap (``mesh=None``): every leaf gets a leading axis of the local devices,
  one copy per device, sharded along it -- what ``jax.pmap`` takes (each
  process passes its local devices' rows).
* shard_map (a ``Mesh``): a global array replicated on every device of the
  mesh (``PartitionSpec()``), to pass with ``in_specs=P()``: params and
  optimizer state of gradient algorithms, which stay identical everywhere.
* shard_map, ``per_device=True``: a global array with a leading axis of the
  mesh axis's devices, sharded along it (``in_specs=P(axis_name)``; each device
  sees a leading axis of 1, so index ``[0]`` inside the step and add it back
  with ``[None]``): for values that differ per device, such as the params of
  weight algorithms (decentralized training) and their state.

In a multi-process run process 0's values are broadcast first, so processes
that initialised their params from different seeds still start identical.
"""

from __future__ import annotations

from typing import Any, Hashable, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core.errors import BaguaXError

__all__ = ["replicate", "unreplicate", "from_process0", "context_mesh", "axis_names", "mesh_axis_size"]


def axis_names(axis_name: Hashable) -> tuple:
    """The mesh axes the wrap's ``axis_name`` stands for: one name, or a tuple of two, ``("node", "local")``:
    nodes along the first, a node's devices along the second (the two levels on a 2-D mesh)."""
    return tuple(axis_name) if isinstance(axis_name, tuple) else (axis_name,)


def mesh_axis_size(mesh: Any, axis_name: Hashable) -> int:
    """The devices along ``axis_name`` of ``mesh`` (a tuple: the product of its axes)."""
    return int(np.prod([mesh.shape[a] for a in axis_names(axis_name)]))


def check_mesh_axis(mesh: Any, axis_name: Hashable, which: str = "the mesh") -> None:
    """Raise unless ``mesh`` has every axis ``axis_name`` names."""
    missing = [a for a in axis_names(axis_name) if a not in mesh.axis_names]
    if missing:
        raise BaguaXError(f"{which} has axes {list(mesh.axis_names)}, not {missing[0]!r} of the wrap's axis_name "
                          f"{axis_name!r}; pass a mesh with that axis, or wrap with axis names the mesh has")


def from_process0(tree: Any) -> Any:
    """Process 0's values of ``tree`` as host (numpy) arrays on every process."""
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(jax.device_get(tree))


def context_mesh(axis_name: Hashable) -> Optional[Mesh]:
    """The mesh of ``jax.set_mesh(...)`` around the caller, or None outside one: a mesh step reads its
    arguments laid out on it, so placement must not fall back to pmap's layout there."""
    get_mesh = getattr(jax.sharding, "get_mesh", None)  # JAX >= 0.8
    mesh = get_mesh() if get_mesh is not None else None
    if mesh is None or mesh.empty:
        return None
    check_mesh_axis(mesh, axis_name, "the mesh set with jax.set_mesh")
    return mesh


def replicate(tree: Any, axis_name: Hashable, mesh: Optional[Mesh] = None, per_device: bool = False) -> Any:
    """Process 0's ``tree`` on every device, in one of the layouts above (``mesh`` defaults to the one of
    ``jax.set_mesh`` around the call)."""
    host = from_process0(tree)
    mesh = mesh if mesh is not None else context_mesh(axis_name)
    if mesh is not None:
        check_mesh_axis(mesh, axis_name)
    elif isinstance(axis_name, tuple):
        raise BaguaXError(f"the wrap's axis_name {axis_name!r} names the axes of a 2-D mesh, and there is no mesh "
                          "here: pass mesh=, wrap(mesh=...), or call inside jax.set_mesh(mesh)")
    if mesh is None:
        devices = jax.local_devices()
        stacked = NamedSharding(Mesh(np.array(devices), (axis_name,)), PartitionSpec(axis_name))
        return jax.tree.map(lambda x: jax.device_put(np.stack([x] * len(devices)), stacked), host)
    if per_device:
        n = mesh_axis_size(mesh, axis_name)
        host = jax.tree.map(lambda x: np.broadcast_to(x, (n,) + np.shape(x)), host)
    sharding = NamedSharding(mesh, PartitionSpec(axis_name) if per_device else PartitionSpec())
    return jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx]), host)


def _first_copy(x):
    if not isinstance(x, jax.Array):
        return np.asarray(x)[0]
    local = x.addressable_data(0)
    spec = getattr(x.sharding, "spec", None)
    stacked = spec is None or (len(spec) > 0 and spec[0] is not None)
    return local[0] if stacked else local


def unreplicate(tree: Any) -> Any:
    """The first local device's copy of each leaf (pmap layout or mesh-replicated)."""
    return jax.tree.map(_first_copy, tree)
