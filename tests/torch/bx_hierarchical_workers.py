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
    """wrap() with each algorithm over nodes (hierarchical=True, on 2 nodes of 2), against DDP.

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
    systems = {"ddp": None, "allreduce": GradientAllReduce(hierarchical=True), "bytegrad": ByteGrad(hierarchical=True),
               "decentralized": Decentralized(hierarchical=True), "lpd": LowPrecisionDecentralized(hierarchical=True),
               "qadam": "qadam"}
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
            opt = bxt.QAdamOptimizer(model.parameters(), lr=0.02, warmup_steps=5, hierarchical=True)
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


# -- hierarchical=None: the form chosen by measurement -------------------------------------------------------------

def _slowed(algorithm, delays: dict, forms=None):
    """``algorithm`` whose ``reduce`` sleeps ``delays[(rank, over nodes)]`` seconds after its collectives, while
    ``delays`` is not empty: one form made slow on some ranks only, so ranks time the forms differently.
    ``forms``: a list that gets the form of every reduce (True: over nodes)."""
    import dataclasses
    import time

    import torch.distributed as dist

    from bagua_x.core.comm import Feature

    class Slowed(type(algorithm)):
        def reduce(self, flat, layout, state, comm):
            out = super().reduce(flat, layout, state, comm)
            time.sleep(delays.get((dist.get_rank(), Feature.HIERARCHICAL in comm.features), 0.0))
            if forms is not None:
                forms.append(Feature.HIERARCHICAL in comm.features)
            return out

    return Slowed(**{f.name: getattr(algorithm, f.name) for f in dataclasses.fields(algorithm)})


class _Records:
    """The messages bagua_x logs at INFO and above while it is installed."""

    def __enter__(self):
        import logging

        self.messages, self.logger = [], logging.getLogger("bagua_x")
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.messages.append(record.getMessage())
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self.handler)
        return self.messages

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


def _train_measured(algorithm, rank: int, steps, delays: dict, seed: int, load=None, save=None, stop=None,
                    seen=None):
    """Train the small model of :func:`training` with ``algorithm`` (delays cleared once the trial's steps are
    over); returns (over nodes?, the log, params), saving the checkpoint to ``save`` after ``stop`` steps.
    ``seen``: a dict that gets the parameters each step's forward starts from, by step."""
    import torch
    import torch.nn.functional as F

    import bagua_x.torch as bxt
    from bagua_x.core.comm import Feature

    g = torch.Generator().manual_seed(rank)
    xs = torch.randn(30, 16, 5, generator=g)
    ys = xs.sum(-1, keepdim=True).sin()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    from bagua_x.core.topology import StepTrial

    if seen is not None:
        def note(m, _):
            seen[len(seen)] = [p.detach().clone().numpy() for p in m.parameters()]

        model.register_forward_pre_hook(note)
    with _Records() as messages:
        wrapped = bxt.wrap(model, opt, algorithm=algorithm)
        if load is not None:
            saved = torch.load(load)
            wrapped.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            wrapped.load_algorithm_state_dict(saved["algorithm"])
        for i, s in enumerate(steps):
            opt.zero_grad()
            loss = F.mse_loss(wrapped(xs[s]), ys[s])
            if i >= StepTrial().steps:  # this run's trial (if any) was decided at this forward
                delays.clear()
            loss.backward()
            opt.step()
            if s + 1 == stop:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "algorithm": wrapped.algorithm_state_dict()}, save)
    two_level = Feature.HIERARCHICAL in wrapped.comm.features
    wrapped.shutdown()
    return two_level, list(messages), [p.detach().clone().numpy() for p in model.parameters()]


