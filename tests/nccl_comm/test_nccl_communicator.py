"""NcclCommunicator (bagua_x.nccl.communicator).

Without a GPU: import hygiene, the missing-nccl4py message, the refusal of a
bad rank and the declared features.  No collective runs without a GPU: there
is no CPU stand-in for NCCL here.  (The rendezvous, streams and dtype tables
have test files of their own; the DLPack export is core's, in
tests/core/test_core_dlpack.py.)

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

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch in GPU tests

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from bagua_x.core import BaguaXError, ReduceOp  # noqa: E402
from bagua_x import nccl as N  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


# ============================================================================================
# import hygiene, features
# ============================================================================================
def test_importing_nccl_package_imports_no_framework_and_no_nccl4py():
    code = (  # a baseline, since cuda-bindings' .pth file imports 'cuda' at interpreter start
        "import sys; before = set(sys.modules); import bagua_x.nccl;"
        "bad = sorted(m for m in set(sys.modules) - before"
        "             if m.split('.')[0] in ('torch', 'jax', 'jaxlib', 'nccl', 'cuda', 'cupy'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 0, f"imported at module import time: {out.stdout} {out.stderr}"


def test_nccl_communicator_declares_no_features():
    comm = object.__new__(N.NcclCommunicator)  # no GPU here: the property needs no state
    assert comm.features == frozenset()


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
def test_gpu_torch_results_from_a_side_stream():
    """NCCL on a stream of its own, torch's current stream kept busy: an integer average (NCCL's sum, then a
    division torch queues on its current stream) reads what NCCL wrote, and a temporary input dropped at once
    is not overwritten by the memory churn that follows on the current stream."""
    _nccl_or_skip()
    import torch

    torch.cuda.set_device(0)
    comm = N.NcclCommunicator(0, 1, device=0, stream=torch.cuda.Stream())
    try:
        results = []
        for i in range(20):
            torch.cuda._sleep(2_000_000)  # NCCL's stream waits for this (the input's producer) first
            results.append(comm.allreduce(torch.full((1 << 20,), i, dtype=torch.int64, device="cuda:0"),
                                          ReduceOp.AVG))
            torch.empty(1 << 21, dtype=torch.int64, device="cuda:0").fill_(-1)  # reuses freed memory
        torch.cuda.synchronize()
        assert [int(r.min()) for r in results] == list(range(20))
        assert [int(r.max()) for r in results] == list(range(20))
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
    import test_nccl_communicator as T
    from bagua_x.nccl import NcclCommunicator

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
