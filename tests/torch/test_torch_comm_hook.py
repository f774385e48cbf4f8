"""bagua_x's gradient algorithms as a DDP comm hook: same numbers as wrap(), compressed bytes really sent.  The
trainings run on 2 gloo ranks, each test's body on every rank (tests/multirank.py)."""

import io

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import bagua_x.algorithms as algorithms
import bagua_x.torch as bxt
from bagua_x.algorithms import ByteGrad, GradientAllReduce, PowerSGD
from bagua_x.core import BaguaXError
from multirank import multirank


def assert_same_steps(a, b, atol=0.0):
    assert len(a) == len(b) > 0
    for step_a, step_b in zip(a, b):
        assert len(step_a) == len(step_b) > 0
        for x, y in zip(step_a, step_b):
            if atol:
                np.testing.assert_allclose(x, y, rtol=0, atol=atol)
            else:
                np.testing.assert_array_equal(x, y)


def assert_same_on_every_rank(steps):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, steps)
    assert_same_steps(out[0], out[1])


def tied(odd: bool):
    """One weight matrix used twice: DDP's first bucket lists parameters in model order and its
    rebuilt ones in gradient order, wrap always in gradient order; with one parameter both
    layouts are the same, so ByteGrad's chunks are too.  ``odd``: an odd element count, so
    ByteGrad pads the bucket for 2 ranks."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(7, 9 if odd else 10) * 0.3)

        def forward(self, x):
            return torch.tanh(x[:, :7] @ self.w) @ self.w.T

    torch.manual_seed(0)
    return Tied()


def batches(steps):
    """This rank's batches (different on each rank)."""
    g = torch.Generator().manual_seed(77 + dist.get_rank())
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)) for _ in range(steps)]


def recording(comm, calls):
    """Wrap ``comm``'s collectives so each call records (collective, dtype, numel) of what it is given."""
    for name in ("allreduce", "alltoall", "allgather"):
        original = getattr(comm, name)

        def record(x, *args, _name=name, _original=original, **kwargs):
            calls.append((_name, str(x.dtype).replace("torch.", ""), int(x.numel())))
            return _original(x, *args, **kwargs)

        setattr(comm, name, record)


def train(model, opt, batches):
    """The parameters after each step."""
    out = []
    for x, y in batches:
        opt.zero_grad()
        pred = model(x)
        F.mse_loss(pred, y[:, :pred.shape[1]]).backward()
        opt.step()
        out.append([p.detach().numpy().copy() for p in model.parameters()])
    return out


def hook_vs_wrap(make, odd=False, steps=4):
    """The same algorithm as DDP comm hook and through wrap(), one bucket each; the hook's collectives recorded."""
    data = batches(steps)
    hooked = DDP(tied(odd), bucket_cap_mb=1000)
    state = bxt.CommHookState(make())
    calls = []
    recording(state.comm, calls)
    hooked.register_comm_hook(state, bxt.comm_hook)
    hook_params = train(hooked, torch.optim.SGD(hooked.parameters(), lr=0.1), data)
    ddp_buckets = len(hooked._get_ddp_logging_data().get("bucket_sizes", "").split(", "))
    numel = sum(p.numel() for p in hooked.parameters())
    state.close()

    wrapped = bxt.wrap(tied(odd), algorithm=make(), bucket_cap_mb=1000)
    wrap_params = train(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1), data)
    wrapped.shutdown()
    return {"hook": hook_params, "wrap": wrap_params, "calls": calls, "numel": numel,
            "ddp_buckets": ddp_buckets, "wrap_buckets": len(wrapped.buckets)}


