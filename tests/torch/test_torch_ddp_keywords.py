"""DDP's keywords in wrap(): honoured (same training as DDP given the same keywords) or refused before any
collective with the reason.  The trainings run on 2 gloo ranks, each test's body on every rank
(tests/multirank.py)."""

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import bagua_x.torch as bxt
from bagua_x.core import BaguaXError
from multirank import multirank


@pytest.fixture
def no_launcher(monkeypatch):
    """Refusals must come before wrap() looks for torch.distributed: without a launcher it would say so."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(device_ids=[0]), "device_ids\\[0\\]=0: the model is on the CPU"),
    (dict(device_ids=["cpu", "cpu"]), "one process per device"),
    (dict(device_ids=["meta"]), "device_ids\\[0\\]='meta', but the model's parameters are on cpu.*device_ids=None"),
    (dict(output_device=1), "output_device=1: the model is on the CPU"),
    (dict(output_device="cuda:1"), "output_device='cuda:1', but the model's parameters are on cpu.*output_device=None"),
    (dict(gradient_as_bucket_view=False), "gradient_as_bucket_view=False: bagua_x never keeps a second copy"),
], ids=["index_on_cpu", "several_devices", "other_device", "output_index_on_cpu", "output_elsewhere",
        "no_bucket_view"])
def test_refused_with_reason_before_any_collective(no_launcher, kwargs, message):
    with pytest.raises(BaguaXError, match=message):
        bxt.wrap(torch.nn.Linear(2, 2), **kwargs)


def test_positional_device_ids_is_caught(no_launcher):
    with pytest.raises(BaguaXError, match="second positional argument is the optimizer.*device_ids=\\[...\\]"):
        bxt.wrap(torch.nn.Linear(2, 2), [0])


def test_accepted_keywords_reach_the_launcher_check(no_launcher):
    """Keywords bagua_x honours pass the check: wrap() goes on and asks for a launcher."""
    with pytest.raises(BaguaXError, match="torchrun"):
        bxt.wrap(torch.nn.Linear(2, 2), device_ids=[torch.device("cpu")], output_device="cpu",
                 gradient_as_bucket_view=True, static_graph=True, bucket_cap_mb=None)


def batches(steps):
    """This rank's batches (different on each rank)."""
    g = torch.Generator().manual_seed(77 + dist.get_rank())
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)) for _ in range(steps)]


def train(model, opt, batches):
    """The parameters after each step."""
    out = []
    for x, y in batches:
        opt.zero_grad()
        pred = model(x)
        torch.nn.functional.mse_loss(pred, y[:, :pred.shape[1]]).backward()
        opt.step()
        out.append([p.detach().numpy().copy() for p in model.parameters()])
    return out


