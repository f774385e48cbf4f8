"""Where each leaf of a wrapped params tree goes: its name, shape and dtype, and the buckets (pure: no collective).

JAX arrays are immutable, so a leaf's key path is its proxy: what stays fixed
from step to step.  :class:`LeafPlan` is made once at ``wrap`` from the params
tree and answers, for any tree passed later, which of its leaves are
communicated and in which bucket, refusing (naming the leaf) a tree that is
not the wrapped one.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.bucket import BucketLayout, plan_buckets
from ..core.errors import BaguaXError
from .checks import check_leaf_dtype, check_registrable

__all__ = ["LeafPlan"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """The wrapped tree's structure and leaves, and each bucket's leaves (indices into ``names``) and layout."""

    treedef: Any
    names: list[str]
    shapes: list[tuple]
    dtypes: list
    bucket_leaves: list[list[int]]
    layouts: list[BucketLayout]

    @classmethod
    def of(cls, params: Any, alignment: int, bucket_cap_mb: float) -> "LeafPlan":
        """The plan of ``params``: its floating leaves in buckets of at most ``bucket_cap_mb`` per dtype, each
        padded to a multiple of ``alignment``; other leaves pass through every call untouched."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        names = [jax.tree_util.keystr(path) for path, _ in flat]
        shapes = [tuple(np.shape(x)) for _, x in flat]
        dtypes = [jnp.result_type(x) for _, x in flat]
        check_registrable(names, dtypes)
        registered = [i for i, d in enumerate(dtypes) if jnp.issubdtype(d, jnp.inexact)]
        skipped = sorted(set(names) - {names[i] for i in registered})
        if skipped:
            logger.info("bagua_x.jax.wrap: leaving non-float leaves untouched: %s", skipped)
        entries = [(str(dtypes[i]), names[i], int(np.prod(shapes[i])) * dtypes[i].itemsize) for i in registered]
        bucket_leaves = [[registered[j] for j in b] for b in plan_buckets(entries, bucket_cap_mb * 2**20)]
        layouts = [BucketLayout([names[i] for i in b], [shapes[i] for i in b], str(dtypes[b[0]]), alignment)
                   for b in bucket_leaves]
        return cls(treedef, names, shapes, dtypes, bucket_leaves, layouts)

    @property
    def registered(self) -> list[int]:
        """The communicated leaves (indices into ``names``), bucket by bucket."""
        return [i for b in self.bucket_leaves for i in b]

    def mean_leaf_bytes(self) -> float:
        """The mean size of a communicated leaf (in one process, small leaves are worth packing)."""
        sizes = [int(np.prod(self.shapes[i])) * self.dtypes[i].itemsize for i in self.registered]
        return sum(sizes) / max(len(sizes), 1)

    def leaf_layout(self, i: int) -> BucketLayout:
        """Leaf ``i`` as a bucket of its own (per-leaf collectives)."""
        return BucketLayout([self.names[i]], [self.shapes[i]], str(self.dtypes[i]))

    def registered_leaves(self, tree: Any) -> tuple[list, list[str], list[tuple]]:
        """The registered leaves of ``tree`` (one as wrapped, or stacked per device), their names and shapes."""
        leaves = jax.tree_util.tree_leaves(tree)
        registered = [i for i in self.registered if i < len(leaves)]  # a wrong tree: leaves() names what is wrong
        return [leaves[i] for i in registered], [self.names[i] for i in registered], [self.shapes[i] for i in registered]

    def leaves(self, tree: Any, where: str, floats: bool = False) -> list:
        """The leaves of ``tree``, checked against the wrapped params (``floats``: registered ones are floating)."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        if treedef != self.treedef:
            names = [jax.tree_util.keystr(p) for p, _ in flat]
            missing = [n for n in self.names if n not in names]
            extra = [n for n in names if n not in self.names]
            detail = (f"missing leaves {missing[:5]}, unexpected leaves {extra[:5]}" if missing or extra else
                      f"the same leaf paths in other containers: wrap had {self.treedef}, got {treedef}")
            raise BaguaXError(
                f"{where}: the tree does not match the params given to wrap ({detail}); pass a tree with the "
                "same structure as the wrapped params, or wrap the new structure"
            )
        for name, shape, (_, x) in zip(self.names, self.shapes, flat):
            if tuple(np.shape(x)) != shape:
                raise BaguaXError(
                    f"{where}: leaf {name!r} has shape {tuple(np.shape(x))}, but wrap registered it with {shape}; "
                    "inside the step pass per-device values (pmap strips the device axis; under shard_map index "
                    "per-device inputs with [0])"
                )
        if floats:
            for i in self.registered:
                check_leaf_dtype(where, self.names[i], jnp.result_type(flat[i][1]), self.dtypes[i])
        return [x for _, x in flat]
