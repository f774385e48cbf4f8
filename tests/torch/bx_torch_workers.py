"""Worker functions run on real gloo ranks by tests/launch.py (import name: ``bx_torch_workers``).

Named so that it shadows nothing: ``tests/torch`` must never become a package called ``torch``.
"""

from __future__ import annotations

import os

import numpy as np


def init(device="cpu"):
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def rank_data(rank, shape, dtype="float32", seed=0):
    """Deterministic per-rank data (the parent test recomputes it for the reference)."""
    rng = np.random.default_rng(seed * 1000 + rank)
    if dtype == "uint8":
        return rng.integers(0, 256, size=shape).astype(np.uint8)
    return rng.standard_normal(shape).astype(dtype)


# -- training against torch DDP --------------------------------------------------------------

def _models(scenario):
    import torch
    from torch import nn

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(12, 8)
            self.frozen = nn.Linear(8, 8)
            self.frozen.requires_grad_(False)
            self.hidden = nn.Linear(8, 8)
            self.out = nn.Linear(8, 12, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, x):
            return self.out(torch.relu(self.hidden(self.frozen(self.emb(x)))))

    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.unused = nn.Linear(16, 16)
            self.b = nn.Linear(16, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.b = nn.Linear(16, 4).to(torch.bfloat16)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)).to(torch.bfloat16)).float()

    if scenario == "tied_frozen":
        return Tied()
    if scenario == "unused":
        return Unused()
    if scenario == "mixed":
        return Mixed()
    if scenario == "bn":
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _batches(scenario, rank, steps, micro):
    import torch

    g = torch.Generator().manual_seed(1234 + rank)
    out = []
    for _ in range(steps * micro):
        if scenario == "tied_frozen":
            x = torch.randint(0, 12, (6,), generator=g)
            y = torch.randint(0, 12, (6,), generator=g)
        else:
            x = torch.randn(6, 8, generator=g)
            y = torch.randn(6, 4, generator=g)
        out.append((x, y))
    return out


def _loss(scenario, out, y):
    import torch.nn.functional as F

    return F.cross_entropy(out, y) if scenario == "tied_frozen" else F.mse_loss(out, y)


