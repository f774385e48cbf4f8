"""NcclCommunicator (bagua_x.core.nccl).

Without a GPU: import hygiene, the dtype/op tables, stream handles, the DLPack
export of bagua_x-owned memory (consumed by numpy, torch and JAX), the unique-id
exchange over a real ``torch.distributed.TCPStore`` between two processes and
over JAX's real distributed client, the missing-nccl4py message, and the
refusal of a bad rank.  No collective runs without a GPU: there is no CPU
stand-in for NCCL here.

With a GPU (``@pytest.mark.gpu``, skipped without CUDA): every collective
against numpy on 1 rank with torch CUDA tensors and JAX GPU arrays through the
real nccl4py, and on 2 ranks (two processes) when there are >= 2 GPUs.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch in GPU tests

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from bagua_x.core import BaguaXError, ReduceOp  # noqa: E402
from bagua_x.core import nccl as N  # noqa: E402
from bagua_x.core.dlpack import buffer_info  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}

# NCCL's ncclDataType_t / ncclRedOp_t values, as nccl4py 0.6.0 exposes them in
# nccl.core.NcclDataType / NcclRedOp (read from the installed package).
NCCL_DTYPE_CODES = {"INT8": 0, "UINT8": 1, "INT32": 2, "UINT32": 3, "INT64": 4, "UINT64": 5,
                    "FLOAT16": 6, "FLOAT32": 7, "FLOAT64": 8, "BFLOAT16": 9}
NCCL_OP_CODES = {"SUM": 0, "PROD": 1, "MAX": 2, "MIN": 3, "AVG": 4}


# ============================================================================================
# import hygiene, tables, streams
# ============================================================================================
def test_importing_nccl_module_imports_no_framework_and_no_nccl4py():
    code = (  # a baseline, since cuda-bindings' .pth file imports 'cuda' at interpreter start
        "import sys; before = set(sys.modules); import bagua_x.core.nccl;"
        "bad = sorted(m for m in set(sys.modules) - before"
        "             if m.split('.')[0] in ('torch', 'jax', 'jaxlib', 'nccl', 'cuda', 'cupy'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 0, f"imported at module import time: {out.stdout} {out.stderr}"


def test_reduce_dtype_table_maps_every_nccl_type():
    assert set(N.NCCL_REDUCE_DTYPES.values()) == set(NCCL_DTYPE_CODES)
    for dtype, nccl_name in N.NCCL_REDUCE_DTYPES.items():
        assert nccl_name == dtype.upper()  # int8 -> INT8, bfloat16 -> BFLOAT16, ...
    assert N.COMPLEX_AS_REAL == {"complex64": "float32", "complex128": "float64"}


def test_reduce_op_table_covers_every_reduce_op():
    assert set(N.NCCL_REDUCE_OPS) == set(ReduceOp)
    assert all(name in NCCL_OP_CODES for name in N.NCCL_REDUCE_OPS.values())
    assert N.NCCL_REDUCE_OPS[ReduceOp.AVG] == "AVG"


def test_tables_match_installed_nccl4py():
    nc = pytest.importorskip("nccl.core", reason="nccl4py is not installed")
    pytest.importorskip("nccl.bindings.nccl")
    for nccl_name, code in NCCL_DTYPE_CODES.items():
        assert int(nc.NcclDataType[nccl_name]) == code
    for nccl_name in N.NCCL_REDUCE_OPS.values():
        assert int(nc.NcclRedOp[nccl_name]) == NCCL_OP_CODES[nccl_name]
    assert len(bytes(nc.get_unique_id(empty=True))) == N.UNIQUE_ID_BYTES


def test_dlpack_codes_agree_with_buffer_info():
    a = np.zeros(8, dtype=np.uint8)
    for name in N.DLPACK_DTYPES:
        assert buffer_info(N.DLPackExport(a.ctypes.data, (2,), name, (1, 0), a)).dtype == name


def test_stream_handles():
    class Proto:
        def __cuda_stream__(self):
            return (0, 1234)

    class TorchLike:
        cuda_stream = 99

    assert N.stream_handle(None) == 0
    assert N.stream_handle(7) == 7
    assert N.stream_handle(Proto()) == 1234
    assert N.stream_handle(TorchLike()) == 99
    with pytest.raises(BaguaXError):
        N.stream_handle(True)
    with pytest.raises(BaguaXError, match="cuda_stream"):
        N.stream_handle(object())
    assert N.dlpack_stream(0) == 1 and N.dlpack_stream(1234) == 1234


# ============================================================================================
# DLPack export of bagua_x-owned memory
# ============================================================================================
class _Owner:
    def __init__(self, array):
        self.array = array


def test_dlpack_export_is_zero_copy_and_releases_its_owner_numpy():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    owner = _Owner(a)
    alive = weakref.ref(owner)
    export = N.DLPackExport(a.ctypes.data, a.shape, "float32", (1, 0), owner)
    del owner
    b = np.from_dlpack(export)
    del export
    gc.collect()
    np.testing.assert_array_equal(b, a)
    assert b.ctypes.data == a.ctypes.data and alive() is not None
    del b
    gc.collect()
    assert alive() is None


def test_dlpack_export_unconsumed_capsule_releases_owner():
    a = np.ones(4, dtype=np.int32)
    owner = _Owner(a)
    alive = weakref.ref(owner)
    capsule = N.DLPackExport(a.ctypes.data, a.shape, "int32", (1, 0), owner).__dlpack__()
    del owner
    gc.collect()
    assert alive() is not None
    del capsule
    gc.collect()
    assert alive() is None


def test_dlpack_export_to_torch_and_jax_keeps_dtype_and_shape():
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    src = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    t = torch.from_dlpack(N.DLPackExport(src.data_ptr(), src.shape, "bfloat16", (1, 0), src))
    assert t.dtype == torch.bfloat16 and t.shape == (2, 3) and torch.equal(t, src)
    j = jnp.from_dlpack(N.DLPackExport(src.data_ptr(), src.shape, "bfloat16", (1, 0), src))
    assert j.dtype == jnp.bfloat16 and j.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(j, dtype=np.float32), src.float().numpy())
    e = np.from_dlpack(N.DLPackExport(0, (0, 3), "int32", (1, 0), None))
    assert e.shape == (0, 3)


def test_dlpack_export_refuses_copy_and_unknown_dtype():
    a = np.zeros(2, dtype=np.float32)
    with pytest.raises(BufferError):
        N.DLPackExport(a.ctypes.data, (2,), "float32", (1, 0), a).__dlpack__(copy=True)
    with pytest.raises(BaguaXError):
        N.DLPackExport(a.ctypes.data, (2,), "float8", (1, 0), a)


# ============================================================================================
# unique-id exchange
# ============================================================================================
class DictStore:
    """Thread-safe in-memory store with TCPStore's set/get/check."""

    def __init__(self):
        self._d, self._lock = {}, threading.Lock()

    def set(self, key, value):
        with self._lock:
            self._d[key] = bytes(value)

    def get(self, key):
        with self._lock:
            return self._d[key]

    def check(self, keys):
        with self._lock:
            return all(k in self._d for k in keys)