def from_every_rank(value):
    """``value`` of every rank, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def assert_same_on_every_rank(arrays):
    first, second = from_every_rank(arrays)
    assert len(first) == len(second) > 0
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


@multirank(nproc=2)
def test_same_keywords_same_training_as_ddp():
    """The same DDP keywords given to DDP and to wrap(): the same training (BatchNorm: buffers broadcast)."""
    kwargs = dict(device_ids=None, output_device=None, broadcast_buffers=True, bucket_cap_mb=None,
                  find_unused_parameters=True, gradient_as_bucket_view=True, static_graph=False)

    def model():
        torch.manual_seed(dist.get_rank())  # different weights per rank: both must start from rank 0's
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))

    data = batches(3)
    ddp, wrapped = DDP(model(), **kwargs), bxt.wrap(model(), **kwargs)
    wrapped_static = bxt.wrap(model(), **{**kwargs, "static_graph": True, "find_unused_parameters": False,
                                          "device_ids": ["cpu"], "output_device": torch.device("cpu")})
    out = {name: train(m, torch.optim.SGD(m.parameters(), lr=0.1), data)
           for name, m in (("ddp", ddp), ("wrap", wrapped), ("wrap_static", wrapped_static))}
    for name in ("wrap", "wrap_static"):
        assert len(out[name]) == len(out["ddp"]) == 3
        for step_w, step_d in zip(out[name], out["ddp"]):
            assert len(step_w) == len(step_d) == 6
            for w, d in zip(step_w, step_d):
                np.testing.assert_allclose(w, d, rtol=0, atol=1e-6)
    buffers = {name: [b.numpy().copy() for b in m.module.buffers()] for name, m in (("ddp", ddp), ("wrap", wrapped))}
    assert len(buffers["wrap"]) == len(buffers["ddp"]) == 3
    for w, d in zip(buffers["wrap"], buffers["ddp"]):
        np.testing.assert_allclose(w, d, rtol=0, atol=1e-6)
    assert_same_on_every_rank(out["wrap"][-1])


@multirank(nproc=2)
def test_static_graph_with_reentrant_checkpointing_as_ddp():
    """What users turn static_graph on for: reentrant activation checkpointing. DDP and wrap, same training."""
    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return self.b(checkpoint(lambda t: torch.relu(self.a(t)), x, use_reentrant=True))

    data = [(x.requires_grad_(), y) for x, y in batches(3)]  # reentrant checkpoint needs an input grad
    out = {name: train(m, torch.optim.SGD(m.parameters(), lr=0.1), data)
           for name, m in (("ddp", DDP(Checkpointed(), static_graph=True)),
                           ("wrap", bxt.wrap(Checkpointed(), static_graph=True)))}
    assert len(out["wrap"]) == len(out["ddp"]) == 3
    for step_w, step_d in zip(out["wrap"], out["ddp"]):
        assert len(step_w) == len(step_d) == 4
        for w, d in zip(step_w, step_d):
            np.testing.assert_allclose(w, d, rtol=0, atol=1e-6)  # 0.0 seen


def shared_checkpointed(head_inside: bool):
    """``shared`` is used by two reentrant-checkpointed segments: its gradient hook fires once per
    segment's nested backward, so it is only final after the second firing.  ``head_inside``: the
    head is checkpointed too, so the first hook of a backward fires inside a nested backward."""
    class SharedCheckpointed(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.inp, self.shared = nn.Linear(8, 16), nn.Linear(16, 16)
            self.a, self.b, self.head = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8)

        def segment(self, layer, t):
            if torch.is_grad_enabled():  # the recomputation in backward: a bucket launched at the shared
                time.sleep(0.05)  # parameter's first firing gets time to be reduced before the second one
            return torch.tanh(layer(torch.tanh(self.shared(t))))

        def forward(self, x):
            h = checkpoint(self.segment, self.a, self.inp(x), use_reentrant=True)
            if head_inside:
                return checkpoint(lambda t: self.head(self.segment(self.b, t)), h, use_reentrant=True)
            return self.head(checkpoint(self.segment, self.b, h, use_reentrant=True))

    return SharedCheckpointed()


@pytest.mark.parametrize("head_inside", [False, True], ids=["head_outside", "head_checkpointed"])
@multirank(nproc=2)
def test_static_graph_parameter_shared_by_two_checkpointed_segments_as_ddp(head_inside):
    """A parameter in two reentrant-checkpointed segments: its hook fires twice per backward.  With
    static_graph it is communicated after the second firing, as DDP(static_graph=True) does (before the
    fix the first firing launched its bucket: 9e-4 off DDP from the second step, ranks 3e-3 apart); without,
    wrap refuses on every rank, naming the parameter.  With the head checkpointed too, the first hook
    fires in a nested backward, whose end is not the end of backward (before the fix wrap ended the step
    there: "bucket was never dispatched")."""
    data = batches(6)
    out = {name: train(m, torch.optim.SGD(m.parameters(), lr=0.1), data)
           for name, m in (("ddp", DDP(shared_checkpointed(head_inside), static_graph=True)),
                           ("wrap", bxt.wrap(shared_checkpointed(head_inside), static_graph=True,
                                             bucket_cap_mb=0.001)))}
    names = [n for n, _ in shared_checkpointed(head_inside).named_parameters()]
    assert len(out["wrap"]) == len(out["ddp"]) == 6
    for step_w, step_d in zip(out["wrap"], out["ddp"]):
        assert len(step_w) == len(step_d) == 10
        for name, w, d in zip(names, step_w, step_d):
            np.testing.assert_allclose(w, d, rtol=0, atol=1e-6, err_msg=name)  # 0.0 seen
    assert_same_on_every_rank(out["wrap"][-1])
    model = bxt.wrap(shared_checkpointed(head_inside))
    with pytest.raises(BaguaXError) as caught:
        train(model, torch.optim.SGD(model.parameters(), lr=0.1), data[:1])
    assert str(caught.value).startswith("bagua_x: the gradient hook of parameter 'shared.")
    assert "pass wrap(..., static_graph=True)" in str(caught.value)


@multirank(nproc=2)
def test_static_graph_that_changes_is_refused_on_every_rank_and_training_goes_on():
    """static_graph=True, but the second step runs the shared parameter's segment once instead of twice:
    every rank refuses at the end of that backward, and the next step trains (nothing left in flight)."""
    model = shared_checkpointed(False)
    wrapped = bxt.wrap(model, static_graph=True, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    once = model.forward
    errors = []
    for step, (x, y) in enumerate(batches(3)):
        model.forward = (lambda x: model.head(checkpoint(model.segment, model.b, model.inp(x), use_reentrant=True))
                         ) if step == 1 else once
        opt.zero_grad()
        try:
            torch.nn.functional.mse_loss(wrapped(x), y).backward()
            opt.step()
        except BaguaXError as e:
            errors.append((step, str(e)))
    assert len(errors) == 1 and errors[0][0] == 1, errors
    message = errors[0][1]
    assert message.startswith("bagua_x: the gradient hook of parameter 'shared."), message
    assert "fired 1 time(s) in this backward but 2 times in the first one" in message, message
    assert_same_on_every_rank([p.detach().numpy().copy() for p in model.parameters()])
