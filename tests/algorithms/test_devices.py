"""Every array an algorithm makes takes its bucket's device; nothing reads a value back to the host.

Each algorithm, flat and hierarchical, runs ``init`` and several ``reduce``
steps (QAdam also ``step``) on buckets on torch's ``meta`` device, through a
communicator that checks every array handed to a collective is on ``meta``
and answers with ``meta`` arrays of the collective's result shape.  An array
made without ``device=`` (e.g. ``xp.zeros(n)`` for padding) lands on the CPU
and torch refuses to mix it with the bucket, as CUDA would on a GPU; a value
read back (``int(x)``, ``float(x)``, ``.item()``: a host sync on a GPU) fails
because meta tensors have no data.  Only the step counter is a host scalar,
on purpose: ``switch`` picks a branch on the host without waiting for the GPU.
"""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from bagua_x.algorithms import (ByteGrad, Decentralized, DiLoCo, GradientAllReduce, LowPrecisionDecentralized, ModelAverage,
                                PowerSGD, QAdam)
from bagua_x.core.bucket import BucketLayout
from bagua_x.core.comm import Feature, ReduceOp

META = torch.device("meta")


class MetaCommunicator:
    """One rank of ``size`` whose collectives check their input's device and return meta results."""

    def __init__(self, size, rank=0, local_size=None):
        self.size, self.rank, self.calls = size, rank, []
        if local_size is not None:
            self.within = MetaCommunicator(local_size, rank % local_size)
            self.across = MetaCommunicator(size // local_size, rank // local_size)

    @property
    def features(self):
        return frozenset({Feature.HIERARCHICAL}) if hasattr(self, "within") else frozenset()

    def _input(self, op, x):
        assert isinstance(x, torch.Tensor) and x.device == META, \
            f"{op} was handed an array on {getattr(x, 'device', type(x).__name__)}, not on the bucket's device"
        self.calls.append(op)
        return x

    def allreduce(self, x, op=ReduceOp.SUM):
        return torch.empty_like(self._input("allreduce", x))

    def allgather(self, x):
        return torch.empty((self.size, *self._input("allgather", x).shape), dtype=x.dtype, device=META)

    def alltoall(self, x):
        assert x.shape[0] == self.size
        return torch.empty_like(self._input("alltoall", x))

    def reduce_scatter(self, x, op=ReduceOp.SUM):
        assert x.shape[0] == self.size
        return torch.empty(self._input("reduce_scatter", x).shape[1:], dtype=x.dtype, device=META)

    def broadcast(self, x, root=0):
        return torch.empty_like(self._input("broadcast", x))

    def permute(self, x, pairs):
        return torch.empty_like(self._input("permute", x))

    def switch(self, index, branches, operand):
        # the index must be a host value: reading a GPU one would sync (and a meta one cannot be read)
        assert not isinstance(index, torch.Tensor) or index.device.type == "cpu", index.device
        return branches[int(index)](operand)

    def counter(self, step):
        return step


SHAPES = [(24, 10), (10,), (3, 4, 5)]  # 310 elements: no multiple of 4, so unaligned buckets need padding
ALGORITHMS = [
    GradientAllReduce(), GradientAllReduce(average=False), ByteGrad(), ByteGrad(average=False),
    Decentralized(), Decentralized("shift_one"), Decentralized(communication_interval=2),
    LowPrecisionDecentralized(), ModelAverage(period=2), PowerSGD(matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=0),
    QAdam(lr=0.1, warmup_steps=2),
    DiLoCo(sync_every=2), DiLoCo(sync_every=4, fragments=2, fragment_sync_delay=1, bits=4), DiLoCo(sync_every=2, bits=8),
]
FORMS = {"flat": dict(size=8), "hierarchical": dict(size=8, local_size=4)}


def layout(alg, size):
    return BucketLayout(["w", "b", "v"], SHAPES, "float32", alignment=alg.alignment(size))


def meta_bucket(layout):
    return torch.empty(layout.padded_numel, dtype=torch.float32, device=META)


def hierarchical_form(alg, form):
    """``alg`` forced over nodes in the hierarchical form (where it has one)."""
    if form == "hierarchical" and hasattr(alg, "hierarchical"):
        return dataclasses.replace(alg, hierarchical=True)
    return alg


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("alg", ALGORITHMS, ids=lambda a: repr(a))
def test_every_array_stays_on_the_buckets_device(alg, form):
    comm = MetaCommunicator(**FORMS[form])
    alg = hierarchical_form(alg, form)
    bucket = layout(alg, comm.size)
    state = alg.init(meta_bucket(bucket), bucket, comm.size)
    for _ in range(4):  # past QAdam's and PowerSGD's warmups, both branches of every interval
        out, state = alg.reduce(meta_bucket(bucket), bucket, state, comm)
        assert out.device == META and out.shape == (bucket.padded_numel,)
        for name, value in state._asdict().items():
            assert value.device == (torch.device("cpu") if name == "step" else META), (name, value.device)
    if form == "hierarchical" and hasattr(alg, "hierarchical"):
        assert comm.within.calls and comm.across.calls, "the hierarchical form did not run over nodes"
    else:
        assert comm.calls, "nothing was communicated"


@pytest.mark.parametrize("form", FORMS)
def test_qadams_optax_step_stays_on_the_buckets_device(form):
    comm = MetaCommunicator(**FORMS[form])
    alg = QAdam(lr=0.1, warmup_steps=2, weight_decay=0.01, hierarchical=form == "hierarchical")
    bucket = layout(alg, comm.size)
    state = alg.init(meta_bucket(bucket), bucket, comm.size)
    for _ in range(4):
        update, state = alg.step(meta_bucket(bucket), meta_bucket(bucket), bucket, state, comm)
        assert update.device == META and state.m.device == state.v.device == META


def test_a_padded_pack_stays_on_the_arrays_device():
    bucket = BucketLayout(["w", "b", "v"], SHAPES, "float32", alignment=8)
    flat = bucket.pack([torch.empty(s, device=META) for s in SHAPES])
    assert flat.device == META and flat.shape == (bucket.padded_numel,) == (312,)
    assert [a.shape for a in bucket.unpack(flat)] == [torch.Size(s) for s in SHAPES]