_TCPSTORE_WORKER = textwrap.dedent(
    """
    import sys, time, datetime
    import torch.distributed as dist
    from bagua_x.core.nccl import exchange_unique_id

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, datetime.timedelta(seconds=30), wait_for_workers=False)
    print("PORT", store.port, flush=True)
    calls = []

    def create():
        calls.append(1)
        if rank != 0:
            raise AssertionError("only rank 0 creates the unique id")
        return bytes(range(128))

    if rank == 0:
        time.sleep(1.0)  # rank 1 is already waiting
    uid = exchange_unique_id(store, rank, "bagua_x/nccl/test/0", create, timeout=20)
    print("UID", uid.hex(), len(calls), flush=True)
    if rank == 0:
        store.get("done")  # keep hosting the store until rank 1 has read the id
    else:
        store.set("done", b"1")
    """
)


def test_unique_id_exchange_over_tcpstore_between_two_processes(tmp_path):
    pytest.importorskip("torch.distributed")
    script = tmp_path / "worker.py"
    script.write_text(_TCPSTORE_WORKER)
    r0 = subprocess.Popen([sys.executable, str(script), "0", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=ENV)
    try:
        first = r0.stdout.readline().split()
        assert first and first[0] == "PORT", first
        r1 = subprocess.run([sys.executable, str(script), "1", first[1]], capture_output=True, text=True,
                            timeout=60, env=ENV)
        out0, err0 = r0.communicate(timeout=60)
    finally:
        if r0.poll() is None:
            r0.kill()
    assert r1.returncode == 0, r1.stderr
    assert r0.returncode == 0, err0
    uid0 = [line.split() for line in out0.splitlines() if line.startswith("UID")][0]
    uid1 = [line.split() for line in r1.stdout.splitlines() if line.startswith("UID")][0]
    assert uid0[1] == uid1[1] == bytes(range(128)).hex()
    assert uid0[2] == "1" and uid1[2] == "0"  # created once, by rank 0


def test_unique_id_exchange_times_out_with_a_clear_error():
    dist = pytest.importorskip("torch.distributed")
    import datetime

    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    with pytest.raises(BaguaXError, match=r"rank 1 waited 0\.3 s .*'bagua_x/nccl/nobody/0'.*rank 0"):
        N.exchange_unique_id(store, 1, "bagua_x/nccl/nobody/0", lambda: b"x" * 128, timeout=0.3)


def test_unique_id_exchange_over_a_duck_typed_jax_client():
    class FakeClient:  # the method names of jax's DistributedRuntimeClient
        def __init__(self):
            self.d = {}

        def key_value_set_bytes(self, key, value, allow_overwrite=False):
            self.d[key] = value

        def key_value_try_get_bytes(self, key):
            if key not in self.d:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.d[key]

    store = N.jax_kv_store(FakeClient())
    assert N.exchange_unique_id(store, 0, "k", lambda: b"\x01" * 128) == b"\x01" * 128
    assert N.exchange_unique_id(store, 1, "k", lambda: b"", timeout=1) == b"\x01" * 128
    with pytest.raises(BaguaXError, match="NOT_FOUND"):
        N.exchange_unique_id(store, 1, "absent", lambda: b"", timeout=0.2)
    with pytest.raises(BaguaXError, match="jax.distributed.initialize"):
        N.jax_kv_store(None)


_JAX_CLIENT_WORKER = textwrap.dedent(
    """
    import socket, sys
    import jax
    from jax._src import distributed
    from bagua_x.core import BaguaXError
    from bagua_x.core.nccl import exchange_unique_id, jax_kv_store

    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0)
    store = jax_kv_store(distributed.global_state.client)
    uid = exchange_unique_id(store, 0, "bagua_x/nccl/jax/0", lambda: bytes(range(128)))
    got = exchange_unique_id(store, 1, "bagua_x/nccl/jax/0", lambda: b"", timeout=10)
    assert got == uid == bytes(range(128)), got
    try:
        exchange_unique_id(store, 1, "bagua_x/nccl/jax/absent", lambda: b"", timeout=0.3)
    except BaguaXError:
        print("OK")
    jax.distributed.shutdown()
    """
)


def test_unique_id_exchange_over_jax_distributed_client(tmp_path):
    pytest.importorskip("jax")
    script = tmp_path / "jax_worker.py"
    script.write_text(_JAX_CLIENT_WORKER)
    env = {**ENV, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


# ============================================================================================
# missing nccl4py
# ============================================================================================
def test_missing_nccl4py_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nccl", None)  # import nccl... -> ImportError even where installed
    monkeypatch.setitem(sys.modules, "nccl.core", None)
    with pytest.raises(BaguaXError, match=r"nccl4py.*pip install 'bagua-x\[nccl\]'"):
        N.NcclCommunicator(0, 1)


def test_bad_rank_is_refused_before_importing_anything():
    with pytest.raises(BaguaXError, match="rank"):
        N.NcclCommunicator(2, 2)


# ============================================================================================
# real NCCL on CUDA
# ============================================================================================
def _rank_data(rank, shape, dtype):
    """Small integers, different on each rank: exact in every float type, bf16 included."""
    n = int(np.prod(shape))
    return ((np.arange(n) * (rank + 1)) % 11 - 5).reshape(shape).astype(dtype)


def _gpu_ops_check(comm, to_dev, to_np, size, rank, integer=False, tol=1e-6):
    """Every collective on this rank vs numpy (``to_dev``: float32 numpy -> device array, ``to_np``: back)."""
    xs = [_rank_data(r, (size, 4, 3), np.float32) for r in range(size)]  # small integers: exact in bf16
    stack = np.stack(xs).astype(np.float64)
    x = to_dev(xs[rank])
    close = dict(rtol=tol, atol=tol)
    mean = np.floor_divide(stack.sum(0), size) if integer else stack.mean(0)
    np.testing.assert_allclose(to_np(comm.allreduce(x)), stack.sum(0), **close)
    np.testing.assert_allclose(to_np(comm.allreduce(x, ReduceOp.AVG)), mean, **close)
    np.testing.assert_allclose(to_np(comm.allreduce(x, ReduceOp.MIN)), stack.min(0), **close)
    np.testing.assert_allclose(to_np(comm.allreduce(x, ReduceOp.MAX)), stack.max(0), **close)
    np.testing.assert_allclose(to_np(comm.allgather(x)), stack, **close)
    np.testing.assert_allclose(to_np(comm.alltoall(x)), stack[:, rank], **close)
    np.testing.assert_allclose(to_np(comm.reduce_scatter(x)), stack.sum(0)[rank], **close)
    np.testing.assert_allclose(to_np(comm.broadcast(x, root=size - 1)), stack[size - 1], **close)
    pairs = [(r, (r + 1) % size) for r in range(size)]
    np.testing.assert_allclose(to_np(comm.permute(x, pairs)), stack[(rank - 1) % size], **close)
    if size == 1:
        only, expected = [(0, 0)], stack[0]
    else:
        only, expected = [(1, 0)], (stack[1] if rank == 0 else np.zeros_like(stack[0]))
    np.testing.assert_allclose(to_np(comm.permute(x, only)), expected)
    np.testing.assert_allclose(to_np(x), stack[rank], **close)  # input untouched


def _nccl_or_skip():
    pytest.importorskip("nccl.core", reason="nccl4py is not installed (pip install 'bagua-x[nccl]')")


@pytest.mark.gpu
def test_gpu_torch_one_rank_every_op():
    _nccl_or_skip()
    import torch

    torch.cuda.set_device(0)
    comm = N.NcclCommunicator(0, 1, device=0, stream=torch.cuda.current_stream())
    try:
        def to_np(t):
            torch.cuda.current_stream().synchronize()
            return t.double().cpu().numpy()

        for tdt in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64):
            _gpu_ops_check(comm, lambda a, tdt=tdt: torch.tensor(a).to("cuda:0", tdt), to_np, 1, 0,
                           integer=not tdt.is_floating_point)
        x = torch.arange(12.0, device="cuda:0", requires_grad=True)
        y = comm.allreduce(x)
        assert y.data_ptr() != x.data_ptr() and torch.equal(y, x.detach())
        c = torch.randn(2, 3, dtype=torch.complex64, device="cuda:0")
        assert torch.allclose(comm.allreduce(c, ReduceOp.AVG), c)
        b = torch.randn(5, device="cuda:0").to(torch.bfloat16)
        assert torch.equal(comm.allreduce(b), b)
    finally:
        comm.close()


@pytest.mark.gpu
def test_gpu_jax_one_rank_every_op():
    _nccl_or_skip()
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend (pip install 'jax[cuda12]')")
    import jax.numpy as jnp

    comm = N.NcclCommunicator(0, 1, device=gpu.id)
    try:
        for dt in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32):
            def to_dev(a, dt=dt):
                return jax.device_put(jnp.asarray(a).astype(dt), gpu)

            def to_np(v):
                assert isinstance(v, jax.Array) and v.devices() == {gpu}
                return np.asarray(v.astype(jnp.float32)).astype(np.float64)

            _gpu_ops_check(comm, to_dev, to_np, 1, 0, integer=dt == jnp.int32)
        x = jax.device_put(jnp.arange(10.0), gpu)
        y = comm.allreduce(x)
        assert y.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
        del y
        gc.collect()
        z = comm.allgather(x) * 2  # results feed jitted code and are freed when dropped
        np.testing.assert_allclose(np.asarray(z), 2 * np.arange(10.0)[None])
    finally:
        comm.close()


_GPU_WORKER = textwrap.dedent(
    """
    import datetime, sys
    import numpy as np
    import torch
    import torch.distributed as dist
    sys.path.insert(0, sys.argv[3])
    import test_core_nccl as T
    from bagua_x.core.nccl import NcclCommunicator

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, datetime.timedelta(seconds=60))
    comm = NcclCommunicator(rank, 2, store, device=rank, stream=torch.cuda.current_stream())
    def to_np(t):
        torch.cuda.synchronize()
        return t.double().cpu().numpy()
    for tdt in (torch.float32, torch.bfloat16, torch.int32):
        T._gpu_ops_check(comm, lambda a: torch.tensor(a).to(f"cuda:{rank}", tdt), to_np, 2, rank,
                         integer=not tdt.is_floating_point)
    comm.close()
    print("OK", rank, flush=True)
    """
)


@pytest.mark.gpu
def test_gpu_two_ranks_every_op(tmp_path):
    _nccl_or_skip()
    import socket

    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    script = tmp_path / "gpu_worker.py"
    script.write_text(_GPU_WORKER)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    here = os.path.dirname(os.path.abspath(__file__))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), here], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=ENV) for r in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"OK {r}" in out, out
