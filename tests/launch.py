"""Run a Python function on N real local processes (127.0.0.1, free port, hard timeout).

Tests use this instead of mocking collectives.  Each worker gets torchrun-style
variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), runs ``module:function(*args)`` and pickles its return value (or
the exception text) back.  A worker that hangs is killed when the timeout
expires, so a broken collective fails the test instead of stalling CI.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_WORKER = r"""
import importlib, os, pickle, sys, traceback
sys.path[:0] = [{root!r}, {tests!r}]
module, function, args_file, out_file = sys.argv[1:5]
args = pickle.load(open(args_file, "rb"))
try:
    result = ("ok", getattr(importlib.import_module(module), function)(*args))
except BaseException:
    result = ("error", traceback.format_exc())
with open(out_file, "wb") as f:
    pickle.dump(result, f)
if "jax" in sys.modules:  # let JAX's coordinator see every process leave before this one exits
    try:
        sys.modules["jax"].distributed.shutdown()
    except Exception:
        pass
sys.stdout.flush(); sys.stderr.flush()
os._exit(0 if result[0] == "ok" else 1)
"""


def free_port() -> int:
    """A free port whose successor is free too: JAX workers put their coordinator on MASTER_PORT + 1."""
    while True:
        with socket.socket() as s, socket.socket() as t:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            try:
                t.bind(("127.0.0.1", port + 1))
            except (OSError, OverflowError):  # taken, or port 65535
                continue
            return port


class WorkerError(AssertionError):
    pass


def run_workers(target: str, nproc: int = 2, args: tuple = (), timeout: float = 120,
                env: dict | None = None, expect_failure: bool = False, rank_env: dict | None = None):
    """Run ``"module:function"`` on ``nproc`` ranks; return the list of per-rank results.

    ``env`` is added to every rank's environment, then ``rank_env[rank]`` to that
    rank's (e.g. a LOCAL_WORLD_SIZE that differs across ranks).

    With ``expect_failure`` the per-rank outcome is returned as ``("ok"|"error", value)``
    instead of raising, for tests that check error messages.
    """
    module, function = target.split(":")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        args_file = os.path.join(tmp, "args.pkl")
        with open(args_file, "wb") as f:
            pickle.dump(tuple(args), f)
        worker = os.path.join(tmp, "worker.py")
        Path(worker).write_text(_WORKER.format(root=str(ROOT), tests=str(ROOT / "tests")))
        procs, outs = [], []
        for rank in range(nproc):
            out_file = os.path.join(tmp, f"out{rank}.pkl")
            outs.append(out_file)
            penv = dict(os.environ)
            penv.update({
                "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            })
            penv.update(env or {})
            penv.update((rank_env or {}).get(rank, {}))
            procs.append(subprocess.Popen(
                [sys.executable, worker, module, function, args_file, out_file],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=penv, cwd=str(ROOT),
            ))
        logs, timed_out = [], False
        for p in procs:
            try:
                logs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
            except subprocess.TimeoutExpired:
                timed_out = True
                for q in procs:
                    q.kill()
                logs.append(p.communicate()[0].decode(errors="replace"))
        if timed_out:
            raise WorkerError(f"{target} on {nproc} ranks timed out after {timeout}s\n" + "\n".join(logs)[-6000:])
        results = []
        for rank, out_file in enumerate(outs):
            if not os.path.exists(out_file):
                outcome = ("error", f"rank {rank} died without a result:\n{logs[rank][-3000:]}")
            else:
                with open(out_file, "rb") as f:
                    outcome = pickle.load(f)
            results.append(outcome)
        if expect_failure:
            return results
        errors = [f"rank {r}: {v}" for r, (k, v) in enumerate(results) if k != "ok"]
        if errors:
            raise WorkerError(f"{target} failed\n" + "\n".join(errors)[-8000:])
        return [v for _, v in results]