@pytest.mark.parametrize("odd", [False, True], ids=["even", "padded"])
@multirank(nproc=2)
def test_bytegrad_hook_equals_wrap_and_sends_uint8(odd):
    r = hook_vs_wrap(ByteGrad, odd)
    assert r["ddp_buckets"] == r["wrap_buckets"] == 1
    assert_same_steps(r["hook"], r["wrap"])  # bitwise: same bucket, same algorithm
    padded = r["numel"] + r["numel"] % 2
    assert (r["numel"] % 2 == 1) == odd
    # per step: alltoall of 2 uint8 rows (a chunk + its 8-byte min/max header each), allgather of one row
    assert r["calls"] == [("alltoall", "uint8", padded + 16), ("allgather", "uint8", padded // 2 + 8)] * 4
    assert_same_on_every_rank(r["hook"])  # every rank ends identical


@multirank(nproc=2)
def test_allreduce_hook_equals_wrap():
    r = hook_vs_wrap(GradientAllReduce)
    assert_same_steps(r["hook"], r["wrap"])
    assert r["calls"] == [("allreduce", "float32", r["numel"])] * 4


@multirank(nproc=2)
def test_powersgd_hook_equals_wrap_and_sends_the_factors():
    """PowerSGD through the hook: the DDP bucket's layout (one 7 x 10 matrix) reaches the algorithm."""
    r = hook_vs_wrap(lambda: PowerSGD(start_powerSGD_iter=1))
    assert_same_steps(r["hook"], r["wrap"])  # bitwise: same bucket, same seeded Q
    # one plain step, then per step the rank-1 factors: P (7 x 1) summed, Q (10 x 1) averaged
    assert r["calls"] == [("allreduce", "float32", 70)] + [("allreduce", "float32", 7),
                                                            ("allreduce", "float32", 10)] * 3, r["calls"]


@multirank(nproc=2)
def test_powersgd_resumes_bitwise_through_the_hook():
    """Train 4 steps (compressed from step 2, error feedback live), save model, optimizer and hook state, train
    4 more; against loading the save into a fresh DDP + hook for the same 4 steps.  The fresh DDP runs its first
    step on one bucket in parameter order and then regroups into two in gradient order, so the state must follow
    each parameter, and each matrix must compute the same wherever it sits in a bucket."""
    k, m, start, cap_mb = 4, 4, 2, 0.005
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5 + dist.get_rank())
    data = [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(k + m)]

    def build(saved=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 40),
                                    torch.nn.ReLU(), torch.nn.Linear(40, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        state = bxt.CommHookState(PowerSGD(start_powerSGD_iter=start))
        if saved is not None:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            state.load_algorithm_state_dict(saved["hook"])
        ddp = DDP(model, bucket_cap_mb=cap_mb)
        ddp.register_comm_hook(state, bxt.comm_hook)
        return ddp, opt, state

    def run(ddp, opt, state, steps, seen=None):
        params = []
        for x, y in steps:
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            params.append([p.detach().numpy().copy() for p in ddp.parameters()])
            if seen is not None:
                seen.append(sorted(state.buckets))
        return params

    ddp, opt, state = build()
    run(ddp, opt, state, data[:k])
    buf = io.BytesIO()
    hook_state = state.algorithm_state_dict()
    torch.save({"model": ddp.module.state_dict(), "optimizer": opt.state_dict(), "hook": hook_state}, buf)
    continued = run(ddp, opt, state, data[k:])
    state.close()
    buf.seek(0)
    ddp, opt, state = build(torch.load(buf, weights_only=True))
    seen = []
    resumed = run(ddp, opt, state, data[k:], seen)
    state.close()

    pieces = hook_state["parameters"]
    assert seen == [[0], [0, 1], [0, 1], [0, 1]]  # one bucket, then DDP's regrouping into two
    assert sorted(pieces) == list(range(6))  # every parameter
    assert sorted({int(p["step"]) for p in pieces.values()}) == [4]  # 4 steps each
    assert max(float(p["error"].abs().max()) for p in pieces.values()) > 1e-3  # error feedback to carry over
    assert_same_steps(resumed, continued)  # bitwise
    assert_same_on_every_rank(resumed)


@multirank(nproc=2, timeout=60)
def test_hook_refuses_a_state_saved_for_another_model():
    """A hook state saved for one model loaded for another: the error says so, on every rank, from backward;
    a dict that is no hook state is refused at load."""
    state = bxt.CommHookState(PowerSGD(start_powerSGD_iter=0))
    with pytest.raises(BaguaXError, match="do not load it") as caught:
        state.load_algorithm_state_dict({0: {"numel": 3, "state": {}}})
    assert "not a CommHookState.algorithm_state_dict() (keys [0]" in str(caught.value)
    piece = {"step": torch.zeros((), dtype=torch.int32), "q": torch.zeros(7), "error": torch.zeros(70)}
    state.load_algorithm_state_dict({"parameters": {0: piece}})  # a 7 x 10 matrix's; this one is 8 x 10
    ddp = DDP(torch.nn.Linear(10, 8, bias=False))
    ddp.register_comm_hook(state, bxt.comm_hook)
    with pytest.raises(RuntimeError, match="load it into the same ones, or do not load the hook state") as caught:
        ddp(torch.randn(2, 10)).sum().backward()
    assert ("the loaded state of parameter 0 has shapes {'step': (), 'q': (7,), 'error': (70,)}, but this DDP "
            "model and PowerSGD's settings need {'step': (), 'q': (10,), 'error': (80,)}") in str(caught.value)
    state.close()


@multirank(nproc=2)
def test_hook_on_many_buckets_equals_ddp():
    """GradientAllReduce as a hook on many small DDP buckets, against DDP's own allreduce."""
    def model():
        torch.manual_seed(1)
        return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)], nn.Linear(64, 8))

    rank = dist.get_rank()
    data = [(torch.randn(6, 64, generator=torch.Generator().manual_seed(i + 10 * rank)), y)
            for i, (_, y) in enumerate(batches(3))]
    hooked = DDP(model(), bucket_cap_mb=0.02)
    state = bxt.CommHookState(GradientAllReduce())
    calls = []
    recording(state.comm, calls)
    hooked.register_comm_hook(state, bxt.comm_hook)
    hook_params = train(hooked, torch.optim.SGD(hooked.parameters(), lr=0.1), data)
    state.close()
    plain = DDP(model(), bucket_cap_mb=0.02)
    ddp_params = train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), data)

    bucket_indices = sorted(state.buckets)
    assert len(bucket_indices) >= 3
    assert bucket_indices == list(range(len(bucket_indices)))
    assert_same_steps(hook_params, ddp_params)
    assert sum(n for _, _, n in calls) == sum(p.size for p in ddp_params[0]) * 3  # every gradient, every step


