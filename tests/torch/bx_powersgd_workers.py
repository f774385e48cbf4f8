"""PowerSGD on real gloo ranks (import name ``bx_powersgd_workers``): the algorithm against the numpy
reference, and bagua_x's PowerSGD through wrap() against torch's own powerSGD_hook on DDP."""

from __future__ import annotations

import numpy as np


def _init():
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    return dist.get_rank(), dist.get_world_size()


def reduce_steps(shapes, steps, settings, zero_step=None):
    """``PowerSGD(**settings).reduce`` on a bucket of ``shapes`` for ``steps`` steps: every step's input and output
    (all zero at ``zero_step``)."""
    import torch

    from bagua_x.algorithms import PowerSGD
    from bagua_x.core.bucket import BucketLayout
    from bagua_x.torch import TorchCommunicator

    rank, size = _init()
    layout = BucketLayout([f"t{i}" for i in range(len(shapes))], shapes, "float32")
    alg, comm = PowerSGD(**settings), TorchCommunicator()
    ins = [np.random.default_rng(100 * t + rank).standard_normal(layout.numel).astype(np.float32) for t in range(steps)]
    if zero_step is not None:
        ins[zero_step][:] = 0
    state = alg.init(torch.from_numpy(ins[0]), layout, size)
    outs = []
    for x in ins:
        out, state = alg.reduce(torch.from_numpy(x.copy()), layout, state, comm)
        outs.append(out.numpy().copy())
    return {"ins": ins, "outs": outs}


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10))


def _data(rank, steps):
    import torch

    g = torch.Generator().manual_seed(1)
    centers = torch.randn(10, 64, generator=g) * 0.3  # overlapping classes: the loss settles well above 0
    g = torch.Generator().manual_seed(100 + rank)  # ranks see different samples
    labels = torch.randint(0, 10, (steps, 32), generator=g)
    return centers[labels] + torch.randn(steps, 32, 64, generator=g), labels


def train_vs_hook(steps=150, rank_r=2, start=10):
    """The same model, data and SGD twice: DDP + torch's powerSGD_hook, then bagua_x.torch.wrap + PowerSGD.

    Returns each run's losses and the elements each rank allreduced per step after ``start``.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bagua_x.torch as bxt
    from bagua_x.algorithms import PowerSGD

    rank, _ = _init()
    xs, ys = _data(rank, steps)
    counted: list[int] = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):  # what the hook sends (DDP's own reducer is C++)
        counted.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    def run(wrap_model, elements_of_step):
        model = _model()
        wrapped = wrap_model(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses, per_step = [], []
        for t in range(steps):
            counted.clear()
            opt.zero_grad()
            loss = F.cross_entropy(wrapped(xs[t]), ys[t])
            loss.backward()
            opt.step()
            losses.append(float(loss))
            per_step.append(elements_of_step())
        return losses, per_step, wrapped

    state = hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r, start_powerSGD_iter=start,
                               min_compression_rate=2, use_error_feedback=True, warm_start=True)

    def ddp(model):
        d = DDP(model)
        d.register_comm_hook(state, hook.powerSGD_hook)
        return d

    dist.all_reduce = counting_all_reduce
    try:
        hook_losses, hook_elements, _ = run(ddp, lambda: sum(counted))
    finally:
        dist.all_reduce = real_all_reduce

    sent: list[int] = []

    def bagua(model):
        w = bxt.wrap(model, algorithm=PowerSGD(matrix_approximation_rank=rank_r, start_powerSGD_iter=start))
        real = w.comm.allreduce
        w.comm.allreduce = lambda x, *a, **k: (sent.append(x.numel()), real(x, *a, **k))[1]
        return w

    def ours_elements():
        total = sum(sent)
        sent.clear()
        return total

    bagua_losses, bagua_elements, wrapped = run(bagua, ours_elements)
    wire = sum(wrapped.algorithm.wire_bytes(b.layout, b.itemsize, 2) for b in wrapped.buckets)
    return {"hook_losses": hook_losses, "bagua_losses": bagua_losses, "hook_elements": hook_elements[start + 1:],
            "bagua_elements": bagua_elements[start + 1:], "wire_bytes": wire,
            "params": sum(p.numel() for p in wrapped.module.parameters())}
