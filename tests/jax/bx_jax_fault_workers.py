"""Workers of test_jax_faults.py: 2 processes x 2 CPU devices (or one process), started by the tests.

A small model whose two leaves get separate gradients: ``a``'s gradient is
the input ``x`` and ``b``'s is ``z``, so a non-finite ``x`` poisons exactly
leaf ``['a']``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
import time

import numpy as np

from bx_jax_workers import _multiprocess


def tiny_params():
    return {"a": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)}


def tiny_step(dp):
    """The pmapped step: gradients of ``sum(a*x) + sum(b*z)`` reduced by ``dp``, then SGD."""
    import jax

    def step(p, st, x, z):
        g = jax.grad(lambda q: (q["a"] * x).sum() + (q["b"] * z).sum())(p)
        g, st = dp.reduce_gradients(g, st)
        return jax.tree.map(lambda w, d: w - 0.1 * d, p, g), st

    return step


def tiny_inputs(step: int, ndev: int, poison_at: int = -1, poison_device: int = 0):
    rng = np.random.default_rng(step)
    x = rng.normal(size=(ndev, 3)).astype(np.float32)
    z = rng.normal(size=(ndev, 2)).astype(np.float32)
    if step == poison_at:
        x[poison_device, 1] = np.inf
    return x, z


def _log_with_times():
    logging.basicConfig(level=logging.WARNING, format="%(created).3f %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


def train(steps: int, timeout: float | None, die: int = -1, die_at: int = -1, poison: tuple = (-1, -1),
          stall: bool = False):
    """``steps`` guarded steps; process ``die`` exits abruptly (or with ``stall`` stops calling the step)
    before step ``die_at``; inf injected at ``poison = (step, process)``.  Returns the steps done, or the
    BaguaXError's step and text."""
    import jax

    import bagua_x.jax as bxj
    from bagua_x.core import BaguaXError

    _log_with_times()
    rank, ndev = jax.process_index(), jax.local_device_count()
    dp = bxj.wrap(tiny_params(), timeout=timeout, check_finite=poison[0] >= 0)
    train_step = dp.step(jax.pmap(tiny_step(dp), axis_name="batch"))
    p, st = dp.replicate(tiny_params()), dp.init()
    for s in range(steps):
        if rank == die and s == die_at:
            print(f"DIED {time.time():.3f}", flush=True)
            if stall:
                time.sleep(600)
            os._exit(3)
        x, z = tiny_inputs(s, ndev, *((poison[0], 0) if rank == poison[1] else (-1, 0)))
        try:
            p, st = train_step(p, st, x, z)
        except BaguaXError as e:
            if die >= 0:  # as in a training script: the error ends the process
                raise
            return {"failed_at": s, "error": str(e)}
    return {"done": steps}


@_multiprocess
def train_worker(*args):
    return train(*args)


def sleepy_worker(timeout: float, first_step_timeout: float | None, first: float):
    """One process: a first step of ``first`` seconds (as if compiling), then a "step" that never returns in
    time (the watchdog must end the process)."""
    import bagua_x.jax as bxj

    _log_with_times()
    limits = {} if first_step_timeout is None else {"first_step_timeout": first_step_timeout}
    dp = bxj.wrap(tiny_params(), timeout=timeout, **limits)
    dp.step(lambda: time.sleep(first))()
    print(f"FIRST STEP DONE {time.time():.3f}", flush=True)
    dp.step(lambda: time.sleep(600))()
    return "the step returned"


def raising_step(how: str):
    """A step that raises: the caller's exception, a failure inside the compiled program, or Ctrl-C."""
    import signal
    import threading

    import jax

    if how == "error":
        raise ValueError("the caller's own error")
    if how == "runtime_error":
        def fail(x):
            raise ValueError("a host callback failed")
        return jax.jit(lambda x: jax.debug.callback(fail, x) or x)(np.ones(3))
    # a process started with SIGINT ignored (inherited from a launcher) would never see the Ctrl-C
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C while the step runs
    time.sleep(30)


def survivor_worker(timeout: float, how: str):
    """One process: a step that raises (see :func:`raising_step`), caught as a training script would, then
    3 x ``timeout`` of the caller's own work (a save handler).  The process must live through it."""
    import bagua_x.jax as bxj

    _log_with_times()
    dp = bxj.wrap(tiny_params(), timeout=timeout)
    dp.step(lambda: None)()
    try:
        dp.step(raising_step)(how)
    except BaseException as e:  # noqa: BLE001 - what reaches the caller is the result
        print(f"CAUGHT {type(e).__name__}", flush=True)
    time.sleep(3 * timeout)
    dp.step(lambda: None)()  # and the next step runs as usual
    return "alive"


def _listeners(port: int) -> list[str]:
    """Local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    # 32-bit words in host (little-endian) order; gRPC listens on IPv4 as ::ffff:a.b.c.d
                    raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
                    ip = ipaddress.ip_address(raw)
                    found.append(str(getattr(ip, "ipv4_mapped", None) or ip))
    return found


@_multiprocess
def coordinator_worker():
    """Where the coordinator listens, and wrap's check of the timeout against the heartbeat."""
    import jax

    import bagua_x.jax as bxj
    from bagua_x.core import BaguaXError

    out = {"listeners": _listeners(int(os.environ["MASTER_PORT"]) + 1)}
    try:
        bxj.wrap(tiny_params(), timeout=95)
        out["timeout_95"] = "accepted"
    except BaguaXError as e:
        out["timeout_95"] = str(e)
    out["timeout_5"] = bxj.wrap(tiny_params(), timeout=5).step(lambda: jax.process_index())()
    return out
