"""wrap()'s surface: clear errors on every rank, checkpoints, algorithm state, Bagua's tensor API.  The multi-rank
tests' bodies run on every rank of 2 gloo processes (tests/multirank.py)."""

import dataclasses
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua_x.torch as bxt
from bagua_x.algorithms import Algorithm, ByteGrad, Decentralized, GradientAllReduce, LowPrecisionDecentralized
from bagua_x.core import BaguaXError, Bucket, BucketDispatcher
from multirank import multirank


def from_every_rank(value):
    """``value`` of every rank, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def equal_on_every_rank(t):
    lo, hi = t.clone(), t.clone()
    dist.all_reduce(lo, dist.ReduceOp.MIN)
    dist.all_reduce(hi, dist.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))


@multirank(nproc=2, timeout=60)
def test_model_mismatch_fails_on_every_rank():
    width = 16 if dist.get_rank() == 0 else 17  # rank 1 builds a wider first layer
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    with pytest.raises(BaguaXError) as caught:
        bxt.wrap(model)
    messages = from_every_rank(str(caught.value))
    assert messages[0] == messages[1]
    assert "rank 0: '0.weight' shape (16, 8)" in messages[0]
    assert "rank 1: '0.weight' shape (17, 8)" in messages[0]


@multirank(nproc=2, timeout=60)
def test_algorithm_mismatch_fails_on_every_rank():
    with pytest.raises(BaguaXError, match="GradientAllReduce") as caught:
        bxt.wrap(torch.nn.Linear(4, 4), algorithm=GradientAllReduce() if dist.get_rank() == 0 else ByteGrad())
    assert "ByteGrad" in str(caught.value)


@multirank(nproc=2, timeout=90)
def test_state_dict_round_trips_and_keeps_the_bare_keys():
    torch.manual_seed(dist.get_rank())
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    bare_keys = list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = bxt.wrap(model, opt)
    assert list(wrapped.state_dict()) == bare_keys
    F.mse_loss(wrapped(torch.randn(5, 4)), torch.randn(5, 2)).backward()
    opt.step()
    saved = {k: v.clone() for k, v in wrapped.state_dict().items()}
    torch.manual_seed(50)
    bare = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    bare.load_state_dict(wrapped.state_dict())  # wrapped -> bare
    assert all(torch.equal(bare.state_dict()[k], v) for k, v in saved.items())
    with torch.no_grad():
        for p in bare.parameters():
            p.add_(1.0)
    wrapped.load_state_dict(bare.state_dict())  # bare -> wrapped
    assert all(torch.equal(model.state_dict()[k], v) for k, v in bare.state_dict().items())
    assert wrapped.module is model
    wrapped.shutdown()


@multirank(nproc=2, timeout=90)
def test_errors_name_the_problem_and_the_fix():
    # a parameter unused in forward without find_unused_parameters: a clear error, same on both ranks
    class Partial(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    w = bxt.wrap(Partial(), bucket_cap_mb=1e-5)  # tiny buckets: the unused layer gets its own
    with pytest.raises(BaguaXError, match="find_unused_parameters=True") as caught:
        w(torch.randn(2, 4)).sum().backward()
    assert "unused.weight" in str(caught.value) or "unused.bias" in str(caught.value)
    w.shutdown()

    # an algorithm failing on the communication thread surfaces in backward() on the main thread
    class Broken(Algorithm):
        def reduce(self, flat, layout, state, comm):
            raise ValueError("boom")

    w = bxt.wrap(torch.nn.Linear(4, 4), algorithm=Broken())
    with pytest.raises(BaguaXError, match="communication thread") as caught:
        w(torch.randn(2, 4)).sum().backward()
    assert "boom" in str(caught.value)
    w.shutdown()

    # after-step weight algorithms need the optimizer
    with pytest.raises(BaguaXError, match="needs the optimizer"):
        bxt.wrap(torch.nn.Linear(4, 4), algorithm=LowPrecisionDecentralized())


@multirank(nproc=2, timeout=90)
def test_algorithm_state_round_trips_apart_from_the_model_state():
    m = torch.nn.Linear(4, 4)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    w = bxt.wrap(m, o, algorithm=LowPrecisionDecentralized())
    for _ in range(2):
        o.zero_grad()
        w(torch.randn(3, 4)).sum().backward()
        o.step()
    st = w.algorithm_state_dict()
    assert set(next(iter(st.values()))) == {"step", "w", "left", "right"}
    assert int(next(iter(st.values()))["step"]) == 2
    o.zero_grad()
    w(torch.randn(3, 4)).sum().backward()
    o.step()
    w.load_algorithm_state_dict(st)
    assert int(next(iter(w.algorithm_state_dict().values()))["step"]) == 2
    with pytest.raises(BaguaXError, match="nope"):
        w.load_algorithm_state_dict({"nope": {}})
    w.shutdown()


@multirank(nproc=2, timeout=90)
def test_decentralized_forward_without_backward_leaves_nothing_in_flight():
    m = torch.nn.Linear(4, 4)
    w = bxt.wrap(m, algorithm=Decentralized())
    with torch.no_grad():  # evaluation
        w(torch.randn(2, 4))
    w(torch.randn(2, 4)).sum().backward()
    assert equal_on_every_rank(torch.cat([p.detach().reshape(-1) for p in m.parameters()]))
    w.shutdown()


@multirank(nproc=2, timeout=60)
def test_bagua_api():
    """Bagua's tensor methods drive core buckets: registration, closures, storage swap, readiness."""
    assert not hasattr(torch.Tensor, "ensure_bagua_tensor"), "the Bagua API must be opt-in"
    bxt.enable_bagua_api()
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    params = [p.ensure_bagua_tensor(n, "model", getter_closure=lambda p: p.grad,
                                    setter_closure=lambda p, t: setattr(p, "grad", t))
              for n, p in model.named_parameters()]
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert all(p.bagua_ensure_grad() is p for p in params)
    assert all(p.bagua_getter_closure() is p.grad for p in params)
    new = torch.ones_like(params[0])
    params[0].bagua_setter_closure(new)
    assert params[0].grad is new
    storage = torch.zeros(params[0].numel() + 5)
    params[0].bagua_set_registered_storage(storage, 5)
    assert params[0].grad.data_ptr() == storage[5:].data_ptr() and float(storage[5:].sum()) == new.numel()
    bucket = Bucket("b0", [p.bagua_registered_tensor() for p in params])
    bucket.flatten()
    comm = bxt.TorchCommunicator()
    done = []
    BucketDispatcher([bucket], lambda b: done.append(comm.allreduce(b.buffer)))
    model(torch.randn(5, 3) + dist.get_rank()).sum().backward()
    for p in params:
        p.bagua_mark_communication_ready()
    assert len(done) == 1
    assert equal_on_every_rank(done[0])
    assert [p.bagua_registered_tensor().name for p in params] == \
        ["model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias"]


