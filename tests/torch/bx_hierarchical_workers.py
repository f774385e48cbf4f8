"""Hierarchical workers (import name ``bx_hierarchical_workers``): 4 gloo ranks as 2 nodes of 2 (LOCAL_WORLD_SIZE=2)."""

from __future__ import annotations

NUMEL, STEPS = 800, 3


def inputs(step: int, n: int = 4, scale: float = 0.05):
    """Every rank's flat input at ``step`` (the test rebuilds them for the numpy reference)."""
    import numpy as np

    rng = np.random.default_rng(500 + step)
    return [(rng.standard_normal(NUMEL) * scale).astype(np.float32) for _ in range(n)]


def algorithms():
    """The algorithms' ``reduce`` on real gloo node groups, several steps each, state threaded through."""
    import torch
    import torch.distributed as dist

    import bagua_x.torch as bxt
    from bagua_x.algorithms import ByteGrad, Decentralized, GradientAllReduce, LowPrecisionDecentralized, QAdam
    from bagua_x.core import ReduceOp
    from bagua_x.core.bucket import BucketLayout
    from bagua_x.core.comm import Feature

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    comm = bxt.TorchCommunicator()
    comm.enable_hierarchical(True)
    layout = BucketLayout(["x"], [(NUMEL,)], "float32")
    out = {"features": sorted(f.value for f in comm.features),
           "ranks": [comm.within.rank, comm.within.size, comm.across.rank, comm.across.size],
           "within_gather": comm.within.allgather(torch.tensor([rank])).ravel().tolist(),
           "across_gather": comm.across.allgather(torch.tensor([rank])).ravel().tolist(),
           "across_avg": comm.across.allreduce(torch.tensor([float(rank)]), ReduceOp.AVG).tolist()}
    assert Feature.HIERARCHICAL in comm.features
    runs = {"allreduce": GradientAllReduce(hierarchical=True), "bytegrad": ByteGrad(),
            "bytegrad_sum": ByteGrad(average=False), "decentralized": Decentralized(peer_selection_mode="shift_one"),
            "qadam_momentum": QAdam()}
    for name, alg in runs.items():
        state = alg.init(torch.from_numpy(inputs(0)[rank]), layout, 4)
        results = []
        for t in range(STEPS):
            x, state = alg.reduce(torch.from_numpy(inputs(t)[rank].copy()), layout, state, comm)
            results.append(x.numpy().copy())
        out[name] = results
    lpd = LowPrecisionDecentralized()
    x = torch.from_numpy(inputs(99, scale=0.1)[0].copy())  # the same weights everywhere, as after wrap
    state, results = lpd.init(x, layout, 4), []
    for t in range(STEPS):
        x, state = lpd.reduce(x + torch.from_numpy(inputs(t, scale=0.01)[rank]), layout, state, comm)
        results.append(x.numpy().copy())
    out["lpd"] = results
    dist.destroy_process_group()
    return out


def training(steps: int = 30):
    """wrap() with each algorithm at its default (hierarchical on 2 nodes of 2), against DDP.

    Collectives are counted per communicator (every one goes through ``TorchCommunicator._wait``),
    so the test sees which of the flat, in-node and across-node groups each algorithm used.
    """
    import collections

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bagua_x.torch as bxt
    from bagua_x.algorithms import ByteGrad, Decentralized, GradientAllReduce, LowPrecisionDecentralized
    from bagua_x.core.comm import Feature

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    xs = torch.randn(steps, 16, 5, generator=g)
    ys = xs.sum(-1, keepdim=True).sin()
    systems = {"ddp": None, "allreduce": GradientAllReduce(hierarchical=True), "bytegrad": ByteGrad(),
               "decentralized": Decentralized(), "lpd": LowPrecisionDecentralized(), "qadam": "qadam"}
    calls = collections.Counter()
    wait = bxt.TorchCommunicator._wait

    def counting_wait(comm, work, x):
        calls[id(comm)] += 1
        return wait(comm, work, x)

    bxt.TorchCommunicator._wait = counting_wait
    out = {}
    for name, alg in systems.items():
        calls.clear()
        torch.manual_seed(rank)  # different initial weights on each rank: wrap broadcasts rank 0's
        model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        if alg == "qadam":
            opt = bxt.QAdamOptimizer(model.parameters(), lr=0.02, warmup_steps=5)
            wrapped = bxt.wrap(model, opt)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            wrapped = DDP(model) if alg is None else bxt.wrap(model, opt, algorithm=alg)
        losses = []
        for s in range(steps):
            opt.zero_grad()
            loss = F.mse_loss(wrapped(xs[s]), ys[s])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out[name] = {"losses": losses, "params": [p.detach().clone().numpy() for p in model.parameters()]}
        if alg is not None:
            comm = wrapped.comm
            out[name]["hierarchical"] = Feature.HIERARCHICAL in comm.features
            out[name]["calls"] = {"flat": calls[id(comm)], "within": calls[id(comm.within)],
                                  "across": calls[id(comm.across)]}
            wrapped.shutdown()
    dist.destroy_process_group()
    return out


def disagree(settings):
    """wrap() with ByteGrad(hierarchical=settings[rank]) (``"absent"``: this rank never wraps);
    returns how it ended and how long it took."""
    import time

    import torch
    import torch.distributed as dist

    import bagua_x.torch as bxt
    from bagua_x.algorithms import ByteGrad
    from bagua_x.core.errors import BaguaXError

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(5, 3)
    start = time.monotonic()
    try:
        if settings[rank] == "absent":
            outcome = "absent"
        else:
            bxt.wrap(model, algorithm=ByteGrad(hierarchical=settings[rank]), timeout=3 if "absent" in settings else 30)
            outcome = "wrapped"
    except BaguaXError as e:
        outcome = str(e)
    seconds = time.monotonic() - start
    dist.barrier()  # rank 0 hosts the store: leave together
    dist.destroy_process_group()
    return outcome, seconds
