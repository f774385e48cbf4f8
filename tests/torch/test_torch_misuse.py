"""Misuse that used to train wrong is refused with the fix, the same BaguaXError on every rank (issue 30,
item 7): a model wrapped twice, a wrapper wrapped, DDP wrapped, an FSDP model, a parameter frozen after wrap.
Each body runs on 2 real gloo processes (tests/multirank.py)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua_x.torch as bxt
from bagua_x.core import BaguaXError
from multirank import multirank


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def refused_everywhere(make, *fragments):
    """``make()`` raises a BaguaXError, the same on every rank, containing each of ``fragments``."""
    with pytest.raises(BaguaXError) as caught:
        make()
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, message)
    assert len(set(out)) == 1, out


def one_step_averages(wrapped, net):
    x, y = torch.randn(3, 4) * (dist.get_rank() + 1), torch.randn(3, 2)
    reference = model()
    reference.load_state_dict(net.state_dict())
    F.mse_loss(wrapped(x), y).backward()
    F.mse_loss(reference(x), y).backward()
    for p, q in zip(net.parameters(), reference.parameters()):
        out = [torch.empty_like(q.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(out, q.grad)
        assert torch.allclose(p.grad, torch.stack(out).mean(0), rtol=1e-5, atol=1e-6)


@multirank(nproc=2, timeout=60)
def test_wrapping_a_wrapped_model_again_is_refused_until_the_first_is_shut_down():
    net = model()
    first = bxt.wrap(net)
    refused_everywhere(lambda: bxt.wrap(net), "'0.weight' already belongs to a model wrapped", "shutdown()")
    refused_everywhere(lambda: bxt.wrap(net[0]), "'weight' already belongs")  # a part of it, too
    one_step_averages(first, net)  # the first wrapper is untouched by the refused ones
    first.shutdown()
    net.zero_grad()
    one_step_averages(bxt.wrap(net), net)


@multirank(nproc=2, timeout=60)
def test_wrapping_a_wrapper_is_refused():
    refused_everywhere(lambda: bxt.wrap(bxt.wrap(model())), "already wrapped by bagua_x.torch.wrap", ".module")


@multirank(nproc=2, timeout=60)
def test_wrapping_ddp_is_refused_naming_the_comm_hook():
    ddp = torch.nn.parallel.DistributedDataParallel(model())
    refused_everywhere(lambda: bxt.wrap(ddp), "DistributedDataParallel", "wrap(ddp.module)",
                       "ddp.register_comm_hook(bxt.CommHookState(algorithm), bxt.comm_hook)")
    holder = torch.nn.Sequential(ddp)
    refused_everywhere(lambda: bxt.wrap(holder), "its submodule '0' is a torch DistributedDataParallel")


@multirank(nproc=2, timeout=60)
def test_an_fsdp_model_is_refused():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = model()
    fully_shard(net, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    refused_everywhere(lambda: bxt.wrap(net), "is a DTensor", "FSDP")


@multirank(nproc=2, timeout=60)
def test_a_parameter_frozen_after_wrap_is_named_as_such_at_backward():
    net = model()
    wrapped = bxt.wrap(net)
    net[2].bias.requires_grad_(False)
    refused_everywhere(lambda: F.mse_loss(wrapped(torch.randn(3, 4)), torch.randn(3, 2)).backward(),
                       "['2.bias'] have requires_grad=False, set after wrap()", "freeze parameters before wrap()")
