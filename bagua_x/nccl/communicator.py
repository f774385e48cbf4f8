"""The Communicator protocol on NCCL through ``nccl4py`` (NVIDIA's Python NCCL binding).

:class:`NcclCommunicator` runs eager collectives on any CUDA buffer that has
``__dlpack__`` -- torch tensors and JAX arrays alike -- over one NCCL
communicator.  Install the binding with ``pip install 'bagua-x[nccl]'``
(``nccl4py[cu12]``; use ``nccl4py[cu13]`` on CUDA 13).  Nothing here imports
torch, JAX or nccl4py at module import time: nccl4py is imported in the
constructor, and a framework only through ``array_api_compat`` for the array
it was handed.  It offers no optional :class:`~bagua_x.core.comm.Feature`
(``features`` is empty: hierarchical algorithms run flat on it).

Buffers.  Inputs are read through their DLPack capsule (:func:`buffer_info`)
and never written.  Every result is a new array that bagua_x owns:

* for torch (and any non-JAX producer) it is allocated by the input's own
  framework (``xp.empty`` / ``xp.zeros`` on the input's device through
  ``array_api_compat``) and NCCL writes into it through its data pointer;
* for JAX, whose arrays must never be written, it is device memory allocated
  with ``cuda.core`` (a dependency of nccl4py), filled by NCCL, and handed to
  JAX through a DLPack capsule that bagua_x produces
  (:class:`bagua_x.core.dlpack.DLPackExport`, ``jnp.from_dlpack``, zero copy);
  the memory is freed when JAX drops the array.

Streams (:mod:`bagua_x.nccl.streams`).  Collectives are enqueued on ``stream``
(a ``cudaStream_t`` as int, or an object with ``__cuda_stream__`` or
``cuda_stream``; default: the legacy default stream, 0).  Before reading a
buffer, the communicator asks its producer to make that stream wait for it
through the DLPack stream handshake (``x.__dlpack__(stream=...)``: torch records
an event on its current stream, JAX waits until the array is ready), so inputs
made on the producer's stream are safe.  What comes *after* is ordered the
other way round: a torch result is handed back through ``xp.from_dlpack``, whose
``__dlpack__(stream=...)`` makes the consumer's current stream wait for an event
recorded on ``stream`` after the collective (:class:`_AfterEvent`), so the
caller's kernels -- and the division of an average NCCL cannot do itself --
read finished data, with no host sync.  Inputs and outputs are kept alive until
``stream`` is past the collective (the caller may drop them at once; their
framework's allocator knows nothing of ``stream``).  JAX results are complete
when returned (the communicator waits for the collective's event before handing
memory to JAX, which runs on streams of its own).

Rendezvous (:mod:`bagua_x.nccl.rendezvous`): rank 0 creates the NCCL unique id
and publishes it in the job's existing key-value store; the others wait for it.

Datatypes (:mod:`bagua_x.nccl.datatypes`): reductions map the DLPack dtype to
NCCL's; data movement moves bytes, so every dtype works.
"""

from __future__ import annotations

import collections
import os
from typing import Any, Callable, Optional, Sequence

from bagua_x.core.comm import Feature, ReduceOp
from bagua_x.core.dlpack import DLPACK_DTYPES, BufferInfo, DLPackExport, buffer_info, is_jax_owned, numel
from bagua_x.core.errors import BaguaXError

from .datatypes import BYTES_DTYPE, NCCL_AVG_MIN_VERSION, reduce_plan
from .rendezvous import exchange_unique_id, next_unique_id_key
from .streams import consumer_stream, dlpack_stream, stream_handle