def measured(name: str, delays: dict, steps: int = 14):
    """``name`` (ByteGrad or LowPrecisionDecentralized) at hierarchical=None, slowed by ``delays`` while timed
    (the parameters each forward starts from in ``seen``); and the same training with each form forced."""
    import dataclasses

    import torch.distributed as dist

    from bagua_x import algorithms

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = getattr(algorithms, name)()
    slowed = dict(delays)
    seen = {}
    two_level, messages, params = _train_measured(_slowed(base, slowed), rank, range(steps), slowed, rank,
                                                  seen=seen)
    out = {"two_level": two_level, "messages": messages, "params": params, "seen": seen}
    for setting in (True, False):
        out[setting] = _train_measured(dataclasses.replace(base, hierarchical=setting), rank, range(steps), {}, rank)
    dist.destroy_process_group()
    return out


def cached(name: str, delays: dict, path: str, steps: int = 17):
    """Three jobs of ``name`` at hierarchical=None, the form cache set on rank 0 only: the first times the forms
    (slowed by ``delays``) and records its decision; the second, slowed alike, checks it in its first steps and
    keeps it; the third, every step 0.5 s slower in both forms (another link), times both forms again.  Each
    job's (over nodes?, log, the form of every reduce)."""
    import os

    import torch.distributed as dist

    from bagua_x import algorithms

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:
        os.environ["BAGUA_X_FORM_CACHE"] = path
    base = getattr(algorithms, name)()
    out = {}
    for job, extra in (("first", 0.0), ("second", 0.0), ("third", 0.5)):
        slowed = {(r, form): delays.get((r, form), 0.0) + extra for r in range(4) for form in (False, True)}
        forms = []
        two_level, messages, _ = _train_measured(_slowed(base, slowed, forms), rank, range(steps), slowed, rank)
        out[job] = (two_level, messages, forms)
    dist.destroy_process_group()
    return out


def measured_resume(name: str, first: dict, second: dict, total: int, k: int, path: str):
    """Uninterrupted and first part slowed by ``first``; a resumed run slowed by ``second`` (which would time
    the other form faster): it must keep the checkpoint's form and continue bitwise."""
    import os

    import torch.distributed as dist

    from bagua_x import algorithms

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = getattr(algorithms, name)()
    file = os.path.join(path, f"rank{rank}.pt")
    slowed = dict(first)  # the delays stay on through the trial: _train_measured clears them after it
    out = {"full": _train_measured(_slowed(base, slowed), rank, range(total), slowed, rank)}
    slowed = dict(first)
    _train_measured(_slowed(base, slowed), rank, range(k), slowed, rank, save=file, stop=k)
    slowed = dict(second)
    out["resumed"] = _train_measured(_slowed(base, slowed), rank, range(k, total), slowed, 100 + rank, load=file)
    dist.destroy_process_group()
    return out


def extra_forward(name: str, steps: int = 14):
    """``name`` (an algorithm, or "QAdam": its optimizer, warmup ending inside the trial) at hierarchical=None,
    rank 0 running an extra forward with grad on after each optimizer step (as when logging predictions);
    returns (over nodes?, the log, params)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import bagua_x.torch as bxt
    from bagua_x import algorithms
    from bagua_x.core.comm import Feature

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    xs = torch.randn(steps, 16, 5, generator=g)
    ys = xs.sum(-1, keepdim=True).sin()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if name == "QAdam":
        opt, algorithm = bxt.QAdamOptimizer(model.parameters(), lr=0.02, warmup_steps=5), None
    else:
        opt, algorithm = torch.optim.SGD(model.parameters(), lr=0.1), getattr(algorithms, name)()
    with _Records() as messages:
        wrapped = bxt.wrap(model, opt, algorithm=algorithm, timeout=5)
        for s in range(steps):
            opt.zero_grad()
            F.mse_loss(wrapped(xs[s]), ys[s]).backward()
            opt.step()
            if rank == 0:
                wrapped(xs[s])  # grad on, never backpropagated
    two_level = Feature.HIERARCHICAL in wrapped.comm.features
    wrapped.shutdown()
    dist.destroy_process_group()
    return two_level, list(messages), [p.detach().clone().numpy() for p in model.parameters()]
