"""tests/multirank.py's decorator itself: the body runs on every rank, a rank's failure comes back with its rank and
traceback, a hang fails within the timeout."""

import time

import pytest

from multirank import RankFailed, multirank


@multirank(nproc=3)
def test_the_body_runs_on_every_rank_with_gloo(tmp_path):
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    (tmp_path / f"rank{rank}").write_text("ran")
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    assert dist.get_world_size() == 3 and total.item() == 0 + 1 + 2
    assert dist.get_backend() == "gloo"
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1", "rank2"]


@multirank(nproc=2)
def fails_on_rank_one_only():
    import torch.distributed as dist

    values = {0: 10, 1: 11}
    assert values[dist.get_rank()] == 10, "the value of this rank"


@multirank(nproc=2, timeout=20)
def rank_one_skips_a_collective():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.zeros(1))  # rank 1 never comes
    else:
        time.sleep(60)


def test_the_failing_rank_is_named_with_its_traceback():
    with pytest.raises(RankFailed) as caught:
        fails_on_rank_one_only()
    message = str(caught.value)
    assert message.startswith("rank 1 of 2 failed first:")
    assert "assert values[dist.get_rank()] == 10" in message and "AssertionError: the value of this rank" in message


def test_a_hang_fails_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 0 of 2 failed first|timed out after 20"):
        rank_one_skips_a_collective()
    assert time.monotonic() - start < 40