__all__ = ["NcclCommunicator", "UNIQUE_ID_BYTES", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'bagua-x[nccl]' (nccl4py[cu12]; nccl4py[cu13] on CUDA 13)"

UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES

_DLPACK_CUDA = 2


def _import_nccl():
    """``(nccl.core, nccl.bindings.nccl, cuda.core)``, or a BaguaXError saying what to install."""
    try:
        import nccl.core as nccl_core
        from nccl.bindings import nccl as nccl_bindings
        import cuda.core as cuda_core  # a dependency of nccl4py
    except ImportError as e:
        raise BaguaXError(
            f"NcclCommunicator needs nccl4py, NVIDIA's Python binding for NCCL, which could not be imported "
            f"({e}); install it with: {INSTALL_HINT}"
        ) from e
    return nccl_core, nccl_bindings, cuda_core


def _detached(x):
    """torch refuses to export tensors that require grad; NCCL only reads their data."""
    if getattr(x, "requires_grad", False) and callable(getattr(x, "detach", None)):
        return x.detach()
    return x


class _Output:
    """A result buffer: ``ptr`` for NCCL to write, ``finish(done)`` -> the array handed back, ``done`` an event
    recorded on NCCL's stream after the collective."""

    def __init__(self, ptr: int, finish: Callable[[Any], Any]):
        self.ptr, self.finish = ptr, finish


class _AfterEvent:
    """``array``, exported through DLPack only once its consumer's stream waits for ``done`` (NCCL's event).

    The DLPack stream handshake the other way round: ``xp.from_dlpack`` passes
    the consumer's current stream to ``__dlpack__``, which makes that stream
    wait for NCCL's write, so whatever the framework queues on it next (the
    division of an average, the caller's kernels) reads the finished result,
    with no host sync.  ``stream_at(handle)`` makes a stream object from a
    ``cudaStream_t`` (``cuda.core.Stream.from_handle``).
    """

    def __init__(self, array, done, stream_at: Callable[[int], Any]):
        self._array, self._done, self._stream_at = array, done, stream_at

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()

    def __dlpack__(self, *, stream=None, **kwargs):
        handle = consumer_stream(stream)
        if handle is not None:
            self._stream_at(handle).wait(self._done)
        return self._array.__dlpack__(stream=stream, **kwargs)


class NcclCommunicator:
    """bagua_x collectives on one NCCL communicator, for torch tensors and JAX arrays on CUDA.

    Args:
        rank, size: this process's rank and the number of ranks.
        store: the job's rendezvous key-value store (``set(key, bytes)``, ``get(key) -> bytes``),
            e.g. ``torch.distributed.TCPStore`` or ``jax_kv_store(client)``; needed when
            ``size > 1`` unless ``unique_id`` is given.
        device: CUDA device ordinal; default ``$LOCAL_RANK`` (else ``rank``) modulo the visible devices.
        stream: the stream collectives run on (see the module docstring); default 0.
        unique_id: the 128-byte NCCL unique id, when the caller exchanged it itself.
        name: communicators of different names use different store keys.
        key: the store key of the unique id; default ``bagua_x/nccl/<restart>/<name>/<n>`` for this rank's
            n-th communicator of that name in the job, counted in the store (ranks create them in the same order).
        timeout: seconds a rank waits for rank 0's unique id.
    """

    def __init__(self, rank: int, size: int, store=None, *, device: Optional[int] = None, stream=None,
                 unique_id: Optional[bytes] = None, name: str = "default", key: Optional[str] = None,
                 timeout: float = 300.0):
        rank, size = int(rank), int(size)
        if size < 1 or not 0 <= rank < size:
            raise BaguaXError(f"NcclCommunicator needs 0 <= rank < size, got rank={rank}, size={size}")
        self._rank, self._size = rank, size
        self._nc, self._b, cuda_core = _import_nccl()

        ndev = self._device_count()
        if device is None:
            device = int(os.environ.get("LOCAL_RANK", rank)) % ndev
        self._device_id = int(device)
        if not 0 <= self._device_id < ndev:
            raise BaguaXError(f"device {self._device_id} does not exist: {ndev} CUDA device(s) visible")
        self._device = cuda_core.Device(self._device_id)
        self._device.set_current()  # NCCL binds the communicator to the current device
        self._stream = stream_handle(stream)
        self._cstream = (cuda_core.Stream.from_handle(self._stream) if self._stream
                         else self._device.default_stream)
        self._stream_at = cuda_core.Stream.from_handle
        #: (event on ``stream`` after a collective, its input, its output): kept alive until the event is done
        self._in_flight: collections.deque = collections.deque()

        def create() -> bytes:
            return bytes(self._nc.get_unique_id())

        if unique_id is not None:
            uid = bytes(unique_id)
        elif store is not None:
            uid = exchange_unique_id(store, rank, key or next_unique_id_key(store, rank, name), create, timeout=timeout)
        elif size == 1:
            uid = create()
        else:
            raise BaguaXError(
                f"NcclCommunicator with size={size} needs the job's rendezvous store (store=...) to share the "
                "NCCL unique id, e.g. a torch.distributed.TCPStore or jax_kv_store(client), or unique_id=..."
            )
        if len(uid) != UNIQUE_ID_BYTES:
            raise BaguaXError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        try:
            self._comm = self._nc.Communicator.init(size, rank, self._nc.UniqueId.from_bytes(uid))
        except Exception as e:  # noqa: BLE001
            raise BaguaXError(
                f"NCCL communicator init failed on rank {rank}/{size}, cuda:{self._device_id}: {e}"
            ) from e
        # nccl4py >= 0.5 binds the communicator as a Comm handle, 0.4 as the raw pointer.
        comm_cls = getattr(self._b, "Comm", None)
        self._comm_arg = comm_cls(self._comm.ptr) if comm_cls is not None else self._comm.ptr
        self._nccl_version = int(self._b.get_version())
        self._has_avg = hasattr(self._nc.NcclRedOp, "AVG") and self._nccl_version >= NCCL_AVG_MIN_VERSION
        self._bytes = int(self._nc.NcclDataType[BYTES_DTYPE])
        self._dl_device = (_DLPACK_CUDA, self._device_id)  # where results handed to JAX live

    @staticmethod
    def _device_count() -> int:
        """CUDA devices visible to this process (CUDA_VISIBLE_DEVICES applies, unlike NVML's count)."""
        try:
            from cuda.bindings import runtime  # cuda-bindings: a dependency of nccl4py[cu12/cu13]

            err, count = runtime.cudaGetDeviceCount()
        except Exception as e:  # noqa: BLE001
            raise BaguaXError(f"NcclCommunicator could not count CUDA devices: {e}") from e
        if int(getattr(err, "value", err)) != 0 or not count:
            raise BaguaXError(f"NcclCommunicator needs a CUDA GPU, but CUDA sees none ({err})")
        return int(count)

    # -- protocol properties -----------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def features(self) -> frozenset[Feature]:
        """No optional features: hierarchical algorithms run flat here."""
        return frozenset()

    @property
    def device(self) -> int:
        """The CUDA device ordinal the communicator lives on."""
        return self._device_id

    @property
    def stream(self) -> int:
        """The ``cudaStream_t`` collectives are enqueued on."""
        return self._stream

    @property
    def nccl_version(self) -> int:
        """The loaded NCCL's version code, e.g. 22803 for 2.28.3."""
        return self._nccl_version

    def __repr__(self) -> str:
        return f"NcclCommunicator(rank={self._rank}, size={self._size}, device=cuda:{self._device_id})"

    def close(self) -> None:
        """Destroy the NCCL communicator (all ranks should call it)."""
        comm, self._comm = getattr(self, "_comm", None), None
        if comm is not None:
            self._cstream.sync()  # what is still in flight reads and writes the buffers kept for it
            self._in_flight.clear()
            comm.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- collectives -------------------------------------------------------------------------
    def allreduce(self, x, op: ReduceOp = ReduceOp.SUM):
        x, info = self._input(x, "allreduce")
        dtype, count, nccl_op, post = self._reduce_plan(info, op, "allreduce")
        out = self._output(x, info, info.shape)
        if count:
            self._launch("allreduce", self._b.all_reduce, info.data_ptr, out.ptr, count, dtype, nccl_op,
                         self._comm_arg, self._stream)
        return self._result(x, out, post)

    def allgather(self, x):
        x, info = self._input(x, "allgather")
        out = self._output(x, info, (self._size, *info.shape))
        if info.nbytes:
            self._launch("allgather", self._b.all_gather, info.data_ptr, out.ptr, info.nbytes, self._bytes,
                         self._comm_arg, self._stream)
        return self._result(x, out)

    def alltoall(self, x):
        x, info = self._input(x, "alltoall")
        self._check_rows(info, "alltoall")
        out = self._output(x, info, info.shape)
        row = info.nbytes // self._size
        if row:
            def sends():
                for peer in range(self._size):
                    self._b.send(info.data_ptr + peer * row, row, self._bytes, peer, self._comm_arg, self._stream)
                    self._b.recv(out.ptr + peer * row, row, self._bytes, peer, self._comm_arg, self._stream)
            self._launch("alltoall", self._grouped, sends)
        return self._result(x, out)

    def reduce_scatter(self, x, op: ReduceOp = ReduceOp.SUM):
        x, info = self._input(x, "reduce_scatter")
        self._check_rows(info, "reduce_scatter")
        dtype, count, nccl_op, post = self._reduce_plan(info, op, "reduce_scatter")
        out = self._output(x, info, info.shape[1:])
        if count:
            self._launch("reduce_scatter", self._b.reduce_scatter, info.data_ptr, out.ptr, count // self._size,
                         dtype, nccl_op, self._comm_arg, self._stream)
        return self._result(x, out, post)

    def broadcast(self, x, root: int = 0):
        root = int(root)
        if not 0 <= root < self._size:
            raise BaguaXError(f"broadcast root {root} is not a rank of this communicator (size {self._size})")
        x, info = self._input(x, "broadcast")
        out = self._output(x, info, info.shape)
        if info.nbytes:
            self._launch("broadcast", self._b.broadcast, info.data_ptr, out.ptr, info.nbytes, self._bytes, root,
                         self._comm_arg, self._stream)
        return self._result(x, out)

    def permute(self, x, pairs: Sequence[tuple[int, int]]):
        pairs = [(int(s), int(d)) for s, d in pairs]
        for s, d in pairs:
            if not (0 <= s < self._size and 0 <= d < self._size):
                raise BaguaXError(f"permute pair {(s, d)} names a rank outside 0..{self._size - 1}")
        dsts = [d for _, d in pairs]
        if len(set(dsts)) != len(dsts):
            raise BaguaXError(f"permute pairs {pairs} send to some rank twice; each rank may receive once")
        x, info = self._input(x, "permute")
        out = self._output(x, info, info.shape, zero=True)
        mine = [(s, d) for s, d in pairs if self._rank in (s, d)]
        if info.nbytes and mine:
            def sends():
                for s, d in mine:
                    if s == self._rank:
                        self._b.send(info.data_ptr, info.nbytes, self._bytes, d, self._comm_arg, self._stream)
                    if d == self._rank:
                        self._b.recv(out.ptr, info.nbytes, self._bytes, s, self._comm_arg, self._stream)
            self._launch("permute", self._grouped, sends)
        return self._result(x, out)

    def switch(self, index, branches: Sequence[Callable[[Any], Any]], operand):
        return branches[int(index)](operand)

    def counter(self, step):
        return step  # on the host already

    # -- helpers -----------------------------------------------------------------------------
    def _input(self, x, what: str):
        """``(x, info)``: a contiguous CUDA buffer on this device, ready on ``self.stream``."""
        x = _detached(x)
        info = buffer_info(x)
        self._check_device(info, what)
        if not info.is_contiguous:
            if not callable(getattr(x, "contiguous", None)):
                raise BaguaXError(f"NcclCommunicator.{what}: the buffer of shape {info.shape} is not contiguous")
            x = x.contiguous()
            info = buffer_info(x)
        self._wait_for_producer(x)
        return x, info

    def _check_device(self, info: BufferInfo, what: str) -> None:
        if info.device != f"cuda:{self._device_id}":
            raise BaguaXError(
                f"NcclCommunicator.{what}: expected a CUDA buffer on cuda:{self._device_id} (the communicator's "
                f"device), got a {info.dtype} buffer of shape {info.shape} on {info.device}"
            )

    def _wait_for_producer(self, x) -> None:
        """Make ``self.stream`` wait for the work that produces ``x`` (DLPack stream handshake)."""
        try:
            capsule = x.__dlpack__(stream=dlpack_stream(self._stream))
        except Exception:  # noqa: BLE001 - TypeError, BufferError, AssertionError, JaxRuntimeError, ...
            # A producer without stream support (or refusing this stream): wait on the host instead.
            ready = getattr(x, "block_until_ready", None)
            if callable(ready):
                ready()
            return
        del capsule  # unconsumed: its destructor gives the tensor back

    def _output(self, x, info: BufferInfo, shape: tuple, zero: bool = False) -> _Output:
        import array_api_compat

        xp = array_api_compat.array_namespace(x)
        if is_jax_owned(x):
            return self._owned_output(xp, info.dtype, shape, zero)
        make = xp.zeros if zero else xp.empty
        arr = make(shape, dtype=x.dtype, device=array_api_compat.device(x))
        out_info = buffer_info(arr)
        self._wait_for_producer(arr)  # xp.zeros may still be running on the framework's stream
        return _Output(out_info.data_ptr, lambda done: xp.from_dlpack(_AfterEvent(arr, done, self._stream_at)))

    def _owned_output(self, xp, dtype: str, shape: tuple, zero: bool) -> _Output:
        """Device memory from cuda.core, given to JAX through DLPack once NCCL has filled it."""
        nbytes = DLPACK_DTYPES[dtype][1] // 8 * numel(shape)
        buf = self._device.allocate(max(nbytes, 1), stream=self._cstream)
        if zero and nbytes:
            buf.fill(0, stream=self._cstream)
        ptr = int(buf.handle)

        def finish(done):
            done.sync()  # JAX runs on streams of its own: hand over finished data only
            return xp.from_dlpack(DLPackExport(ptr, shape, dtype, self._dl_device, buf))

        return _Output(ptr, finish)

    def _reduce_plan(self, info: BufferInfo, op, what: str):
        """``(nccl dtype, count, nccl op, post)`` with ``post`` in (None, 'div', 'floordiv')."""
        plan = reduce_plan(info.dtype, info.numel, op, self._has_avg, what)
        return (int(self._nc.NcclDataType[plan.dtype]), plan.count, int(self._nc.NcclRedOp[plan.op]), plan.post)

    def _result(self, x, out: _Output, post=None):
        """The collective's result, queued on ``stream``: ``x`` and the output kept alive until ``stream`` is
        past the collective (the caller may drop them at once, and the allocator of their framework would
        hand their memory to its own stream while NCCL still reads or writes it), and handed back so that
        the consumer's stream waits for NCCL's (:class:`_AfterEvent`) before anything reads it: ``post``'s
        division too, which the framework queues on its current stream."""
        while self._in_flight and self._in_flight[0][0].is_done:
            self._in_flight.popleft()
        done = self._cstream.record()
        self._in_flight.append((done, x, out))
        return self._post(out.finish(done), post)

    def _post(self, out, post):
        if post == "div":
            return out / self._size
        if post == "floordiv":
            return out // self._size
        return out

    def _grouped(self, body: Callable[[], None]) -> None:
        self._nc.group_start()
        try:
            body()
        finally:
            self._nc.group_end()

    def _launch(self, what: str, fn, *args) -> None:
        if self._comm is None:
            raise BaguaXError(f"NcclCommunicator.{what}: the communicator was closed")
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - NCCLError, NcclInvalid, CUDA errors
            raise BaguaXError(
                f"NCCL {what} failed on rank {self._rank}/{self._size} (cuda:{self._device_id}): {e}"
            ) from e

    def _check_rows(self, info: BufferInfo, what: str) -> None:
        if not info.shape or info.shape[0] != self._size:
            raise BaguaXError(
                f"{what} needs an array whose first dimension is the world size {self._size} (one row per rank), "
                f"got shape {info.shape}"
            )