@multirank(nproc=2, timeout=60, init_process_group=False)
def test_wrap_initialises_from_torchrun_environment():
    assert not dist.is_initialized()
    wrapped = bxt.wrap(torch.nn.Linear(2, 2))
    wrapped(torch.ones(1, 2)).sum().backward()
    assert (dist.get_backend(), dist.get_world_size()) == ("gloo", 2)


def test_wrap_without_launcher_says_how_to_launch(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(BaguaXError, match="torchrun"):
        bxt.wrap(torch.nn.Linear(2, 2))
    with pytest.raises(BaguaXError, match="torch.nn.Module"):
        bxt.wrap(lambda x: x)


@multirank(nproc=2, timeout=90)
def test_buffer_broadcast_waits_for_the_exchange_in_flight():
    """The buffer broadcast of a second forward must not overtake the exchange launched by the first.

    Two grad-enabled forwards with no backward between them, Decentralized, a BatchNorm model.  Rank 1's
    exchange starts late (a sleep inside the algorithm), so without ordering its second forward would put the
    buffer broadcast on the process group before that exchange: the two ranks would then issue the two
    collectives in opposite orders.
    """
    @dataclasses.dataclass(frozen=True)
    class SlowOnRankOne(Decentralized):
        def reduce(self, flat, layout, state, comm):
            if comm.rank == 1:
                time.sleep(1.0)
            return super().reduce(flat, layout, state, comm)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.BatchNorm1d(64))
    wrapped = bxt.wrap(model, algorithm=SlowOnRankOne(), timeout=20)
    with torch.no_grad():  # rank-dependent weights and buffers, so the exchange and the broadcast both matter
        for p in model.parameters():
            p.add_(float(dist.get_rank()))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))  # the same on both ranks
    wrapped(x)  # launches the exchange of the weights taken now
    wrapped(x)  # finishes it; the buffers follow rank 0
    wrapped.shutdown()
    params = from_every_rank([p.detach().numpy().copy() for p in model.parameters()])
    buffers = from_every_rank([b.detach().numpy().copy() for b in model.buffers()])
    assert len(params[0]) == len(params[1]) == 4
    for a, b in zip(*params):
        np.testing.assert_array_equal(a, b)  # weights averaged: rank 0's + 0 and rank 1's + 1
    assert len(buffers[0]) == len(buffers[1]) == 3
    for a, b in zip(*buffers):
        np.testing.assert_array_equal(a, b)  # buffers broadcast from rank 0 after the second forward's stats


def test_ranks_sharing_a_gpu_are_named_with_the_fix():
    from bagua_x.torch.distributed import shared_gpus

    gpus = [("GPU-a", "cuda:0"), ("GPU-a", "cuda:0"), ("GPU-b", "cuda:1"), ("GPU-a", "cuda:0")]
    problem = shared_gpus(gpus, [0, 1, 2, 3])
    assert problem.startswith("ranks [0, 1, 3] are all on cuda:0, the same GPU")
    assert "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))" in problem
    assert shared_gpus(gpus[1:3], [4, 5]) is None  # ranks of a subgroup, each on its own GPU


@multirank(nproc=2, timeout=60, init_process_group=False)
def test_wrap_gives_the_process_group_it_initialises_its_timeout():
    # the group's own waits (NCCL's watchdog, gloo's collectives) then end when wrap's do, not after 10-30 min
    from bagua_x.torch.store import resolve_timeout

    assert not dist.is_initialized()
    bxt.wrap(torch.nn.Linear(4, 2), timeout=7.5)
    assert resolve_timeout(None, None) == 7.5


def test_lightning_strategy_has_a_short_path_and_is_imported_only_when_asked():
    import subprocess
    import sys

    probe = ("import sys, bagua_x.torch as bxt; assert 'lightning' not in sys.modules, 'imported with bagua_x.torch'; "
             "from bagua_x.torch.integrations.lightning import BaguaXStrategy; assert bxt.BaguaXStrategy is BaguaXStrategy")
    pytest.importorskip("lightning")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        bxt.NoSuchThing
