"""wrap() communicates on a process group of its own, so the user's collectives and a second wrapped model
never pair with its communication thread's (issue 30, item 1).  Real gloo processes (tests/multirank.py),
compared against a plain average of every rank's own gradients or weights."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua_x.torch as bxt
from bagua_x.algorithms import Decentralized
from multirank import multirank

STEPS = 40


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 8))


def everyone(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t``, stacked in rank order (the default group)."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def batch(step: int):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def loss_of(out_a, out_b, y, scale):
    return F.mse_loss(out_a + out_b, y) * scale


@multirank(nproc=2, timeout=120)
def test_two_wrapped_models_and_a_user_collective_in_one_backward_average_exactly():
    # a teacher and a student trained together: both comm threads reduce during one backward, several buckets
    # each, and the loss itself all-gathers on the default group
    a, b = mlp(0), mlp(1)
    wa, wb = bxt.wrap(a, bucket_cap_mb=0.005), bxt.wrap(b, bucket_cap_mb=0.005)
    assert len(wa.buckets) > 1 and len(wb.buckets) > 1
    ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)  # rank 0's weights, broadcast by wrap
    wrong = []
    for step in range(STEPS):
        x, y = batch(step)
        out_a, out_b = wa(x), wb(x)
        mine = torch.full((4,), float(dist.get_rank() + 1))
        gathered = everyone(mine)  # the user's collective, on the default group
        assert gathered[:, 0].tolist() == [1.0, 2.0]
        scale = gathered.mean()
        loss_of(out_a, out_b, y, scale).backward()

        ref_a.zero_grad(), ref_b.zero_grad()
        loss_of(ref_a(x), ref_b(x), y, scale).backward()
        for wrapped, ref in ((a, ref_a), (b, ref_b)):
            for (name, p), q in zip(wrapped.named_parameters(), ref.parameters()):
                expected = everyone(q.grad).mean(0)
                if not torch.allclose(p.grad, expected, rtol=1e-5, atol=1e-6):
                    wrong.append((step, name, float((p.grad - expected).abs().max())))
        a.zero_grad(), b.zero_grad()
    assert not wrong, f"{len(wrong)} wrong gradients of {STEPS} steps, first: {wrong[:3]}"


@multirank(nproc=2, timeout=120)
def test_a_user_collective_while_decentralized_exchanges_averages_exactly():
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = bxt.wrap(model, opt, algorithm=Decentralized(), bucket_cap_mb=0.005)
    assert len(wrapped.buckets) > 1
    ref = copy.deepcopy(model)
    wrong = []
    for step in range(STEPS):
        # nothing in flight between steps: every rank's weights now, the reference's starting point
        start = [everyone(p.detach()) for p in model.parameters()]
        x, y = batch(step)
        out = wrapped(x)  # the exchange of the snapshot starts on the communication thread
        gathered = everyone(torch.arange(2000, dtype=torch.float32) * (dist.get_rank() + 1))  # meanwhile, the user's
        assert torch.equal(gathered[1], 2 * gathered[0])
        scale = gathered[:, 1].mean()
        (F.mse_loss(out, y) * scale).backward()
        opt.step()
        opt.zero_grad()

        with torch.no_grad():
            for q, s in zip(ref.parameters(), start):
                q.copy_(s[dist.get_rank()])
        ref.zero_grad()
        (F.mse_loss(ref(x), y) * scale).backward()  # the local gradient at the weights before averaging
        for (name, p), q, s in zip(model.named_parameters(), ref.parameters(), start):
            expected = s.mean(0) - 0.1 * q.grad
            if not torch.allclose(p.detach(), expected, rtol=1e-5, atol=1e-6):
                wrong.append((step, name, float((p.detach() - expected).abs().max())))
    assert not wrong, f"{len(wrong)} wrong weights of {STEPS} steps, first: {wrong[:3]}"


@multirank(nproc=3, timeout=120)
def test_a_subgroup_wraps_without_the_other_ranks_and_groups_stay_in_step():
    # ranks 0 and 1 train two models on their own group; rank 2 never calls wrap.  Afterwards every rank makes
    # a group of all ranks and uses it: wrap's own groups must not have put the numbering of groups out of step
    pair = dist.new_group([0, 1])
    if dist.get_rank() < 2:
        a, b = mlp(0), mlp(1)
        wa, wb = (bxt.wrap(m, process_group=pair, bucket_cap_mb=0.005) for m in (a, b))
        ref_a, ref_b = copy.deepcopy(a), copy.deepcopy(b)
        for step in range(STEPS):
            x, y = batch(step)
            loss_of(wa(x), wb(x), y, 1.0).backward()
            ref_a.zero_grad(), ref_b.zero_grad()
            loss_of(ref_a(x), ref_b(x), y, 1.0).backward()
            for p, q in [*zip(a.parameters(), ref_a.parameters()), *zip(b.parameters(), ref_b.parameters())]:
                out = [torch.empty_like(q.grad) for _ in range(2)]
                dist.all_gather(out, q.grad, group=pair)
                assert torch.allclose(p.grad, torch.stack(out).mean(0), rtol=1e-5, atol=1e-6), step
            a.zero_grad(), b.zero_grad()
        wa.shutdown(), wb.shutdown()
    later = dist.new_group()
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=later)
    assert t.item() == 3.0
