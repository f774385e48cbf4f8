"""Worker functions for the stream-order and device-deadline tests (import name ``bx_stream_workers``).

Each trains a few steps on a real gloo rank with the stream functions traced (``stream_trace``) and returns the
stream operations asked for, in order (the stream layer does nothing else on the CPU).
"""

from __future__ import annotations

import time


def _init():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank()


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def stream_order(kind, steps=3):
    """``kind``: "grad" (GradientAllReduce), "decentralized", "model_average", "qadam" (warmup 1) or "hook"
    (a DDP comm hook); buckets of 2 KiB so there are several."""
    import torch

    import bagua_x.torch as bxt
    from bagua_x import algorithms
    from stream_trace import start_tracing, stop_tracing

    rank = _init()
    trace = start_tracing()
    model = _model()
    if kind == "hook":
        state = bxt.CommHookState(algorithms.GradientAllReduce())
        wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)
        wrapped.register_comm_hook(state, bxt.comm_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    elif kind == "qadam":
        opt = bxt.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=1)
        wrapped = bxt.wrap(model, opt, bucket_cap_mb=0.002)
    else:
        algorithm = {"grad": algorithms.GradientAllReduce(), "decentralized": algorithms.Decentralized(),
                     "model_average": algorithms.ModelAverage()}[kind]
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        wrapped = bxt.wrap(model, opt, algorithm=algorithm, bucket_cap_mb=0.002)
    torch.manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        wrapped(torch.randn(8, 16)).square().sum().backward()
        opt.step()
    if kind == "hook":
        state.close()  # its thread may still be recording the last completion event after DDP has the result
    stop_tracing()
    return {"trace": trace, "buckets": len(wrapped._engine.buckets) if kind != "hook" else None}


class NeverDone:
    """A CUDA event whose work never finishes: what a collective stuck on the device looks like."""

    def query(self):
        return False


def device_deadline(timeout=3.0, seconds=12.0):
    """GradientAllReduce whose completion events never finish (the stream layer's ``record`` patched): the
    collective returns at once as on NCCL.  One training step, then only forwards (evaluation: no job is
    submitted any more), so the BaguaXError can only come from the communication thread polling while idle,
    raised by the next forward's settle."""
    import torch

    import bagua_x.torch as bxt
    from bagua_x.torch import streams

    rank = _init()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    wrapped = bxt.wrap(model, opt, timeout=timeout)
    streams.record = lambda stream: NeverDone()
    start = time.monotonic()
    try:
        wrapped(torch.randn(8, 16)).square().sum().backward()
        opt.step()
        with torch.no_grad():
            while time.monotonic() - start < seconds:
                wrapped(torch.randn(8, 16))
                time.sleep(0.05)
    except Exception as e:  # noqa: BLE001 -- the test checks type and message
        elapsed = time.monotonic() - start
        if rank == 0:  # rank 0 hosts the store: stay until rank 1 has its report too
            time.sleep(4)
        return {"type": type(e).__name__, "message": str(e), "seconds": elapsed}
    return {"type": None, "seconds": time.monotonic() - start}


def run_ahead(timeout=3.0):
    """Two training steps behind a collective that never finishes on the device (events patched as in
    ``device_deadline``), then nothing: the second backward must not return while the first step's
    communication is unfinished, but raise the report once its deadline passes."""
    import torch

    import bagua_x.torch as bxt
    from bagua_x.torch import streams

    rank = _init()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    wrapped = bxt.wrap(model, opt, timeout=timeout)
    wrapped(torch.randn(8, 16)).square().sum().backward()  # the first step (bucket rebuild) completes
    opt.step()
    streams.record = streams.mark = lambda stream: NeverDone()
    start = time.monotonic()
    steps = []
    try:
        for step in range(2):
            opt.zero_grad()
            wrapped(torch.randn(8, 16)).square().sum().backward()
            opt.step()
            steps.append(time.monotonic() - start)
    except Exception as e:  # noqa: BLE001 -- the test checks type and message
        elapsed = time.monotonic() - start
        if rank == 0:
            time.sleep(4)
        return {"type": type(e).__name__, "message": str(e), "seconds": elapsed, "steps": steps}
    return {"type": None, "seconds": time.monotonic() - start, "steps": steps}


def hook_deadline(timeout=3.0):
    """A DDP comm hook whose completion events never finish (as ``device_deadline``): one step, a wait past
    the deadline (the hook's thread polls the event while idle), then the next backward, which raises the
    report through its buckets' futures."""
    import torch

    import bagua_x.torch as bxt
    from bagua_x import algorithms
    from bagua_x.torch import streams

    rank = _init()
    model = _model()
    state = bxt.CommHookState(algorithms.GradientAllReduce(), timeout=timeout)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(state, bxt.comm_hook)
    streams.record = lambda stream: NeverDone()
    ddp(torch.randn(8, 16)).square().sum().backward()
    start = time.monotonic()
    time.sleep(timeout + 1)
    try:
        ddp(torch.randn(8, 16)).square().sum().backward()
    except Exception as e:  # noqa: BLE001 -- the test checks the message (DDP may wrap the hook's error)
        if rank == 0:  # rank 0 hosts the store: stay until rank 1 has its report too
            time.sleep(4)
        return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"type": None, "seconds": time.monotonic() - start}


