"""bagua_x.nccl.rendezvous: the NCCL unique-id exchange over a real ``torch.distributed.TCPStore``
between two processes, over JAX's real distributed client, and over a duck-typed client (no GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from bagua_x.core import BaguaXError
from bagua_x.nccl import rendezvous as N

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


_TCPSTORE_WORKER = textwrap.dedent(
    """
    import sys, time, datetime
    import torch.distributed as dist
    from bagua_x.nccl import exchange_unique_id

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


def test_unique_id_keys_count_per_rank_in_the_store_not_in_the_process(monkeypatch):
    """Two jobs (two stores) in one process each count from 0; a torchrun restart counts afresh."""
    dist = pytest.importorskip("torch.distributed")
    import datetime

    def store():
        return dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10), wait_for_workers=False)

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    job_a, job_b = store(), store()
    keys_a0 = [N.next_unique_id_key(job_a, 0, "grad") for _ in range(2)]
    assert keys_a0 == ["bagua_x/nccl/0/grad/0", "bagua_x/nccl/0/grad/1"]
    assert N.next_unique_id_key(job_a, 1, "grad") == "bagua_x/nccl/0/grad/0"  # rank 1's first meets rank 0's first
    assert N.next_unique_id_key(job_a, 0, "node") == "bagua_x/nccl/0/node/0"
    assert N.next_unique_id_key(job_b, 0, "grad") == "bagua_x/nccl/0/grad/0"  # another job shares no count
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert N.next_unique_id_key(job_a, 0, "grad") == "bagua_x/nccl/1/grad/0"
    with pytest.raises(BaguaXError, match=r"dict has no add\(key, amount\).*'grad'.*key=\.\.\."):
        N.next_unique_id_key({}, 0, "grad")


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
    from bagua_x.nccl import exchange_unique_id, jax_kv_store
    from bagua_x.nccl.rendezvous import next_unique_id_key

    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0)
    store = jax_kv_store(distributed.global_state.client)
    uid = exchange_unique_id(store, 0, "bagua_x/nccl/jax/0", lambda: bytes(range(128)))
    got = exchange_unique_id(store, 1, "bagua_x/nccl/jax/0", lambda: b"", timeout=10)
    assert got == uid == bytes(range(128)), got
    keys = [next_unique_id_key(store, 0, "grad") for _ in range(2)] + [next_unique_id_key(store, 1, "grad")]
    assert keys == ["bagua_x/nccl/0/grad/0", "bagua_x/nccl/0/grad/1", "bagua_x/nccl/0/grad/0"], keys
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