@multirank(nproc=2, timeout=60)
def test_hook_failure_raises_from_backward():
    """A failing algorithm surfaces as an error from backward on the rank, naming the bucket."""
    model = DDP(tied(False))
    state = bxt.CommHookState(GradientAllReduce())

    def broken(x, *a, **k):
        raise RuntimeError("boom")

    state.comm.allreduce = broken
    model.register_comm_hook(state, bxt.comm_hook)
    x, y = batches(1)[0]
    # torch's future turns the BaguaXError into a RuntimeError carrying its message
    with pytest.raises(RuntimeError, match="bagua_x comm hook: GradientAllReduce on DDP bucket 0 failed: "
                                           "RuntimeError: boom"):
        F.mse_loss(model(x), y[:, :7]).backward()


@pytest.mark.parametrize("name", ["Decentralized", "LowPrecisionDecentralized", "ModelAverage", "QAdam",
                                  "AsyncModelAverage"])
def test_hook_refuses_non_gradient_algorithms(name):
    algorithm = getattr(algorithms, name)(**({"lr": 0.1} if name == "QAdam" else {}))
    with pytest.raises(BaguaXError, match=f"{name}.*DDP comm hook.*bagua_x.torch.wrap"):
        bxt.CommHookState(algorithm)


def test_hook_refuses_hierarchical():
    with pytest.raises(BaguaXError, match=r"hierarchical=None or False \(flat\)"):
        bxt.CommHookState(GradientAllReduce(hierarchical=True))
