"""Workers for bagua_x inside DDP: its comm hook (import name: ``bx_ecosystem_workers``)."""

from __future__ import annotations

from bx_torch_workers import init


def _model(odd: bool):
    """One weight matrix used twice: DDP's first bucket lists parameters in model order and its
    rebuilt ones in gradient order, wrap always in gradient order; with one parameter both
    layouts are the same, so ByteGrad's chunks are too.  ``odd``: an odd element count, so
    ByteGrad pads the bucket for 2 ranks."""
    import torch
    from torch import nn

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(7, 9 if odd else 10) * 0.3)

        def forward(self, x):
            return torch.tanh(x[:, :7] @ self.w) @ self.w.T

    torch.manual_seed(0)
    return Tied()


def _mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 5))


def _batches(rank, steps):
    import torch

    g = torch.Generator().manual_seed(77 + rank)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)) for _ in range(steps)]


def _recording(comm, calls):
    """Wrap ``comm``'s collectives so each call records (collective, dtype, numel) of what it is given."""
    for name in ("allreduce", "alltoall", "allgather"):
        original = getattr(comm, name)

        def record(x, *args, _name=name, _original=original, **kwargs):
            calls.append((_name, str(x.dtype).replace("torch.", ""), int(x.numel())))
            return _original(x, *args, **kwargs)

        setattr(comm, name, record)


def _train(model, opt, batches):
    import torch

    out = []
    for x, y in batches:
        opt.zero_grad()
        pred = model(x)
        torch.nn.functional.mse_loss(pred, y[:, :pred.shape[1]]).backward()
        opt.step()
        out.append([p.detach().numpy().copy() for p in model.parameters()])
    return out


def hook_vs_wrap(algorithm_name, odd, steps=4):
    """The same algorithm as DDP comm hook and through wrap(), one bucket each; the hook's collectives recorded."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bagua_x.torch as bxt
    from bagua_x.algorithms import ByteGrad, GradientAllReduce, PowerSGD

    rank, _ = init()
    make = {"ByteGrad": ByteGrad, "GradientAllReduce": GradientAllReduce,
            "PowerSGD": lambda: PowerSGD(start_powerSGD_iter=1)}[algorithm_name]
    batches = _batches(rank, steps)

    hooked = DDP(_model(odd), bucket_cap_mb=1000)
    state = bxt.CommHookState(make())
    calls = []
    _recording(state.comm, calls)
    hooked.register_comm_hook(state, bxt.comm_hook)
    hook_params = _train(hooked, torch.optim.SGD(hooked.parameters(), lr=0.1), batches)
    ddp_buckets = len(hooked._get_ddp_logging_data().get("bucket_sizes", "").split(", "))
    numel = sum(p.numel() for p in hooked.parameters())
    state.close()

    wrapped = bxt.wrap(_model(odd), algorithm=make(), bucket_cap_mb=1000)
    wrap_params = _train(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1), batches)
    wrapped.shutdown()
    return {"hook": hook_params, "wrap": wrap_params, "calls": calls, "numel": numel,
            "ddp_buckets": ddp_buckets, "wrap_buckets": len(wrapped.buckets), "state": state.algorithm_state_dict()}


def hook_many_buckets(steps=3):
    """GradientAllReduce as a hook on many small DDP buckets, against DDP's own allreduce."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bagua_x.torch as bxt
    from bagua_x.algorithms import GradientAllReduce

    rank, _ = init()

    def model():
        torch.manual_seed(1)
        return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)], nn.Linear(64, 8))

    batches = _batches(rank, steps)
    batches = [(torch.randn(6, 64, generator=torch.Generator().manual_seed(i + 10 * rank)), y) for i, (_, y) in
               enumerate(batches)]
    hooked = DDP(model(), bucket_cap_mb=0.02)
    state = bxt.CommHookState(GradientAllReduce())
    calls = []
    _recording(state.comm, calls)
    hooked.register_comm_hook(state, bxt.comm_hook)
    hook_params = _train(hooked, torch.optim.SGD(hooked.parameters(), lr=0.1), batches)
    state.close()
    plain = DDP(model(), bucket_cap_mb=0.02)
    ddp_params = _train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), batches)
    return {"hook": hook_params, "ddp": ddp_params, "calls": calls, "bucket_indices": sorted(state.buckets)}


def hook_error_reaches_backward():
    """A failing algorithm surfaces as an error from backward on the rank, naming the bucket."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bagua_x.torch as bxt
    from bagua_x.algorithms import GradientAllReduce

    rank, _ = init()
    model = DDP(_model(False))
    state = bxt.CommHookState(GradientAllReduce())

    def broken(x, *a, **k):
        raise RuntimeError("boom")

    state.comm.allreduce = broken
    model.register_comm_hook(state, bxt.comm_hook)
    x, y = _batches(rank, 1)[0]
    try:
        torch.nn.functional.mse_loss(model(x), y[:, :7]).backward()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"
