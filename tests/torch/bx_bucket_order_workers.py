"""Workers for the bucket rebuild after the first backward (import name ``bx_bucket_order_workers``).

The model runs its branches in an order that is neither its definition
order nor the same on every rank, so the ready order differs from the
registration order and across ranks: the rebuilt buckets must follow rank 0's.
"""

from __future__ import annotations


def _init():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def out_of_order_model(rank: int):
    """The head is defined first but used last; rank 0 runs branches a, b, c and rank 1 c, b, a."""
    import torch
    from torch import nn

    class OutOfOrder(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(16, 4)
            self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(8, 16)

        def forward(self, x):
            branches = [self.a, self.b, self.c] if rank == 0 else [self.c, self.b, self.a]
            h = torch.zeros(x.shape[0], 16)
            for branch in branches:
                h = h + torch.tanh(branch(x))
            return self.head(h)

    return OutOfOrder()


def _batch(rank: int, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _step(model, opt, rank, step):
    import torch.nn.functional as F

    x, y = _batch(rank, step)
    opt.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    opt.step()


def order_after_first_step(steps=3):
    """Each rank's own ready order, its bucket order after each step, the saved order, and DDP parity."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bagua_x.torch as bxt
    from bx_torch_workers import grads_are_bucket_views

    rank, _ = _init()
    torch.manual_seed(rank)  # different initial weights: wrap broadcasts rank 0's
    model = out_of_order_model(rank)
    names = {p: n for n, p in model.named_parameters()}
    ready: list[str] = []
    for p in model.parameters():  # registered before wrap's hooks, so they see the same order
        p.register_post_accumulate_grad_hook(lambda p: ready.append(names[p]))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    wrapped = bxt.wrap(model, opt, bucket_cap_mb=3e-4)  # a bucket per one or two tensors
    before = [t.name for b in wrapped.buckets for t in b.tensors]
    orders, views = [], []
    for s in range(steps):
        _step(wrapped, opt, rank, s)
        orders.append([t.name for b in wrapped.buckets for t in b.tensors])
        views.append(grads_are_bucket_views(wrapped))
    saved = wrapped.algorithm_state_dict().get("bucket_order")
    wrapped.shutdown()

    torch.manual_seed(rank)
    ref = out_of_order_model(rank)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    ddp = DDP(ref, bucket_cap_mb=3e-4)
    for s in range(steps):
        _step(ddp, ref_opt, rank, s)
    diff = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    return {"ready": ready[: len(names)], "before": before, "orders": orders, "saved": saved, "views": views,
            "ddp_diff": diff, "buckets": len(wrapped.buckets)}


def in_order_keeps_buffers(steps=2):
    """A chain model's ready order gives the buckets they already have: they are kept, not rebuilt."""
    import torch
    from torch import nn

    import bagua_x.torch as bxt

    from torch.nn.parallel import DistributedDataParallel as DDP

    def chain():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    rank, _ = _init()
    model = chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped = bxt.wrap(model, opt, bucket_cap_mb=3e-4)
    pointers = [[b.buffer.data_ptr() for b in wrapped.buckets]]
    for s in range(steps):
        _step(wrapped, opt, rank, s)
        pointers.append([b.buffer.data_ptr() for b in wrapped.buckets])
    saved = wrapped.algorithm_state_dict().get("bucket_order")
    wrapped.shutdown()

    ref = chain()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    ddp = DDP(ref, bucket_cap_mb=3e-4)
    for s in range(steps):  # the first step too: kept buckets must still be communicated after recording
        _step(ddp, ref_opt, rank, s)
    diff = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    return {"pointers": pointers, "saved": saved, "names": [n for n, _ in model.named_parameters()],
            "ddp_diff": diff}


def _memory_kb(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the peak since the last reset) of this process, in kB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _end_of_backward_growth(loss) -> tuple[float, float]:
    """``loss.backward()``'s peak RSS growth in MB: (backward's own, up to its end-of-backward callbacks;
    the callbacks', from the RSS when they start).  A pre-hook on the loss's node queues a marker callback
    before any parameter's hook queues wrap's, so the marker runs first: backward's temporaries are
    freed, wrap's rebuild and communication not begun.  ``/proc/self/clear_refs`` resets ``VmHWM``."""
    import torch

    def reset_peak():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := the current RSS

    at_end = {}

    def mark():
        at_end["peak"], at_end["rss"] = _memory_kb("VmHWM"), _memory_kb("VmRSS")
        reset_peak()

    loss.grad_fn.register_prehook(lambda *_: torch.autograd.Variable._execution_engine.queue_callback(mark))
    before = _memory_kb("VmRSS")
    reset_peak()
    loss.backward()
    return (at_end["peak"] - before) / 1024, (_memory_kb("VmHWM") - at_end["rss"]) / 1024


def rebuild_peak_memory(layers=8, width=1024, shuffled=(5, 2, 7, 0, 3, 6, 1, 4), per_bucket=1):
    """The peak RSS growth of a first backward, in MB, split at its end-of-backward callbacks
    (:func:`_end_of_backward_growth`): backward's own temporaries (a 4 MB weight gradient per matmul,
    the BLAS's and the allocator's: machine dependent) apart from what wrap's rebuild and first
    communication add.  Three models in this process: a warm-up (a process's first wrapped backward
    pays one-off costs, about 2 MB in each part here), then the layers used in definition order (the
    ready order gives the buckets they have: all ``kept``, the baseline) and in ``shuffled`` order
    (every bucket ``rebuilt``).

    ``layers`` square weights of ``width`` (4 MB each at 1024), ``per_bucket`` in each bucket.  Run with
    ``MALLOC_MMAP_THRESHOLD_`` small: every buffer is then mapped on allocation and unmapped when
    freed, so the peak RSS is the peak of live buffers, not of what malloc kept cached (``freed_mb``:
    what freeing one bucket-sized tensor gave back, the check that this holds here).
    """
    import torch
    from torch import nn

    import bagua_x.torch as bxt

    rank, _ = _init()
    bucket_mb = per_bucket * width * width * 4 / 2**20
    probe = torch.ones(per_bucket * width * width)  # does a freed bucket leave the RSS (else nothing is measured)?
    held = _memory_kb("VmRSS")
    del probe
    out = {"bucket_mb": bucket_mb, "freed_mb": (held - _memory_kb("VmRSS")) / 1024}
    for case, order in (("warm-up", range(layers)), ("kept", range(layers)), ("rebuilt", shuffled)):
        torch.manual_seed(0)
        model = nn.ModuleList([nn.Linear(width, width, bias=False) for _ in range(layers)])
        wrapped = bxt.wrap(model, bucket_cap_mb=bucket_mb)
        registered = [[t.name for t in b.tensors] for b in wrapped.buckets]
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(rank))
        for i in order:
            x = torch.tanh(model[i](x))
        backward_mb, end_mb = _end_of_backward_growth(x.square().mean())
        out[case] = {"backward_mb": backward_mb, "end_mb": end_mb, "registered": registered,
                     "buckets": [[t.name for t in b.tensors] for b in wrapped.buckets]}
        wrapped.shutdown()
    return out
