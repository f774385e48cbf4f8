"""The step-side calls outside ``pmap`` / ``shard_map`` (bagua_x runs its own ``shard_map``), and what
``shard_map``'s typing of per-device values means for gradients.

**jit over a mesh.**  JAX's data-parallel style is ``jax.jit`` over a mesh with
the batch sharded along the data axis.  There XLA partitions the step and adds
its own collectives: the gradient of a loss over a sharded batch is already the
global mean, reduced in full precision, when user code sees it, so no bagua_x
algorithm could compress that traffic.  bagua_x has to see each device's own
gradient, so ``dp.value_and_grad(loss_fn)`` differentiates inside a
``jax.shard_map`` over the wrap's axis (each device on its shard of the batch)
and runs the algorithm there; ``dp.sync_params`` and ``dp.optimizer()``'s
update do the same when called at jit level.  :func:`shard_over` builds that
``shard_map`` from each argument's :class:`Layout`, untyped as ``pmap`` is
(below).

**Invariant values.**  Inside a ``shard_map`` (``check_vma=True``, the
default) JAX types a value passed with ``P()`` as the same on every device, and
``jax.grad`` with respect to such a value *sums* the gradient over the axis
(the transpose of the implicit cast to per-device is a ``psum``): a
full-precision allreduce that JAX inserted, after which an algorithm would
average n equal sums -- n times the gradient, with the traffic it was meant to
save already spent.  :func:`per_device` casts the params before
differentiation, and :func:`invariant_leaves` finds gradients (or weights) that
went through it, which the wrap refuses.  ``pmap`` does no such typing.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Hashable, Optional, Sequence, Union

import jax
from jax import lax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from ..core.errors import BaguaXError
from .placement import axis_names, check_mesh_axis, context_mesh

__all__ = ["Layout", "axis_bound", "step_mesh", "shard_over", "per_device", "invariant_leaves"]


class Layout(enum.Enum):
    """How a value of the jit-level step is laid out over the wrap's axis."""

    REPLICATED = "replicated"  # the same on every device (P()): gradient algorithms' params, reduced gradients
    STACKED = "stacked"  # a leading axis of one entry per device (P(axis), [0] inside): per-device values
    SPLIT = "split"  # the first axis split over the devices (P(axis), as is inside): a batch


def axis_bound(axis_name: Hashable) -> bool:
    """Whether the call runs inside ``pmap`` / ``shard_map`` over ``axis_name``."""
    try:
        lax.axis_size(axis_name)
    except NameError:
        return False
    return True


def step_mesh(mesh: Optional[Mesh], axis_name: Hashable, call: str) -> Union[Mesh, AbstractMesh]:
    """The mesh a jit-level ``call`` shards over: the wrap's, else the one of ``jax.set_mesh`` (while tracing,
    which is where the calls run, JAX offers it as an abstract mesh, enough for ``shard_map``)."""
    if mesh is None:
        try:
            mesh = context_mesh(axis_name)
        except ValueError:  # inside jax.jit: get_mesh refuses, the abstract one is the context's
            abstract = jax.sharding.get_abstract_mesh()
            mesh = None if abstract.empty else abstract
            if mesh is not None:
                check_mesh_axis(mesh, axis_name, "the mesh set with jax.set_mesh")
    if mesh is None:
        raise BaguaXError(
            f"{call} was called where axis {axis_name!r} is not bound, outside jax.pmap(..., axis_name="
            f"{axis_name!r}) and jax.shard_map over a mesh axis {axis_name!r}, and without a mesh: "
            f"bagua_x runs its own shard_map at jit level, over the mesh of wrap(mesh=...) or of jax.set_mesh(mesh) "
            f"around the step; pass one of them, or call it inside your pmapped / shard_mapped step"
        )
    return mesh


def _laid_out(x: Any, mesh: Mesh, spec: PartitionSpec) -> Any:
    """``x`` constrained to ``spec`` (shard_map over an explicit axis takes only inputs laid out as its specs)."""
    named = [a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))]
    explicit = any(mesh.axis_types[mesh.axis_names.index(a)] == AxisType.Explicit for a in named)
    if explicit:
        return jax.sharding.reshard(x, NamedSharding(mesh, spec))
    return lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def shard_over(fn: Callable, mesh: Mesh, axis_name: Hashable, layouts: Sequence[Layout],
               out_layouts: Any) -> Callable:
    """``fn`` per device under ``jax.shard_map`` over ``axis_name`` of ``mesh``: argument i laid out as
    ``layouts[i]``, each output as the matching leaf of ``out_layouts`` (a pytree prefix of the outputs);
    STACKED values lose their leading axis inside ``fn`` and get it back after."""

    def spec(layout: Layout) -> PartitionSpec:
        return PartitionSpec() if layout is Layout.REPLICATED else PartitionSpec(axis_name)

    def body(*args):
        inside = [jax.tree.map(lambda a: a[0], x) if lay is Layout.STACKED else x for x, lay in zip(args, layouts)]
        out = fn(*inside)
        return jax.tree.map(lambda lay, o: jax.tree.map(lambda a: a[None], o) if lay is Layout.STACKED else o,
                            out_layouts, out, is_leaf=lambda v: isinstance(v, Layout))

    in_specs = tuple(spec(lay) for lay in layouts)
    out_specs = jax.tree.map(spec, out_layouts, is_leaf=lambda v: isinstance(v, Layout))
    # untyped (check_vma=False), as under pmap: jax.grad does not sum, and REPLICATED outputs are the
    # algorithms' results, equal on every device by construction where typing cannot see it (lax.switch)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def call(*args):
        args = [jax.tree.map(lambda a: _laid_out(a, mesh, s), x) for x, s in zip(args, in_specs)]
        return mapped(*args)

    return call


def _vma_checked() -> bool:
    """Whether the values being traced carry shard_map's per-device typing (inside ``check_vma=True``)."""
    try:
        from jax._src import config
    except ImportError:  # pragma: no cover - depends on the jax version
        return False
    return bool(getattr(getattr(config, "_check_vma", None), "value", False))


def _varying(x: Any) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.10; earlier versions name it vma
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def per_device(tree: Any, axis_name: Hashable) -> Any:
    """``tree`` typed per device on ``axis_name`` (a no-op outside typed shard_map and for per-device leaves),
    so ``jax.grad`` with respect to it is each device's own gradient, not their sum (module docstring)."""
    if not _vma_checked():
        return tree
    cast = getattr(lax, "pcast", None)

    def one(x):
        missing = tuple(a for a in axis_names(axis_name) if a not in _varying(x))
        if not missing:
            return x
        return cast(x, missing, to="varying") if cast is not None else lax.pvary(x, missing)

    return jax.tree.map(one, tree)


def invariant_leaves(leaves: Sequence[Any], names: Sequence[str], axis_name: Hashable) -> list[str]:
    """The names of ``leaves`` that typed shard_map says are the same on every device of ``axis_name``."""
    if not _vma_checked():
        return []
    return [n for n, x in zip(names, leaves) if not set(axis_names(axis_name)) <= _varying(x)]
