"""Process-group setup, cross-rank model checks and broadcasts used by ``wrap``."""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..core.errors import BaguaXError
from ..core.validation import check_same_everywhere, describe

__all__ = ["ensure_initialized", "check_same_model", "broadcast_tensors"]

log = logging.getLogger(__name__)


def ensure_initialized(module: torch.nn.Module) -> None:
    """Initialise torch.distributed from torchrun's environment if the user has not (gloo on CPU, NCCL on CUDA)."""
    if dist.is_initialized():
        return
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise BaguaXError(
            f"torch.distributed is not initialised and {', '.join(missing)} are not set; launch with "
            "`torchrun --nproc_per_node N script.py` or call torch.distributed.init_process_group() before wrap()"
        )
    on_cuda = any(p.is_cuda for p in module.parameters())
    backend = "nccl" if on_cuda else "gloo"
    if on_cuda and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    log.info("bagua_x: initialised torch.distributed (%s), rank %d of %d",
             backend, dist.get_rank(), dist.get_world_size())


def check_same_model(module: torch.nn.Module, settings: dict, group: Optional[dist.ProcessGroup]) -> None:
    """Raise the same BaguaXError on every rank if ranks wrap different models or algorithms.

    All ranks exchange descriptions first, so none is left waiting in a later
    collective while another has failed.
    """
    tensors = [(n, p.shape, f"{p.dtype}{'' if p.requires_grad else ' frozen'}") for n, p in module.named_parameters()]
    tensors += [(f"{n} (buffer)", b.shape, str(b.dtype)) for n, b in module.named_buffers()]
    # without the leading tensor count, a missing or extra layer is reported by its name
    mine = describe(tensors, settings)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    check_same_everywhere(everyone, "bagua_x.torch.wrap: ranks wrap different models or algorithms")


def broadcast_tensors(tensors: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup], src: int = 0) -> None:
    """Overwrite ``tensors`` with rank ``src``'s values, one collective per dtype and device."""
    groups: dict = defaultdict(list)
    for t in tensors:
        groups[(t.dtype, t.device)].append(t)
    root = src if group is None else dist.get_global_rank(group, src)
    with torch.no_grad():
        for same in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            dist.broadcast(flat, root, group=group)
            offset = 0
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
