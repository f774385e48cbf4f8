"""When a gradient is final (ready_counts.py), in one process: the counts learnt under static_graph,
and each refusal naming the parameter.  The training itself, against DDP(static_graph=True) on 2 gloo
ranks: test_torch_ddp_keywords.py."""

import pytest
import torch

from bagua_x.core import BaguaXError
from bagua_x.core.tensor import TensorRegistry
from bagua_x.torch.ready_counts import ReadyCounts


def _tensors():
    registry = TensorRegistry()
    return [registry.register(name, torch.zeros(2)) for name in ("head", "shared")]


def test_without_static_graph_a_second_firing_is_refused_naming_the_parameter():
    head, shared = _tensors()
    counts = ReadyCounts([head, shared], static_graph=False)
    assert counts.fire(shared) and counts.fire(head)
    with pytest.raises(BaguaXError, match="parameter 'shared' fired a second time.*wrap\\(..., static_graph=True\\)"):
        counts.fire(shared)
    counts.reset()
    assert counts.fire(shared), "a new backward counts again"


def test_static_graph_learns_the_firings_in_the_first_backward():
    head, shared = _tensors()
    counts = ReadyCounts([head, shared], static_graph=True)
    assert not any(counts.fire(t) for t in (shared, head, shared))
    assert counts.end() == [head, shared], "final at the end of the first backward, in order of the last firing"
    for _ in range(2):
        assert [counts.fire(t) for t in (shared, head, shared)] == [False, True, True]
        assert counts.end() == []


def test_static_graph_refuses_a_graph_that_changes():
    head, shared = _tensors()
    counts = ReadyCounts([head, shared], static_graph=True)
    for t in (shared, head, shared):
        counts.fire(t)
    counts.end()
    counts.fire(shared), counts.fire(shared)
    with pytest.raises(BaguaXError, match="parameter 'shared' fired 3 times in this backward but 2 time"):
        counts.fire(shared)
    counts.reset()
    counts.fire(head), counts.fire(shared)
    with pytest.raises(BaguaXError, match="parameter 'shared' fired 1 time\\(s\\) in this backward but 2 times"):
        counts.end()


def test_a_first_static_backward_that_raised_is_counted_again():
    head, shared = _tensors()
    counts = ReadyCounts([head, shared], static_graph=True)
    counts.fire(shared)
    counts.reset()
    for t in (head, shared):
        counts.fire(t)
    assert counts.end() == [head, shared]
    assert counts.fire(head) and counts.fire(shared), "one firing each, as in the first complete backward"
