"""TorchCommunicator against numpy, on 2 real gloo ranks (shape conventions of core/comm.py); the test's body runs
on every rank (tests/multirank.py)."""

import numpy as np
import pytest
import torch

from bagua_x.core import BaguaXError, ReduceOp
from bagua_x.torch import TorchCommunicator
from bx_torch_workers import rank_data
from multirank import multirank


@multirank(nproc=2)
def test_communicator_matches_numpy():
    comm = TorchCommunicator()
    r, size = comm.rank, comm.size
    assert (r, size) == (torch.distributed.get_rank(), 2)
    xs = [rank_data(i, (size, 6)) for i in range(size)]
    us = [rank_data(i, (size, 5), "uint8") for i in range(size)]
    stack = np.stack(xs)
    x, u = torch.from_numpy(xs[r]), torch.from_numpy(us[r])
    x_keep = x.clone()

    np.testing.assert_allclose(comm.allreduce(x, ReduceOp.SUM).numpy(), stack.sum(0), rtol=1e-6)
    np.testing.assert_allclose(comm.allreduce(x, ReduceOp.AVG).numpy(), stack.mean(0), rtol=1e-6)
    np.testing.assert_array_equal(comm.allreduce(x, ReduceOp.MIN).numpy(), stack.min(0))
    np.testing.assert_array_equal(comm.allreduce(x, ReduceOp.MAX).numpy(), stack.max(0))
    np.testing.assert_allclose(comm.reduce_scatter(x, ReduceOp.SUM).numpy(), stack.sum(0)[r], rtol=1e-6)
    np.testing.assert_allclose(comm.reduce_scatter(x, ReduceOp.AVG).numpy(), stack.mean(0)[r], rtol=1e-6)
    np.testing.assert_array_equal(comm.reduce_scatter(x, ReduceOp.MIN).numpy(), stack.min(0)[r])
    np.testing.assert_array_equal(comm.reduce_scatter(x, ReduceOp.MAX).numpy(), stack.max(0)[r])
    integers = comm.allreduce(torch.tensor([r * 3 + 1], dtype=torch.int64), ReduceOp.AVG)
    np.testing.assert_array_equal(integers.numpy(), [(1 + 4) // 2])
    np.testing.assert_array_equal(comm.allgather(x).numpy(), stack)
    gathered = comm.allgather(u).numpy()
    assert gathered.dtype == np.uint8
    np.testing.assert_array_equal(gathered, np.stack(us))
    np.testing.assert_array_equal(comm.alltoall(x).numpy(), np.stack([xs[i][r] for i in range(size)]))
    exchanged = comm.alltoall(u).numpy()
    assert exchanged.dtype == np.uint8
    np.testing.assert_array_equal(exchanged, np.stack([us[i][r] for i in range(size)]))
    np.testing.assert_array_equal(comm.broadcast(x, root=1).numpy(), xs[1])
    ring = [(i, (i + 1) % size) for i in range(size)]
    np.testing.assert_array_equal(comm.permute(x, ring).numpy(), xs[(r - 1) % size])
    np.testing.assert_array_equal(comm.permute(u, ring).numpy(), us[(r - 1) % size])
    np.testing.assert_array_equal(comm.permute(x, [(i, i) for i in range(size)]).numpy(), xs[r])
    np.testing.assert_array_equal(comm.permute(x, [(0, 1)]).numpy(), xs[0] if r == 1 else np.zeros_like(xs[r]))
    switched = comm.switch(torch.tensor(1), [lambda v: v * 0, lambda v: v + 1], torch.ones(2))
    np.testing.assert_array_equal(switched.numpy(), [2.0, 2.0])
    assert torch.equal(x, x_keep), "a collective modified its (undonated) input"
    with comm.donate(x):
        y = comm.allreduce(x, ReduceOp.SUM)
    assert y is x
    with pytest.raises(BaguaXError, match="world size 2"):
        comm.alltoall(torch.zeros(size + 1, 2))
    bf = comm.allreduce(torch.full((3,), float(r + 1), dtype=torch.bfloat16), ReduceOp.AVG)
    assert bf.dtype == torch.bfloat16
    np.testing.assert_array_equal(bf.float().numpy(), [1.5] * 3)
