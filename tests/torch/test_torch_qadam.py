"""QAdam through bagua_x.torch.wrap on 2 gloo ranks: Adam during warmup, then 8-bit momentum from the optimizer
state.  Each test's body runs on every rank (tests/multirank.py)."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import bagua_x.torch as bxt
import reference as ref
from bagua_x.algorithms import QAdam
from bagua_x.core.errors import BaguaXError
from multirank import multirank


def data(steps):
    """This rank's batches: different data on each rank."""
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    return torch.randn(steps, 16, 8, generator=g), torch.randn(steps, 16, 4, generator=g)


def from_every_rank(value):
    """``value`` of every rank, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


@multirank(nproc=2)
def test_warmup_equals_adam_on_averaged_gradients():
    steps = 5
    xs, ys = data(steps)
    params = {}
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
        params[system] = [p.detach().clone().numpy() for p in model.parameters()]
        if system == "bagua_x":
            wrapped.shutdown()
    assert len(params["ddp"]) == len(params["bagua_x"]) > 0
    for a, b in zip(params["ddp"], params["bagua_x"]):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


@multirank(nproc=2)
def test_compressed_momentum_matches_the_reference():
    steps, warmup, lr = 6, 2, 1e-2
    xs, ys = data(steps)
    torch.manual_seed(dist.get_rank())  # different initial weights: wrap broadcasts rank 0's
    model = torch.nn.Linear(8, 4, bias=False)
    opt = bxt.QAdamOptimizer(model.parameters(), lr=lr, warmup_steps=warmup, weight_decay=0.01)
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
        grads.append(from_every_rank(torch.autograd.grad(loss, model.weight, retain_graph=True)[0].reshape(-1).numpy()))
        loss.backward()
        opt.step()
        params.append(model.weight.detach().clone().reshape(-1).numpy())
        m = opt.state[model.weight]["exp_avg"]
        momentum_views.append(any(m.data_ptr() == b.buffer.data_ptr() for b in wrapped.buckets))
    wrapped.shutdown()

    # every rank ends with the same parameters (same dequantised momentum)
    for other in from_every_rank(params[-1]):
        np.testing.assert_array_equal(other, params[-1])
    expected = ref.qadam(initial, grads, lr=lr, warmup_steps=warmup, weight_decay=0.01)
    uncompressed = ref.qadam(initial, grads, lr=lr, warmup_steps=steps, weight_decay=0.01)
    assert len(params) == len(expected) == len(uncompressed) == steps
    for t, (got, want, adam) in enumerate(zip(params, expected, uncompressed), start=1):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"step {t}")
        if t > warmup:  # and the 8-bit momentum really changed the result
            assert np.abs(got - adam).max() > 1e-3
    # after warmup the optimizer's exp_avg lives in the bucket buffer and is really quantised
    assert momentum_views == [False] * warmup + [True] * (steps - warmup)
    # warmup: one float32 allreduce of the 32 gradients a step; then the momentum as uint8 only:
    # an alltoall of 2 rows of 16 + an 8-byte min/max header, an allgather of one row
    compressed = [("alltoall", "uint8", 2 * (16 + 8)), ("allgather", "uint8", 16 + 8)]
    assert [s[1:] for s in sent if s[0] < warmup] == [("allreduce", "float32", 32)] * warmup, sent
    assert [s[1:] for s in sent if s[0] >= warmup] == compressed * (steps - warmup), sent


@multirank(nproc=2)
def test_converges():
    steps, warmup, rank = 80, 20, dist.get_rank()
    torch.manual_seed(rank)
    true_w = torch.linspace(-1, 1, 16).reshape(1, 16)
    xs = torch.randn(steps, 32, 16, generator=torch.Generator().manual_seed(rank)) + rank
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
    assert np.mean(losses[-5:]) < 0.05 * np.mean(losses[:3]), losses
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    first, second = from_every_rank(weights)
    np.testing.assert_array_equal(first, second)


def test_no_warmup_is_refused():
    """With warmup_steps=0 Adam's variance is frozen at 0: a Linear(8, 1) moved by 6.3e5 in two steps."""
    for make in (lambda: bxt.QAdamOptimizer(torch.nn.Linear(8, 1).parameters(), lr=1e-3, warmup_steps=0),
                 lambda: QAdam(warmup_steps=0), lambda: QAdam(warmup_steps=-3)):
        with pytest.raises(BaguaXError, match="warmup_steps >= 1"):
            make()
    assert QAdam(warmup_steps=1).warmup_steps == 1
