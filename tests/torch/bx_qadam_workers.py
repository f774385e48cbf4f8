"""QAdam worker functions run on real gloo ranks (import name ``bx_qadam_workers``)."""

from __future__ import annotations



def _init():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _data(rank, steps):
    import torch

    g = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    return torch.randn(steps, 16, 8, generator=g), torch.randn(steps, 16, 4, generator=g)


def warmup_vs_ddp_adam(steps=5):
    """QAdam entirely in warmup vs torch DDP + torch.optim.Adam: the same parameters."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bagua_x.torch as bxt

    rank, _ = _init()
    xs, ys = _data(rank, steps)
    results = {}
    for system in ("ddp", "bagua_x"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        if system == "ddp":
            opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
            wrapped = DDP(model)
        else:
            opt = bxt.QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=steps, betas=(0.9, 0.99),
                                     eps=1e-8, weight_decay=0.01)
            wrapped = bxt.wrap(model, opt)
        for s in range(steps):
            opt.zero_grad()
            F.mse_loss(wrapped(xs[s]), ys[s]).backward()
            opt.step()
        results[system] = [p.detach().clone().numpy() for p in model.parameters()]
        if system == "bagua_x":
            wrapped.shutdown()
    return results


def compressed_steps(steps=6, warmup=2):
    """One Linear(8, 4, bias=False): record each rank's gradient and the parameter after every step."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import bagua_x.torch as bxt

    rank, world = _init()
    xs, ys = _data(rank, steps)
    torch.manual_seed(rank)  # different initial weights: wrap broadcasts rank 0's
    model = torch.nn.Linear(8, 4, bias=False)
    initial = None
    opt = bxt.QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=warmup, weight_decay=0.01)
    wrapped = bxt.wrap(model, opt)
    sent = []  # (step, collective, dtype, numel) of what the real communicator is given

    def recording(name, collective):
        def run(x, *args, **kwargs):
            sent.append((len(params), name, str(x.dtype).replace("torch.", ""), int(x.numel())))
            return collective(x, *args, **kwargs)
        return run

    for name in ("allreduce", "alltoall", "allgather"):
        setattr(wrapped.comm, name, recording(name, getattr(wrapped.comm, name)))
    initial = model.weight.detach().clone().reshape(-1).numpy()
    grads, params, momentum_views = [], [], []
    for s in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(wrapped(xs[s]), ys[s] @ torch.ones(4, 4) * 0.3)
        # the local gradient, before any communication, for the reference
        local = torch.autograd.grad(loss, model.weight, retain_graph=True)[0].reshape(-1)
        gathered = [torch.zeros_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        grads.append([g.numpy() for g in gathered])
        loss.backward()
        opt.step()
        params.append(model.weight.detach().clone().reshape(-1).numpy())
        m = opt.state[model.weight]["exp_avg"]
        momentum_views.append(any(m.data_ptr() == b.buffer.data_ptr() for b in wrapped.buckets))
    wrapped.shutdown()
    return {"initial": initial, "grads": grads, "params": params, "momentum_views": momentum_views, "sent": sent}


def converge(steps=80, warmup=20):
    import torch
    import torch.nn.functional as F

    import bagua_x.torch as bxt

    rank, _ = _init()
    torch.manual_seed(rank)
    true_w = torch.linspace(-1, 1, 16).reshape(1, 16)
    g = torch.Generator().manual_seed(rank)
    xs = torch.randn(steps, 32, 16, generator=g) + rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 1))
    opt = bxt.QAdamOptimizer(model.parameters(), lr=2e-2, warmup_steps=warmup)
    wrapped = bxt.wrap(model, opt)
    losses = []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(wrapped(xs[s]), xs[s] @ true_w.T)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    wrapped.shutdown()
    return {"losses": losses, "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()}
