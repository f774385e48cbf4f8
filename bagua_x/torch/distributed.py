"""Process-group setup, cross-rank model checks and broadcasts used by ``wrap``."""

from __future__ import annotations

import datetime
import importlib
import logging
import os
import socket
from collections import defaultdict
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..core.bucket import Bucket
from ..core.errors import BaguaXError
from ..core.validation import check_same_everywhere, describe
from ..core.wire import decode as wire_decode
from ..core.wire import decode_description, encode
from .store import check_tag, resolve_timeout, restart_count, store_allgather

__all__ = ["ensure_initialized", "private_group", "model_device", "check_one_gpu_per_rank", "check_same_model",
           "check_same_buckets", "broadcast_tensors", "allgather_bytes"]

log = logging.getLogger(__name__)



def model_device(module: torch.nn.Module) -> torch.device:
    """The device of the model's parameters (wrap refuses a model on several devices), where bagua_x works."""
    devices = {p.device for p in module.parameters()}
    return devices.pop() if len(devices) == 1 else torch.device("cpu")


def ensure_initialized(module: torch.nn.Module, timeout: Union[None, float, datetime.timedelta] = None) -> None:
    """Initialise torch.distributed from torchrun's environment if the user has not (gloo on CPU, NCCL on CUDA),
    with ``timeout`` (wrap's) as the process group's own timeout."""
    if dist.is_initialized():
        return
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise BaguaXError(
            f"torch.distributed is not initialised and {', '.join(missing)} are not set; launch with "
            "`torchrun --nproc_per_node N script.py` or call torch.distributed.init_process_group() before wrap()"
        )
    device = model_device(module)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's own set-up uses the current device
    options = {}
    if timeout is not None:
        options["timeout"] = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    attempt = restart_count()
    if attempt:
        # torchrun restarts workers on the same store, where the previous attempt's process-group keys
        # (the dead ranks' gloo addresses) remain: connect under a prefix unique to this attempt
        store, rank, world = next(importlib.import_module("torch.distributed.rendezvous").rendezvous("env://"))
        dist.init_process_group(backend, store=dist.PrefixStore(f"bagua_x/attempt_{attempt}", store),
                                rank=rank, world_size=world, **options)
    else:
        dist.init_process_group(backend, **options)
    log.info("bagua_x: initialised torch.distributed (%s), rank %d of %d",
             backend, dist.get_rank(), dist.get_world_size())


def private_group(group: Optional[dist.ProcessGroup], timeout: float) -> dist.ProcessGroup:
    """A new process group of ``group``'s ranks and backend (``None``: the default group) for bagua_x alone.

    A process group pairs collectives in the order each rank issues them, so
    two threads must never share one: bagua_x's communication thread and the
    user's (SyncBatchNorm, an all_gather in the loss, a second wrapped model)
    would pair differently on different ranks -- wrong sums, or gloo's "data
    size doesn't match".  Collective over ``group``, made on the calling thread
    (NCCL can deadlock on groups made on worker threads while others
    communicate).  The ranks first meet in the store, so one that never comes
    fails the others within ``timeout`` seconds, named.  A group of the whole
    world is made by every rank as usual; a subgroup with
    ``use_local_synchronization``: only its members call it, and the ranks
    outside it keep the same count of groups, in step for their later ones.
    """
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    store_allgather(check_tag("group", group), b"", group, timeout,
                    "bagua_x: making a process group of its own (every rank of the group calls wrap() or "
                    "CommHookState())")
    return dist.new_group(ranks, backend=dist.get_backend(group),
                          use_local_synchronization=len(ranks) < dist.get_world_size())


def check_one_gpu_per_rank(device: torch.device, group: Optional[dist.ProcessGroup], timeout: float) -> None:
    """Raise the same BaguaXError on every rank if two ranks' models are on the same GPU of an NCCL group.

    The usual cause: ``model.cuda()`` without ``torch.cuda.set_device(LOCAL_RANK)``
    puts every rank on GPU 0, and NCCL fails at the first collective with a
    terse "Duplicate GPU detected".  Checked through the store, before any collective.
    """
    if device.type != "cuda" or "nccl" not in dist.get_backend(group):  # gloo shares a GPU between ranks fine
        return
    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", "")) or f"{socket.gethostname()}/{device.index}"
    gathered = store_allgather(check_tag("devices", group), encode([uuid, str(device)]), group, timeout,
                               "bagua_x.torch.wrap: checking that each rank has a GPU of its own")
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(gathered)))
    problem = shared_gpus([wire_decode(d, f"rank {r}'s GPU") for r, d in zip(ranks, gathered)], ranks)
    if problem:
        raise BaguaXError(f"bagua_x.torch.wrap: {problem}")


