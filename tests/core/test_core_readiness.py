"""Readiness (core/readiness.py), in one process: when a gradient is final (the counts learnt under
static_graph, each refusal naming the parameter) and which buckets may be launched (in list order only).
The training itself, against DDP(static_graph=True) on 2 gloo ranks: test_torch_ddp_keywords.py."""

import pytest

from bagua_x.core import BaguaXError
from bagua_x.core.readiness import ReadyCounts

HEAD, SHARED = 0, 1


def _counts(static_graph):
    return ReadyCounts(["head", "shared"], static_graph=static_graph)


def _end(counts):
    """The end of a backward as the engine runs it: the tensors final only now, then a fresh count."""
    try:
        return counts.end()
    finally:
        counts.reset()


def test_without_static_graph_a_second_firing_is_refused_naming_the_parameter():
    counts = _counts(static_graph=False)
    assert counts.fire(SHARED) and counts.fire(HEAD)
    with pytest.raises(BaguaXError, match="parameter 'shared' fired a second time.*wrap\\(..., static_graph=True\\)"):
        counts.fire(SHARED)
    counts.reset()
    assert counts.fire(SHARED), "a new backward counts again"


def test_static_graph_learns_the_firings_in_the_first_backward():
    counts = _counts(static_graph=True)
    assert not any(counts.fire(i) for i in (SHARED, HEAD, SHARED))
    assert _end(counts) == [HEAD, SHARED], "final at the end of the first backward, in order of the last firing"
    for _ in range(2):
        assert [counts.fire(i) for i in (SHARED, HEAD, SHARED)] == [False, True, True]
        assert _end(counts) == []


def test_static_graph_refuses_a_graph_that_changes():
    counts = _counts(static_graph=True)
    for i in (SHARED, HEAD, SHARED):
        counts.fire(i)
    _end(counts)
    counts.fire(SHARED), counts.fire(SHARED)
    with pytest.raises(BaguaXError, match="parameter 'shared' fired 3 times in this backward but 2 time"):
        counts.fire(SHARED)
    counts.reset()
    counts.fire(HEAD), counts.fire(SHARED)
    with pytest.raises(BaguaXError, match="parameter 'shared' fired 1 time\\(s\\) in this backward but 2 times"):
        counts.end()


def test_a_first_static_backward_that_raised_is_counted_again():
    counts = _counts(static_graph=True)
    counts.fire(SHARED)
    counts.reset()
    for i in (HEAD, SHARED):
        counts.fire(i)
    assert _end(counts) == [HEAD, SHARED]
    assert counts.fire(HEAD) and counts.fire(SHARED), "one firing each, as in the first complete backward"


def test_buckets_are_launched_in_list_order_only():
    counts = ReadyCounts(list("abcde"), static_graph=False)
    counts.set_buckets(["b0", "b1", "b2"], [[3, 4], [0], [1, 2]])
    assert list(counts.ready(0)) == [], "b1 is complete but b0 is not launched yet"
    assert list(counts.ready(2)) == []
    assert counts.unready() == [3, 4, 1], "b0's and b2's missing tensors, in bucket order"
    assert list(counts.ready(4)) == []
    assert list(counts.ready(4)) == [], "marking twice is harmless"
    with pytest.raises(BaguaXError, match="bucket 'b0' was never dispatched: tensors \\['d'\\] were not marked ready"):
        counts.check_all_launched(lambda i: False)
    assert list(counts.ready(3)) == [0, 1], "b0 completes and lets b1 go after it"
    assert list(counts.ready(1)) == [2]
    counts.check_all_launched(lambda i: False)
    counts.reset()
    assert counts.unready() == [3, 4, 0, 1, 2] and list(counts.ready(0)) == [], "a new backward counts again"
