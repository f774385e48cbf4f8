"""Faults in JAX: the step watchdog, check_finite, and what reaches a process from the network.

Multi-process runs are real processes on 127.0.0.1 (2 processes x 2 CPU
devices) with a hard timeout; :func:`launch_timed` records when each one
exited and with which status, which ``tests/launch.py`` does not report.
"""

import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import bx_jax_fault_workers as fw
from bagua_x.algorithms import GradientAllReduce
from bagua_x.core import BaguaXError
from bagua_x.jax import distributed, wrap
from bagua_x.jax.watchdog import EXIT_STATUS
from launch import ROOT, _WORKER, free_port, run_workers

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": HERE, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
TIMEOUT = 4.0  # wrap(timeout=...) in the runs where a process dies


def launch_timed(target: str, nproc: int, args: tuple, limit: float = 90):
    """Run ``module:function(*args)`` on ``nproc`` ranks; per rank ``(status, exit time, output)``."""
    module, function = target.split(":")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        args_file = os.path.join(tmp, "args.pkl")
        Path(args_file).write_bytes(pickle.dumps(args))
        worker = os.path.join(tmp, "worker.py")
        Path(worker).write_text(_WORKER.format(root=str(ROOT), tests=str(ROOT / "tests")))
        procs = []
        for rank in range(nproc):
            env = {**os.environ, **ENV, "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            out = open(os.path.join(tmp, f"log{rank}"), "w+b")
            procs.append((subprocess.Popen([sys.executable, worker, module, function, args_file,
                                            os.path.join(tmp, f"out{rank}")], stdout=out, stderr=subprocess.STDOUT,
                                           env=env, cwd=str(ROOT)), out))
        ended, deadline = [None] * nproc, time.time() + limit
        while None in ended and time.time() < deadline:
            for i, (p, _) in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.time()
            time.sleep(0.05)
        results = []
        for (p, out), t in zip(procs, ended):
            if t is None:
                p.kill()
                p.wait()
            out.seek(0)
            results.append((p.returncode if t is not None else "hung", t, out.read().decode(errors="replace")))
            out.close()
        return results


def death_time(log: str) -> float:
    return float(re.search(r"DIED (\d+\.\d+)", log).group(1))


# -- the watchdog ----------------------------------------------------------------------------------------------


def test_a_stalled_process_is_reported_and_the_waiting_one_exits():
    """Process 1 stops calling the step before step 6 (1-based) and stays alive: process 0 waits in the
    collective until its watchdog reports and ends it (process 1 is then ended by JAX: its coordinator left)."""
    (status0, end0, log0), (_, _, log1) = launch_timed(
        "bx_jax_fault_workers:train_worker", 2, (40, TIMEOUT, 1, 5, (-1, -1), True))
    assert status0 == EXIT_STATUS, log0[-3000:]
    report = re.search(r"ERROR bagua_x.jax.watchdog: bagua_x.jax: step 6 has not finished after (\S+) s .*", log0)
    assert report, log0[-3000:]
    assert "processes that never arrived at step 6: [1]" in report.group(0)
    assert "last step each process entered: process 0: 6, process 1: 5" in report.group(0)
    assert TIMEOUT < float(report.group(1)) < TIMEOUT + 2
    waited = end0 - death_time(log1)
    print(f"the waiting process exited {waited:.1f} s after its peer stalled (timeout {TIMEOUT} s)")
    assert waited < TIMEOUT + 10


def test_survivor_reports_the_dead_process_and_exits():
    """Process 1 dies before step 5 (0-based; the 6th guarded step): process 0 is stuck in the collective."""
    (status0, end0, log0), (status1, _, log1) = launch_timed(
        "bx_jax_fault_workers:train_worker", 2, (40, TIMEOUT, 1, 5))
    assert status1 == 3, log1[-2000:]
    assert status0 == EXIT_STATUS, log0[-3000:]
    # stuck in the collective (the watchdog's report) or told by gloo that the peer's socket closed (the
    # step's BaguaXError): which one depends on where process 0 was when process 1 went; both name it
    report = re.search(r"step 6 (has not finished after|failed on process 0).*", log0)
    assert report, log0[-3000:]
    assert "processes that never arrived at step 6: [1]" in report.group(0)
    # each process publishes its step from a thread of its own, so the dead one's last step may not have landed
    # before it died: it entered step 5, and step 4 is published at the latest (entering step k says k - 1 ended)
    assert re.search(r"process 0: 6, process 1: [45]\b", report.group(0)), report.group(0)
    print(report.group(1))
    waited = end0 - death_time(log1)
    print(f"survivor exited {waited:.1f} s after its peer died (timeout {TIMEOUT} s)")
    assert waited < TIMEOUT + 10


def test_survivor_of_the_coordinator_exits_at_once():
    """Process 0 dies, and JAX's coordinator with it: JAX terminates process 1 at once with its own message
    ("the leader task ... died"; no missed-heartbeat wait), or gloo's closed connection fails the step first
    and bagua_x's error names it.  Either way no hang, and a non-zero status for the elastic launcher."""
    (status0, _, log0), (status1, end1, log1) = launch_timed(
        "bx_jax_fault_workers:train_worker", 2, (40, TIMEOUT, 0, 5))
    assert status0 == 3, log0[-2000:]
    assert status1 not in (0, "hung"), log1[-3000:]
    assert ("step 6 failed on process 1" in log1 or
            "Terminating process because the JAX distributed service detected fatal errors" in log1), log1[-3000:]
    waited = end1 - death_time(log0)
    print(f"survivor exited {waited:.1f} s after the coordinator died, status {status1}")
    assert waited < TIMEOUT + 10


def test_single_process_watchdog_bounds_the_step_and_gives_the_first_its_own_limit():
    """The first step (compiling) may take longer than ``timeout``; a later one may not."""
    [(status, _, log)] = launch_timed("bx_jax_fault_workers:sleepy_worker", 1, (2.0, None, 3.0), limit=60)
    assert status == EXIT_STATUS, log[-3000:]
    assert "FIRST STEP DONE" in log, log[-3000:]
    assert re.search(r"step 2 has not finished after 2\.\d s \(wrap\(timeout=2\)\) in a single-process run", log), log


def test_a_first_step_past_its_own_limit_is_reported():
    [(status, _, log)] = launch_timed("bx_jax_fault_workers:sleepy_worker", 1, (1.0, 3.0, 600.0), limit=60)
    assert status == EXIT_STATUS, log[-3000:]
    assert re.search(r"step 1 has not finished after 3\.\d s \(the first step's limit, "
                     r"wrap\(first_step_timeout=3\)\) in a single-process run", log), log


@pytest.mark.parametrize("how, caught", [("error", "ValueError"), ("runtime_error", "BaguaXError"),
                                         ("interrupt", "KeyboardInterrupt")])
def test_a_step_that_raises_is_over_and_the_process_lives_on(how, caught):
    """The caller's exception (unchanged), a failure inside the program, Ctrl-C: caught by the caller, whose
    handler then runs for 3 x timeout; no report, no kill, and the next step runs."""
    # timeout 2 s against a Ctrl-C 0.3 s into the step: with 1 s, a machine loaded by other tests once took
    # longer than that to deliver the signal, and the step was reported as still running
    [(status, _, log)] = launch_timed("bx_jax_fault_workers:survivor_worker", 1, (2.0, how), limit=60)
    assert status == 0, log[-3000:]
    assert "has not finished" not in log and "still running" not in log, log[-3000:]
    assert re.findall(r"CAUGHT (\w+)", log) == [caught], log[-3000:]


def test_watchdog_off_leaves_the_step_function_alone():
    fn = jax.pmap(lambda x: x, axis_name="batch")
    assert wrap(fw.tiny_params()).step(fn) is fn


def test_timeout_must_be_positive():
    with pytest.raises(BaguaXError, match="timeout must be a positive"):
        wrap(fw.tiny_params(), timeout=0)


# -- check_finite ---------------------------------------------------------------------------------------------


def _run_tiny(dp, steps, poison_at, guarded=True):
    step = jax.pmap(fw.tiny_step(dp), axis_name="batch")
    step = dp.step(step) if guarded else step
    p, st = dp.replicate(fw.tiny_params()), dp.init()
    for s in range(steps):
        p, st = jax.block_until_ready(step(p, st, *fw.tiny_inputs(s, 4, poison_at, poison_device=2)))
    return p


def test_check_finite_names_the_leaf_and_the_step():
    dp = wrap(fw.tiny_params(), check_finite=True)
    with pytest.raises(BaguaXError, match=r"step 3: reduce_gradients: NaN or inf after the reduction in leaves "
                                          r"\[\"\['a'\]\"\] "):
        _run_tiny(dp, 5, poison_at=2)
    # without dp.step, JAX's error carries the same message; a finite run is unaffected
    with pytest.raises(Exception, match=r"NaN or inf after the reduction in leaves \[\"\['a'\]\"\]"):
        _run_tiny(dp, 5, poison_at=2, guarded=False)
    for x, y in zip(jax.tree.leaves(_run_tiny(dp, 3, poison_at=-1)),
                    jax.tree.leaves(_run_tiny(wrap(fw.tiny_params()), 3, poison_at=-1)), strict=True):
        np.testing.assert_array_equal(x, y)


def test_check_finite_off_adds_nothing_to_the_program():
    def jaxpr(**kw):
        dp = wrap(fw.tiny_params(), **kw)
        p, st = dp.replicate(fw.tiny_params()), dp.init()
        return str(jax.make_jaxpr(jax.pmap(fw.tiny_step(dp), axis_name="batch"))(p, st, *fw.tiny_inputs(0, 4)))

    off = jaxpr(check_finite=False)
    assert off == jaxpr() and "callback" not in off
    assert "debug_callback" in jaxpr(check_finite=True)


def test_check_finite_raises_on_every_process_at_the_same_step():
    results = run_workers("bx_jax_fault_workers:train_worker", nproc=2, timeout=120, env=ENV,
                          args=(6, None, -1, -1, (3, 1)))  # inf in process 1's input at step 3
    for r in results:
        assert r["failed_at"] == 3, results
        assert "step 4: reduce_gradients: NaN or inf" in r["error"] and "['a']" in r["error"], results
        assert "['b']" not in r["error"]


# -- the network: what a process accepts and where it listens ---------------------------------------------------


def test_a_crafted_pickle_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    crafted = pickle.dumps(Exploit())
    pickle.loads(crafted)  # what the old decode path (pickle.loads) would have done: it runs
    assert marker.exists()
    marker.unlink()
    with pytest.raises(BaguaXError, match="the description sent by process 1: received data that is not"):
        distributed.decode_descriptions([b'[["setting", 1]]', crafted])
    assert not marker.exists()


def test_descriptions_compare_equal_after_the_json_round_trip():
    from bagua_x.core import wire
    from bagua_x.core.validation import describe

    entries = describe([("['w']", (2, 3), "float32")], {"hierarchical": (True, None), "lr": 0.5})
    decoded = distributed.decode_descriptions([wire.encode(entries), wire.encode(entries)])
    assert decoded[0] == decoded[1] == entries  # tuples come back as tuples


def test_coordinator_listens_on_master_addr_only_and_timeout_stays_below_the_heartbeat():
    out0, out1 = run_workers("bx_jax_fault_workers:coordinator_worker", nproc=2, timeout=120, env=ENV)
    assert out0["listeners"] == ["127.0.0.1"], out0  # JAX's default would be "::" (every interface)
    assert out1["listeners"] == ["127.0.0.1"]  # the same socket, seen from the other process
    for out in (out0, out1):
        assert "timeout=95 s is not at least 10 s below JAX's heartbeat timeout (100 s)" in out["timeout_95"]
    assert (out0["timeout_5"], out1["timeout_5"]) == (0, 1)


def test_async_model_average_is_refused():
    from bagua_x.algorithms import AsyncModelAverage

    with pytest.raises(BaguaXError, match=r"AsyncModelAverage communicates on a background thread.*torch frontend.*ModelAverage\(period"):
        wrap(fw.tiny_params(), algorithm=AsyncModelAverage())
    wrap(fw.tiny_params(), algorithm=GradientAllReduce())
