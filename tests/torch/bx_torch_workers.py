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


def communicator_ops():
    import torch

    from bagua_x.core import ReduceOp
    from bagua_x.torch import TorchCommunicator

    rank, size = init()
    comm = TorchCommunicator()
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    x = t(rank_data(rank, (size, 6)))
    x_keep = x.clone()
    u = t(rank_data(rank, (size, 5), "uint8"))
    out = {"rank": comm.rank, "size": comm.size}
    for op in ReduceOp:
        out[f"allreduce_{op.value}"] = comm.allreduce(x, op).numpy()
        out[f"reduce_scatter_{op.value}"] = comm.reduce_scatter(x, op).numpy()
    out["allreduce_int_avg"] = comm.allreduce(torch.tensor([rank * 3 + 1], dtype=torch.int64), ReduceOp.AVG).numpy()
    out["allgather"] = comm.allgather(x).numpy()
    out["allgather_u8"] = comm.allgather(u).numpy()
    out["alltoall"] = comm.alltoall(x).numpy()
    out["alltoall_u8"] = comm.alltoall(u).numpy()
    out["broadcast"] = comm.broadcast(x, root=1).numpy()
    ring = [(i, (i + 1) % size) for i in range(size)]
    out["permute_ring"] = comm.permute(x, ring).numpy()
    out["permute_ring_u8"] = comm.permute(u, ring).numpy()
    out["permute_self"] = comm.permute(x, [(i, i) for i in range(size)]).numpy()
    out["permute_partial"] = comm.permute(x, [(0, 1)]).numpy()
    out["switch"] = comm.switch(torch.tensor(1), [lambda v: v * 0, lambda v: v + 1], torch.ones(2)).numpy()
    out["input_untouched"] = bool(torch.equal(x, x_keep))
    with comm.donate(x):
        y = comm.allreduce(x, ReduceOp.SUM)
    out["donated_in_place"] = y is x
    try:
        comm.alltoall(torch.zeros(size + 1, 2))
    except Exception as e:  # noqa: BLE001
        out["bad_rows"] = f"{type(e).__name__}: {e}"
    bf = comm.allreduce(torch.full((3,), float(rank + 1), dtype=torch.bfloat16), ReduceOp.AVG)
    out["bf16_avg"] = (str(bf.dtype), bf.float().numpy())
    return out


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
            "state": {k: np.asarray(v) for k, v in state.items()}, "sent": sent}


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

def mismatch_error():
    """Rank 1 builds a wider first layer: wrap must fail on EVERY rank with the same clear message."""
    import torch

    import bagua_x.torch as bxt

    rank, _ = init()
    width = 16 if rank == 0 else 17
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    bxt.wrap(model)


def algorithm_mismatch_error():
    import torch

    from bagua_x.algorithms import ByteGrad, GradientAllReduce
    import bagua_x.torch as bxt

    rank, _ = init()
    bxt.wrap(torch.nn.Linear(4, 4), algorithm=GradientAllReduce() if rank == 0 else ByteGrad())