def _recording_keep_for():
    """Patch ``streams.keep_for`` to also list ``(tensor, stream name)``; returns the list."""
    from bagua_x.torch import streams

    kept, keep_for = [], streams.keep_for
    streams.keep_for = lambda tensor, stream: (kept.append((tensor, stream.name)), keep_for(tensor, stream))[1]
    return kept


def _all_kept(tensors, kept, side):
    """Whether every tensor of ``tensors`` (the very object) was marked for the stream named ``side``."""
    return all(any(t is k and name == side for k, name in kept) for t in tensors)


def _state_tensors(states):
    import torch

    return [v for state in states for v in state if isinstance(v, torch.Tensor)]


def state_streams():
    """Algorithm state made or loaded on the training thread and read on a communication stream is marked for
    that stream: PowerSGD's (gradient engine: at set-up and after a load), LowPrecisionDecentralized's (weight
    engine: at set-up and after a restart), and PowerSGD's through the DDP comm hook after a load."""
    import torch

    import bagua_x.torch as bxt
    from bagua_x import algorithms

    rank = _init()
    kept = _recording_keep_for()
    out = {}

    def train(model, opt, steps=2):
        torch.manual_seed(rank)
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 16)).square().sum().backward()
            opt.step()

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    wrapped = bxt.wrap(model, opt, algorithm=algorithms.PowerSGD(start_powerSGD_iter=1), bucket_cap_mb=0.002)
    states = lambda w: _state_tensors(s.state for s in w._engine.slots)  # noqa: E731
    out["powersgd init"] = (len(states(wrapped)), _all_kept(states(wrapped), kept, "bagua_x-grad-comm"))
    train(wrapped, opt)
    wrapped.load_algorithm_state_dict(wrapped.algorithm_state_dict())
    out["powersgd load"] = (len(states(wrapped)), _all_kept(states(wrapped), kept, "bagua_x-grad-comm"))
    wrapped.shutdown()

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    wrapped = bxt.wrap(model, opt, algorithm=algorithms.LowPrecisionDecentralized(), bucket_cap_mb=0.002)
    out["low precision init"] = (len(states(wrapped)), _all_kept(states(wrapped), kept, "bagua_x-weight-comm"))
    train(wrapped, opt)
    wrapped._engine.restart_state()
    out["low precision restart"] = (len(states(wrapped)), _all_kept(states(wrapped), kept, "bagua_x-weight-comm"))
    wrapped.shutdown()

    saved = None
    for load in (False, True):
        model = _model()
        state = bxt.CommHookState(algorithms.PowerSGD(start_powerSGD_iter=1))
        if load:
            state.load_algorithm_state_dict(saved)
            loaded = _state_tensors(tuple(piece.values()) for piece in state._loose.values())
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(state, bxt.comm_hook)
        train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01))
        saved = state.algorithm_state_dict()
        state.close()
    out["hook load"] = (len(loaded), _all_kept(loaded, kept, "bagua_x-comm-hook"))
    return out


def hook_run_ahead(timeout=3.0, steps=3):
    """A DDP comm hook behind collectives that never finish on the device (events patched as in ``run_ahead``)
    after one good step: the host may run one step ahead, then a backward must raise the report at the
    deadline instead of returning."""
    import torch

    import bagua_x.torch as bxt
    from bagua_x import algorithms
    from bagua_x.torch import streams

    rank = _init()
    state = bxt.CommHookState(algorithms.GradientAllReduce(), timeout=timeout)
    ddp = torch.nn.parallel.DistributedDataParallel(_model())
    ddp.register_comm_hook(state, bxt.comm_hook)
    ddp(torch.randn(8, 16)).square().sum().backward()
    streams.record = streams.mark = lambda stream: NeverDone()
    start = time.monotonic()
    done = []
    try:
        for _ in range(steps):
            ddp(torch.randn(8, 16)).square().sum().backward()
            done.append(time.monotonic() - start)
    except Exception as e:  # noqa: BLE001 -- the test checks type and message
        elapsed = time.monotonic() - start
        if rank == 0:  # rank 0 hosts the store: stay until rank 1 has its report too
            time.sleep(4)
        return {"type": type(e).__name__, "message": str(e), "seconds": elapsed, "steps": done}
    return {"type": None, "seconds": time.monotonic() - start, "steps": done}


def hook_dead_peer(timeout=2.0):
    """Rank 1 stops taking part after two steps (alive, in no collective); rank 0 trains on with the DDP comm
    hook on several buckets: its next backward fails after one timeout (not one per bucket), and the one
    after raises the BaguaXError at once."""
    import torch

    import bagua_x.torch as bxt
    from bagua_x import algorithms

    rank = _init()
    state = bxt.CommHookState(algorithms.GradientAllReduce(), timeout=timeout)
    ddp = torch.nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.002)
    ddp.register_comm_hook(state, bxt.comm_hook)
    for _ in range(2):  # DDP rebuilds its buckets at the second forward, with a collective of its own
        ddp(torch.randn(8, 16)).square().sum().backward()
    if rank == 1:
        time.sleep(6 * timeout + 6)
        return {"rank": 1}
    out = {"buckets": len(state.buckets), "steps": []}
    for _ in range(2):
        start = time.monotonic()
        try:
            ddp(torch.randn(8, 16)).square().sum().backward()
            out["steps"].append({"type": None, "seconds": time.monotonic() - start})
        except Exception as e:  # noqa: BLE001 -- the test checks type and message
            out["steps"].append({"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start})
    return out
