"""docs/write-your-own-algorithm.md's Float16AllReduce (examples/own_algorithm.py) through bagua_x.torch.wrap,
on 2 gloo ranks: one SGD step moves the weights by the float16 mean of the ranks' gradients."""

from multirank import multirank


@multirank(nproc=2)
def test_wrap_steps_with_the_float16_mean():
    import copy

    import torch
    import torch.distributed as dist

    import bagua_x.torch as bxt
    from own_algorithm import Float16AllReduce

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    local = copy.deepcopy(model)  # this rank's own gradient, for the reference
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(rank))  # each rank its own data
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    model = bxt.wrap(model, optimizer, algorithm=Float16AllReduce())
    ((model(x) - 1) ** 2).mean().backward()
    optimizer.step()
    model.shutdown()

    ((local(x) - 1) ** 2).mean().backward()
    for before, after in zip(local.parameters(), model.parameters()):
        grads = [torch.empty_like(before.grad) for _ in range(2)]
        dist.all_gather(grads, before.grad)
        mean = (grads[0] + grads[1]) / 2
        bound = 2 * 2.0**-11 * torch.maximum(grads[0].abs(), grads[1].abs())  # 2 roundings to float16
        moved = before.detach() - after.detach()
        assert torch.all((moved - 0.1 * mean).abs() <= 0.1 * bound + 1e-7)
        assert not torch.equal(moved, 0.1 * grads[rank])  # the mean, not this rank's own gradient


@multirank(nproc=2)
def test_a_dict_state_is_refused_at_wrap():
    """A state that is not a NamedTuple would train, then fail at the first checkpoint far from its cause."""
    import dataclasses

    import pytest
    import torch

    import bagua_x.torch as bxt
    from bagua_x.core import BaguaXError
    from own_algorithm import Float16AllReduce

    @dataclasses.dataclass(frozen=True)
    class DictState(Float16AllReduce):
        def init(self, flat, layout, world_size):
            return {"residual": flat * 0}

    model = torch.nn.Linear(4, 2)
    with pytest.raises(BaguaXError, match=r"DictState.init returned a dict .*weight.*NamedTuple"):
        bxt.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm=DictState())