def api_checks():
    """state_dict round trips, algorithm state, error surfacing, missing optimizer."""
    import torch
    import torch.nn.functional as F

    from bagua_x.algorithms import Algorithm, Decentralized, LowPrecisionDecentralized
    from bagua_x.core import BaguaXError
    import bagua_x.torch as bxt

    rank, _ = init()
    out = {}
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    bare_keys = list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = bxt.wrap(model, opt)
    out["same_keys"] = list(wrapped.state_dict()) == bare_keys
    F.mse_loss(wrapped(torch.randn(5, 4)), torch.randn(5, 2)).backward()
    opt.step()
    saved = {k: v.clone() for k, v in wrapped.state_dict().items()}
    torch.manual_seed(50)
    bare = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    bare.load_state_dict(wrapped.state_dict())  # wrapped -> bare
    out["wrapped_to_bare"] = all(torch.equal(bare.state_dict()[k], v) for k, v in saved.items())
    with torch.no_grad():
        for p in bare.parameters():
            p.add_(1.0)
    wrapped.load_state_dict(bare.state_dict())  # bare -> wrapped
    out["bare_to_wrapped"] = all(torch.equal(model.state_dict()[k], v) for k, v in bare.state_dict().items())
    out["module"] = wrapped.module is model
    wrapped.shutdown()

    # a parameter unused in forward without find_unused_parameters: a clear error, same on both ranks
    class Partial(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    w = bxt.wrap(Partial(), bucket_cap_mb=1e-5)  # tiny buckets: the unused layer gets its own
    try:
        w(torch.randn(2, 4)).sum().backward()
        out["unused_error"] = None
    except BaguaXError as e:
        out["unused_error"] = str(e)
    w.shutdown()

    # an algorithm failing on the communication thread surfaces in backward() on the main thread
    class Broken(Algorithm):
        def reduce(self, flat, layout, state, comm):
            raise ValueError("boom")

    w = bxt.wrap(torch.nn.Linear(4, 4), algorithm=Broken())
    try:
        w(torch.randn(2, 4)).sum().backward()
        out["worker_error"] = None
    except BaguaXError as e:
        out["worker_error"] = str(e)
    w.shutdown()

    # after-step weight algorithms need the optimizer
    try:
        bxt.wrap(torch.nn.Linear(4, 4), algorithm=LowPrecisionDecentralized())
        out["no_optimizer_error"] = None
    except BaguaXError as e:
        out["no_optimizer_error"] = str(e)

    # algorithm state: separate from the model state_dict, round trips
    m = torch.nn.Linear(4, 4)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    w = bxt.wrap(m, o, algorithm=LowPrecisionDecentralized())
    for _ in range(2):
        o.zero_grad()
        w(torch.randn(3, 4)).sum().backward()
        o.step()
    st = w.algorithm_state_dict()
    out["algo_state_keys"] = {b: sorted(s) for b, s in st.items()}
    out["algo_step"] = int(next(iter(st.values()))["step"])
    o.zero_grad()
    w(torch.randn(3, 4)).sum().backward()
    o.step()
    w.load_algorithm_state_dict(st)
    out["algo_step_restored"] = int(next(iter(w.algorithm_state_dict().values()))["step"])
    try:
        w.load_algorithm_state_dict({"nope": {}})
    except BaguaXError as e:
        out["bad_algo_state"] = str(e)
    w.shutdown()

    # Decentralized: forward without backward (evaluation) leaves nothing in flight
    m = torch.nn.Linear(4, 4)
    w = bxt.wrap(m, algorithm=Decentralized())
    with torch.no_grad():
        w(torch.randn(2, 4))
    w(torch.randn(2, 4)).sum().backward()
    out["decentralized_equal"] = _all_equal(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    w.shutdown()
    return out


def _all_equal(t):
    import torch
    import torch.distributed as dist

    lo, hi = t.clone(), t.clone()
    dist.all_reduce(lo, dist.ReduceOp.MIN)
    dist.all_reduce(hi, dist.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))


def bagua_api():
    """Bagua's tensor methods drive core buckets: registration, closures, storage swap, readiness."""
    import torch

    from bagua_x.core import Bucket, BucketDispatcher
    import bagua_x.torch as bxt
    from bagua_x.torch import TorchCommunicator

    rank, _ = init()
    out = {"installed_before": hasattr(torch.Tensor, "ensure_bagua_tensor")}
    bxt.enable_bagua_api()
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    params = [p.ensure_bagua_tensor(n, "model", getter_closure=lambda p: p.grad,
                                    setter_closure=lambda p, t: setattr(p, "grad", t))
              for n, p in model.named_parameters()]
    out["returns_self"] = all(a is b for a, b in zip(params, model.parameters()))
    out["ensure_grad_self"] = all(p.bagua_ensure_grad() is p for p in params)
    out["getter"] = all(p.bagua_getter_closure() is p.grad for p in params)
    new = torch.ones_like(params[0])
    params[0].bagua_setter_closure(new)
    out["setter"] = params[0].grad is new
    storage = torch.zeros(params[0].numel() + 5)
    params[0].bagua_set_registered_storage(storage, 5)
    out["storage_view"] = (params[0].grad.data_ptr() == storage[5:].data_ptr()
                           and float(storage[5:].sum()) == new.numel())
    bucket = Bucket("b0", [p.bagua_registered_tensor() for p in params])
    bucket.flatten()
    comm = TorchCommunicator()
    done = []
    BucketDispatcher([bucket], lambda b: done.append(comm.allreduce(b.buffer)))
    model(torch.randn(5, 3) + rank).sum().backward()
    for p in params:
        p.bagua_mark_communication_ready()
    out["dispatched"] = len(done) == 1
    out["summed_equal"] = _all_equal(done[0])
    out["names"] = [p.bagua_registered_tensor().name for p in params]
    return out


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


def self_init():
    """wrap() initialises torch.distributed itself from torchrun-style variables."""
    import torch
    import torch.distributed as dist

    import bagua_x.torch as bxt

    assert not dist.is_initialized()
    wrapped = bxt.wrap(torch.nn.Linear(2, 2))
    wrapped(torch.ones(1, 2)).sum().backward()
    return dist.get_backend(), dist.get_world_size()


def buffer_broadcast_during_exchange():
    """Two grad-enabled forwards with no backward between them, Decentralized, a BatchNorm model.

    Rank 1's exchange starts late (a sleep inside the algorithm), so without ordering its second
    forward would put the buffer broadcast on the process group before that exchange: the two ranks
    would then issue the two collectives in opposite orders.  Returns the weights and buffers.
    """
    import dataclasses
    import time

    import torch

    import bagua_x.torch as bxt
    from bagua_x.algorithms import Decentralized

    @dataclasses.dataclass(frozen=True)
    class SlowOnRankOne(Decentralized):
        def reduce(self, flat, layout, state, comm):
            if comm.rank == 1:
                time.sleep(1.0)
            return super().reduce(flat, layout, state, comm)

    rank, _ = init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.BatchNorm1d(64))
    wrapped = bxt.wrap(model, algorithm=SlowOnRankOne(), timeout=20)
    with torch.no_grad():  # rank-dependent weights and buffers, so the exchange and the broadcast both matter
        for p in model.parameters():
            p.add_(float(rank))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))  # the same on both ranks
    wrapped(x)  # launches the exchange of the weights taken now
    wrapped(x)  # finishes it; the buffers follow rank 0
    wrapped.shutdown()
    return {"params": [p.detach().numpy().copy() for p in model.parameters()],
            "buffers": [b.detach().numpy().copy() for b in model.buffers()]}


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
    """AsyncModelAverage with bagua_x.torch.streams.TRACE on: the stream operations each thread asked for."""
    import time

    import torch

    import bagua_x.torch as bxt
    from bagua_x.algorithms import AsyncModelAverage
    from bagua_x.torch import streams

    rank, _ = init()
    streams.TRACE = []
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
    trace, streams.TRACE = streams.TRACE, None
    return {"trace": trace, "rounds": wrapped._engine.rounds}


def wrap_initialises_with_its_timeout():
    """wrap() on a process without torch.distributed: the group it makes has wrap's timeout as its own."""
    import torch
    import torch.distributed as dist

    import bagua_x.torch as bxt
    from bagua_x.torch.store import resolve_timeout

    assert not dist.is_initialized()
    bxt.wrap(torch.nn.Linear(4, 2), timeout=7.5)
    return resolve_timeout(None, None)