def _train(model, opt, scenario, data, grad_mode, micro, check_views=None):
    """One loop for both DDP and bagua_x; ``grad_mode`` says how gradients are reset between steps."""
    import torch

    views = []
    for step in range(len(data) // micro):
        if grad_mode == "none":
            opt.zero_grad(set_to_none=True)
        elif grad_mode == "zeros":
            opt.zero_grad(set_to_none=False)
        elif grad_mode == "user":
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        batch = data[step * micro:(step + 1) * micro]
        for k, (x, y) in enumerate(batch):
            ctx = model.no_sync() if k < micro - 1 else _nullcontext()
            with ctx:
                _loss(scenario, model(x), y).backward()
        if check_views is not None:
            views.append(check_views())
        opt.step()
    return views


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def grads_are_bucket_views(wrapped):
    """Every trainable p.grad lives inside its bucket's flat buffer at its slot (zero copy).

    Parameters that no rank used keep ``p.grad`` None, as with DDP.
    """
    for bucket in wrapped.buckets:
        base = bucket.buffer.data_ptr()
        size = bucket.buffer.element_size()
        for t, slot in zip(bucket.tensors, bucket.layout.slots):
            g = t.proxy.grad
            if g is None and "unused" in t.name:
                continue
            if g is None or g.data_ptr() != base + slot.offset * size or g.untyped_storage().data_ptr() != \
                    bucket.buffer.untyped_storage().data_ptr():
                return False
    return True


def train_vs_ddp(scenario, grad_mode="none", steps=4, micro=1, find_unused=False, device="cpu",
                 user_stream=False):
    """bagua_x and DDP trained side by side; ``user_stream`` (CUDA): both train on a stream of the user's,
    not the default one, so a collective not ordered after that stream's kernels reads stale buckets."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bagua_x.torch as bxt

    rank, _ = init(device)
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    torch.manual_seed(100 + rank)  # ranks start from DIFFERENT weights: wrap must broadcast rank 0's
    ours = _models(scenario).to(dev)
    torch.manual_seed(100 + rank)
    ref = _models(scenario).to(dev)
    data = [(x.to(dev), y.to(dev)) for x, y in _batches(scenario, rank, steps, micro)]

    wd = 0.01 if find_unused else 0.0  # weight decay tells a None grad (skipped) from a zero one
    opt = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9, weight_decay=wd)
    wrapped = bxt.wrap(ours, opt, find_unused_parameters=find_unused)
    if user_stream:
        torch.cuda.synchronize(dev)  # wrap's and DDP's broadcasts ran on the default stream
    with torch.cuda.stream(torch.cuda.Stream(dev)) if user_stream else _nullcontext():
        views = _train(wrapped, opt, scenario, data, grad_mode, micro, lambda: grads_are_bucket_views(wrapped))
    wrapped.shutdown()

    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=wd)
    ddp = DDP(ref, find_unused_parameters=find_unused)
    if user_stream:
        torch.cuda.synchronize(dev)
    with torch.cuda.stream(torch.cuda.Stream(dev)) if user_stream else _nullcontext():
        _train(ddp, ref_opt, scenario, data, grad_mode, micro)
    if user_stream:
        torch.cuda.synchronize(dev)  # the copies to the host below run on the default stream

    ours_state = {k: v.detach().float().cpu() for k, v in ours.state_dict().items()}
    ref_state = {k: v.detach().float().cpu() for k, v in ref.state_dict().items()}
    assert list(ours_state) == list(ref_state)
    diffs = {k: float((ours_state[k] - ref_state[k]).abs().max()) for k in ours_state}
    moved = float(max((ours_state[k] - v).abs().max() for k, v in
                      {k: v.float() for k, v in _initial_state(scenario, rank).items()}.items()))
    return {"diffs": diffs, "views": views, "moved": moved,
            "state": {k: v.numpy() for k, v in ours_state.items()}}


def _initial_state(scenario, rank):
    import torch

    torch.manual_seed(100)  # rank 0's initial weights, which wrap broadcasts
    return _models(scenario).state_dict()


# -- algorithms through TorchCommunicator, against the numpy references ----------------------

def algorithm_steps(name, kwargs, steps, numel, chained):
    """Call ``algorithm.reduce`` on per-rank tensors for several steps; return inputs, outputs, state.

    ``chained``: each step's input is the previous output plus a small local change
    (what an optimizer does between weight exchanges); else fresh data each step.
    ``sent`` lists ``(collective, dtype, numel)`` of every collective's input, in order.
    """
    import torch

    from bagua_x import algorithms
    from bagua_x.core.bucket import BucketLayout
    from bagua_x.torch import TorchCommunicator

    sent = []

    class RecordingCommunicator(TorchCommunicator):
        """The real gloo communicator, noting what each collective is given."""

        def __getattribute__(self, attr):
            value = super().__getattribute__(attr)
            if attr in ("allreduce", "allgather", "alltoall", "reduce_scatter", "broadcast", "permute"):
                def recorded(x, *args, **kw):
                    sent.append((attr, str(x.dtype).replace("torch.", ""), int(x.numel())))
                    return value(x, *args, **kw)
                return recorded
            return value

    rank, size = init()
    comm = RecordingCommunicator()
    alg = getattr(algorithms, name)(**kwargs)
    x = torch.from_numpy(rank_data(rank, (numel,), seed=0))
    layout = BucketLayout(["x"], [(numel,)], "float32")
    state = alg.init(x, layout, size)
    ins, outs = [], []
    for s in range(steps):
        change = torch.from_numpy(rank_data(rank, (numel,), seed=s + 1))
        x = x + 0.1 * change if chained else change
        ins.append(x.numpy().copy())
        x, state = alg.reduce(x, layout, state, comm)
        outs.append(x.numpy().copy())
    return {"initial": rank_data(rank, (numel,), seed=0), "ins": ins, "outs": outs,
            "state": {k: np.asarray(v) for k, v in state._asdict().items()}, "sent": sent}


# -- convergence through wrap() ----------------------------------------------------------------

def converge(name, kwargs, steps=60):
    """Train a small regression through wrap(algorithm=...) on per-rank data; return losses and weights."""
    import time

    import torch
    import torch.nn.functional as F

    from bagua_x import algorithms
    import bagua_x.torch as bxt

    rank, size = init()
    torch.manual_seed(7 + rank)
    true_w = torch.linspace(-1, 1, 16).reshape(1, 16)
    g = torch.Generator().manual_seed(rank)
    xs = torch.randn(steps, 32, 16, generator=g) + rank  # ranks see differently distributed data
    ys = xs @ true_w.T
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    wrapped = bxt.wrap(model, opt, algorithm=getattr(algorithms, name)(**kwargs))
    first = rounds_at_abort = None
    for s in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(wrapped(xs[s]), ys[s])
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
        if name == "AsyncModelAverage":
            time.sleep(0.005)  # give the background averaging a chance to run a few rounds
            if s == steps // 2:  # abort and resume mid-training (collective: every rank calls both)
                wrapped.abort()
                rounds_at_abort = wrapped._engine.rounds
                wrapped.resume()
    rounds = None
    if name == "AsyncModelAverage":
        wrapped.abort()
        rounds = wrapped._engine.rounds
    wrapped.shutdown()
    with torch.no_grad():
        test_x = torch.randn(256, 16, generator=torch.Generator().manual_seed(99)) + 0.5
        final = F.mse_loss(model(test_x), test_x @ true_w.T).item()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    return {"first": first, "final": final, "weights": flat, "rounds": rounds, "rounds_at_abort": rounds_at_abort}


# -- API surface and errors ---------------------------------------------------------------------

def weight_phase_semantics(name, steps=3):
    """Weight algorithms through wrap() against a hand-written torch.distributed loop.

    Decentralized (before forward): x <- avg(x_t) - lr * grad f_local(x_t).
    ModelAverage (after step):      x <- avg(x_t - lr * grad f_local(x_t)).
    """
    import torch
    import torch.distributed as dist

    from bagua_x import algorithms
    import bagua_x.torch as bxt

    rank, size = init()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    ref = torch.nn.Linear(6, 3)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = bxt.wrap(model, opt, algorithm=getattr(algorithms, name)())
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(steps)]

    def average(params):
        for p in params:
            dist.all_reduce(p.data)
            p.data /= size

    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        opt.step()

        ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        with torch.no_grad():
            if name == "Decentralized":
                average(ref.parameters())
            for p in ref.parameters():
                p -= 0.1 * p.grad
            if name == "ModelAverage":
                average(ref.parameters())
    wrapped.shutdown()
    return max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref.parameters()))


def kernels_agree(broken_rank):
    """wrap(ByteGrad) on a model of >= 1M parameters with the C++ compiler broken on ``broken_rank`` (-1: none):
    whether the ranks kept compiled kernels, the warnings they gave, and one step's weights."""
    import warnings

    import torch

    import bagua_x.torch as bxt
    from bagua_x.algorithms import ByteGrad
    from bagua_x.algorithms.kernels import _COMPILERS
    from bagua_x.torch import kernels

    rank, _ = init()
    if rank == broken_rank:
        import torch._inductor.config as inductor

        inductor.cpp.cxx = ("/nonexistent/c++",)  # a node without a C++ toolchain
        inductor.force_disable_caches = True  # and nothing compiled earlier on disk
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dp = bxt.wrap(model, algorithm=ByteGrad(), bucket_cap_mb=100)
        torch.manual_seed(rank)
        dp(torch.randn(4, 1024)).square().sum().backward()
    return {"compiling": kernels.NAMESPACE in _COMPILERS, "failure": kernels._failure,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
            "grad": model.weight.grad.numpy().copy()}


def async_average_stream_order(steps=30):
    """AsyncModelAverage with the stream functions traced: the stream operations each thread asked for."""
    import time

    import torch

    import bagua_x.torch as bxt
    from bagua_x.algorithms import AsyncModelAverage
    from stream_trace import start_tracing, stop_tracing

    rank, _ = init()
    trace = start_tracing()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    wrapped = bxt.wrap(model, opt, algorithm=AsyncModelAverage(sync_interval_ms=2, warmup_steps=2))
    for _ in range(steps):
        opt.zero_grad()
        wrapped(torch.randn(8, 16)).square().sum().backward()
        opt.step()
        time.sleep(0.004)
    wrapped.abort()
    stop_tracing()
    return {"trace": trace, "rounds": wrapped._engine.rounds}


def async_average_state_dict(hold=0.5):
    """AsyncModelAverage averaging: ``state_dict()`` called on another thread while this one holds the weight
    lock (as the averaging thread does for a whole round) must wait for it, and return copies, not the live
    weights the thread goes on writing; ``weights_locked()`` is that lock, the stream events included."""
    import threading
    import time

    import torch

    import bagua_x.torch as bxt
    from bagua_x.algorithms import AsyncModelAverage
    from stream_trace import start_tracing, stop_tracing

    init()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    wrapped = bxt.wrap(model, opt, algorithm=AsyncModelAverage(sync_interval_ms=20, warmup_steps=1))
    opt.zero_grad()
    wrapped(torch.randn(8, 16)).square().sum().backward()
    opt.step()  # the averaging thread starts
    engine, got = wrapped._engine, {}
    reader = threading.Thread(target=lambda: got.update(wrapped.state_dict()))
    with engine._lock:
        reader.start()
        time.sleep(hold)
        waited = reader.is_alive()
    reader.join(10)
    live = {n: p.data_ptr() for n, p in model.state_dict().items()}
    trace = start_tracing()
    with wrapped.weights_locked():
        locked = engine._lock.locked()
    stop_tracing()
    wrapped.abort()
    return {"waited": waited, "returned": not reader.is_alive(), "keys": sorted(got) == sorted(live),
            "copies": all(v.data_ptr() != live[n] for n, v in got.items()), "locked": locked,
            "trace": [op for op, stream in trace if stream == "current"]}
