"""Hierarchical allreduce workers (import name ``bx_hierarchical_workers``): 4 ranks as 2 nodes of 2."""

from __future__ import annotations


def hierarchical(steps=3):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bagua_x.torch as bxt
    from bagua_x.algorithms import GradientAllReduce
    from bagua_x.core import ReduceOp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    comm = bxt.TorchCommunicator()
    comm.enable_hierarchical()
    x = torch.arange(6, dtype=torch.float32) * (rank + 1)
    ops = {op.value: comm.hierarchical_allreduce(x, op).numpy() for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX)}

    g = torch.Generator().manual_seed(rank)
    xs, ys = torch.randn(steps, 8, 5, generator=g), torch.randn(steps, 8, 1, generator=g)
    params = {}
    for system in ("ddp", "bagua_x"):
        torch.manual_seed(rank)  # different initial weights on each rank
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        wrapped = DDP(model) if system == "ddp" else bxt.wrap(model, opt, algorithm=GradientAllReduce(hierarchical=True))
        for s in range(steps):
            opt.zero_grad()
            F.mse_loss(wrapped(xs[s]), ys[s]).backward()
            opt.step()
        params[system] = [p.detach().clone().numpy() for p in model.parameters()]
        if system == "bagua_x":
            wrapped.shutdown()
    return {"ops": ops, "params": params}