def shared_gpus(entries: Sequence[Sequence[str]], ranks: Sequence[int]) -> Optional[str]:
    """What is wrong when ranks share a GPU (``entries``: each rank's GPU id and device name), else None."""
    owners: dict = defaultdict(list)
    for rank, (uuid, name) in zip(ranks, entries):
        owners[uuid].append((rank, name))
    shared = [ranks_on for ranks_on in owners.values() if len(ranks_on) > 1]
    if not shared:
        return None
    where = "; ".join(f"ranks {[r for r, _ in group]} are all on {group[0][1]}" for group in shared)
    return (f"{where}, the same GPU: NCCL needs one GPU per rank. Move each rank's model to its own GPU before "
            "wrap(): torch.cuda.set_device(int(os.environ['LOCAL_RANK'])); model.cuda() (or "
            "model.to(f'cuda:{LOCAL_RANK}'))")


def check_same_model(module: torch.nn.Module, settings: dict, group: Optional[dist.ProcessGroup]) -> None:
    """Raise the same BaguaXError on every rank if ranks wrap different models or algorithms.

    All ranks exchange descriptions first, so none is left waiting in a later
    collective while another has failed.
    """
    tensors = [(n, p.shape, f"{p.dtype}{'' if p.requires_grad else ' frozen'}") for n, p in module.named_parameters()]
    tensors += [(f"{n} (buffer)", b.shape, str(b.dtype)) for n, b in module.named_buffers()]
    # without the leading tensor count, a missing or extra layer is reported by its name
    context = "bagua_x.torch.wrap: ranks wrap different models or algorithms"
    gathered = allgather_bytes(encode(describe(tensors, settings)), group, model_device(module))
    everyone = [decode_description(data, f"{context}: rank {r}'s description") for r, data in enumerate(gathered)]
    check_same_everywhere(everyone, context)


def allgather_bytes(data: bytes, group: Optional[dist.ProcessGroup], device: torch.device) -> list[bytes]:
    """Every rank's ``data`` (any length), in rank order: two collectives, lengths then padded bytes.

    Unlike ``all_gather_object`` nothing is unpickled: the caller decodes plain data.
    The collectives run on ``device`` (the model's) where it is a GPU, so an NCCL group is fine.
    """
    device = device if device.type == "cuda" else torch.device("cpu")
    world = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    width = max(int(n) for n in lengths)
    mine = torch.zeros(width, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    return [bytes(row[: int(n)].cpu().numpy()) for row, n in zip(rows, lengths)]


def check_same_buckets(buckets: Sequence[Bucket], settings: dict, group: Optional[dist.ProcessGroup],
                       timeout: Optional[float], context: str, kind: str = "buckets") -> None:
    """Raise the same BaguaXError on every rank if ranks built different buckets (e.g. when rebuilding them).

    The descriptions travel through the store, not a collective: a rank that
    does not rebuild at the same moment cannot pair with an unrelated
    collective, it just fails to arrive within ``timeout`` seconds (None: the
    group's).  ``kind`` counts apart the rebuilds that not every rank's
    history shares in one order (QAdam's switch, the first-step reorder).
    """
    tensors = [(slot.name, slot.shape, b.dtype) for b in buckets for slot in b.layout.slots]
    layouts = {b.name: b.layout.describe() for b in buckets}
    mine = describe(tensors, {**settings, **layouts})
    timeout = resolve_timeout(timeout, group)
    gathered = store_allgather(check_tag(kind, group), encode(mine), group, timeout, context)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(gathered))
    everyone = [decode_description(data, f"{context}: rank {r}'s description") for r, data in zip(ranks, gathered)]
    check_same_everywhere(everyone, context)


def broadcast_tensors(tensors: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup], src: int = 0,
                      timeout: Optional[float] = None) -> None:
    """Overwrite ``tensors`` with rank ``src``'s values, one collective per dtype and device.

    CPU broadcasts raise after ``timeout`` seconds (default: the process group's timeout).
    """
    groups: dict = defaultdict(list)
    for t in tensors:
        groups[(t.dtype, t.device)].append(t)
    root = src if group is None else dist.get_global_rank(group, src)
    with torch.no_grad():
        for same in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            try:
                work = dist.broadcast(flat, root, group=group, async_op=True)
                if timeout is not None and flat.device.type == "cpu":
                    work.wait(datetime.timedelta(seconds=timeout))
                else:
                    work.wait()
            except RuntimeError as e:
                raise BaguaXError(
                    f"broadcasting {len(same)} parameters/buffers from rank {src} failed: {e}; a rank died or did "
                    "not reach the same forward (the buffers of a wrapped model are broadcast before each forward)"
                ) from e
            offset = 0
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
