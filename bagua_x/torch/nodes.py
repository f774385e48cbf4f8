"""The node layout of hierarchical algorithms, agreed by every rank before any node group is made.

Which groups and collectives a rank uses follows from what that rank sees:
its algorithm's ``hierarchical`` setting and torchrun's ``LOCAL_WORLD_SIZE``.
Ranks that see them differently call ``new_group`` a different number of
times or with other ranks, and hang there or fail in gloo much later.  So each
rank first publishes what it sees through the store (JSON, a bounded wait:
:func:`~.store.store_allgather`), and every rank raises the same error,
naming the ranks and their values, when they differ.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Optional

import torch.distributed as dist

from ..algorithms.base import Algorithm, two_level_on
from ..core.comm import Feature
from ..core.errors import BaguaXError
from ..core.wire import decode, encode
from .store import check_tag, resolve_timeout, store_allgather

__all__ = ["NodeLayout", "agree_on_nodes", "declared_setting"]

_SETTINGS = {True: "True (required)", None: "None (over nodes where there are >= 2 nodes of >= 2 ranks)",
             False: "False (flat)"}


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """What every rank agreed on: ``local`` ranks per node, ``nodes`` nodes, and whether the
    algorithm runs in two levels; ``problem`` says why node groups cannot be made (else None)."""

    setting: Optional[bool]
    local: int
    nodes: int
    problem: Optional[str]

    @property
    def two_level(self) -> bool:
        return self.problem is None and two_level_on(self.setting, self.nodes, self.local)


def declared_setting(algorithm: Algorithm) -> Optional[bool]:
    """The algorithm's ``hierarchical=`` as it declares it: True if it requires node groups, None if it
    uses them where offered, False if it never does."""
    if Feature.HIERARCHICAL in algorithm.requires:
        return True
    return None if Feature.HIERARCHICAL in algorithm.uses else False


def agree_on_nodes(group: Optional[dist.ProcessGroup], setting: Optional[bool],
                   local_world_size: Optional[int] = None, timeout: Optional[float] = None) -> NodeLayout:
    """This rank's :class:`NodeLayout`, once every rank of ``group`` (None: the default one) agrees on it
    (collective, no groups made).

    ``setting`` is the algorithm's ``hierarchical=``; ``local_world_size``
    defaults to ``LOCAL_WORLD_SIZE`` (torchrun's).  Raises the same BaguaXError
    on every rank when they differ, and a BaguaXError naming the missing ranks
    when some do not arrive within ``timeout`` seconds (None: the group's).
    """
    size = dist.get_world_size(group)
    layout = _layout(group, size, setting, local_world_size)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    nodes = layout.nodes if layout.local >= 1 and size % layout.local == 0 else \
        f"{size}/{layout.local}, not a whole number"
    mine = [_SETTINGS[setting], layout.local, nodes, "two-level" if layout.two_level else "flat"]
    context = "bagua_x: the ranks' hierarchical settings and node layouts"
    gathered = store_allgather(check_tag("nodes", group), encode(mine), group, resolve_timeout(timeout, group),
                               context)
    views = [decode(data, f"{context}: rank {r}'s view") for r, data in zip(ranks, gathered)]
    for r, v in zip(ranks, views):
        if not (isinstance(v, tuple) and len(v) == len(mine)):
            raise BaguaXError(f"{context}: rank {r} sent {str(v)[:200]!r}; are all ranks on the same bagua_x version?")
    message = _disagreement(ranks, views)
    if message:
        raise BaguaXError(f"bagua_x: ranks disagree on what decides the hierarchical collectives:\n{message}")
    return layout


def _layout(group: Optional[dist.ProcessGroup], size: int, setting: Optional[bool],
            local_world_size: Optional[int]) -> NodeLayout:
    local = int(local_world_size or os.environ.get("LOCAL_WORLD_SIZE", size))
    problem = None
    if group is not None and dist.get_process_group_ranks(group) != list(range(dist.get_world_size())):
        problem = ("hierarchical algorithms need a process group of every rank in order (the default one, or "
                   "new_group() of all ranks)")
    elif local < 1 or size % local:
        problem = (f"world size {size} is not a multiple of LOCAL_WORLD_SIZE={local}; "
                   "launch the same number of ranks on every node")
    return NodeLayout(setting, local, size // local if problem is None else 0, problem)


def _disagreement(ranks: list[int], views: list[tuple]) -> Optional[str]:
    """Each entry that differs, with the ranks that hold each value, and what to do; None if nothing that
    decides collectives differs.

    That is the resolved form, and the layout unless every rank is flat by its
    setting.  Settings that differ but resolve to the same form (e.g. None and
    False on one node) make no group: wrap's model check reports them.
    """
    names = ("hierarchical", "LOCAL_WORLD_SIZE (ranks per node)", "number of nodes", "resolved form")
    settings = {v[0] for v in views}
    differs = [len({v[i] for v in views}) > 1 for i in range(len(names))]
    layout_matters = settings != {_SETTINGS[False]}  # every rank flat: nodes of different sizes do not matter
    if not (differs[3] or (layout_matters and (differs[1] or differs[2]))):
        return None
    lines = []
    for i, name in enumerate(names):
        if not differs[i] or (i in (1, 2) and not layout_matters):
            continue
        holders: dict = collections.defaultdict(list)
        for r, v in zip(ranks, views):
            holders[v[i]].append(r)
        lines.append(f"  {name}: " + "; ".join(f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))}: "
                                                f"{value}" for value, rs in holders.items()))
    if differs[0]:
        advice = "give every rank the same algorithm, with the same hierarchical= setting"
    else:
        advice = ("launch the same number of ranks on every node (torchrun --nproc_per_node, which sets "
                  "LOCAL_WORLD_SIZE), or pass hierarchical=False on every rank to train flat on uneven nodes")
    return "\n".join(lines) + f"\nFix: {advice}."
