"""A step watchdog: no silent hang when a JAX process dies or stops calling the step.

Inside a jitted step a stuck collective cannot report anything -- it is what
is stuck -- and XLA gives it no timeout: gloo waits, and JAX's coordination
service aborts every process only after its heartbeat timeout (100 s by
default) with a terse "another task died".  So the watch runs on the host,
around the call of the step (:meth:`DataParallel.step`):

* each process publishes the step it enters in JAX's distributed key-value
  store (one ``key_value_set`` per step; entering step k also says k - 1 was
  left, so no second write), and notes locally when the step returned.  The
  write is a gRPC round trip (about 1 ms on a loaded 2-core machine), so a
  publisher thread makes it, coalescing steps: the training thread only
  stores a number and notifies;
* a thread checks, once per poll interval and without any remote call, how
  long the current step has been running; only when that exceeds
  ``timeout`` does it read the other processes' keys, write a report (which
  step, which processes never arrived, the last step each one entered) to the
  log and stderr, and end the process with :data:`EXIT_STATUS` through
  ``os._exit`` (the stuck thread cannot be interrupted), so that an elastic
  launcher (``torchrun --max-restarts``) restarts the job from its checkpoint.

A step that fails instead of hanging (gloo reports a closed connection when
the peer's socket closes) raises a BaguaXError with the same facts; the
watchdog stays armed after it, because a process that then exits normally
still waits in JAX's shutdown barrier for the dead process (until JAX's
heartbeat timeout): it ends the process ``timeout`` seconds after the step began.

In one process there is nobody to wait for: the watchdog only bounds the step time.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

import jax

__all__ = ["StepWatchdog", "EXIT_STATUS"]

log = logging.getLogger(__name__)

EXIT_STATUS = 1
READ_TIMEOUT = 5.0  # seconds to wait for the other processes' steps once a report is due

_ids = itertools.count()  # watchdogs are created in the same order on every process (wrap is collective)


def _distributed_client():
    """JAX's key-value client, or None in a single-process run (no public accessor in jax 0.10)."""
    from jax._src import distributed

    return distributed.global_state.client


class StepWatchdog:
    """Counts steps, publishes them, and ends the process when one runs longer than ``timeout`` seconds."""

    def __init__(self, timeout: float, exit: Callable[[int], None] = os._exit):
        self.timeout = float(timeout)
        self.process, self.processes = jax.process_index(), jax.process_count()
        self._client = _distributed_client() if self.processes > 1 else None
        self._prefix = f"bagua_x/jax_step/{next(_ids)}/"
        self._exit = exit
        self._lock = threading.Lock()
        self._step = 0  # steps entered so far; the current (or last) one
        self._since: Optional[float] = None  # when the current step was entered; None between steps
        self._failure: Optional[str] = None  # why the current step failed, once it has
        self._thread: Optional[threading.Thread] = None
        self._to_publish = threading.Condition(self._lock)

    @property
    def step(self) -> int:
        return self._step

    def enter(self) -> int:
        """Mark the start of the next step (called on the training thread) and return its number (from 1)."""
        with self._lock:
            self._step += 1
            self._since = time.monotonic()
            step = self._step
            self._to_publish.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="bagua_x-jax-watchdog", daemon=True)
            self._thread.start()
            if self._client is not None:
                threading.Thread(target=self._publish, name="bagua_x-jax-steps", daemon=True).start()
        return step

    def _publish(self) -> None:
        published = 0
        while True:
            with self._lock:
                self._to_publish.wait_for(lambda: self._step != published)
                step = self._step
            try:
                self._client.key_value_set(f"{self._prefix}{self.process}", str(step), allow_overwrite=True)
            except Exception as e:  # the coordinator is gone: the step will fail or time out and say so
                log.warning("bagua_x.jax watchdog: could not publish step %d: %s", step, e)
            published = step

    def leave(self) -> None:
        with self._lock:
            self._since = None

    def failed(self, message: str) -> None:
        """The current step raised ``message``: stay armed, so a process that cannot exit is still ended."""
        with self._lock:
            self._failure = message

    def last_steps(self) -> dict[int, int] | str:
        """The step each process entered last, or why it could not be read (bounded wait)."""
        if self._client is None:
            return {self.process: self._step}
        found: list = []

        def read():
            try:
                found.append(self._client.key_value_dir_get(self._prefix))
            except Exception as e:
                found.append(e)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(READ_TIMEOUT)
        if not found or isinstance(found[0], Exception):
            why = found[0] if found else f"no answer within {READ_TIMEOUT:.0f} s"
            return (f"could not read the other processes' steps from JAX's coordinator ({why}); the coordinator "
                    "runs in process 0, which has probably died")
        steps = {}
        for key, value in found[0]:
            try:
                steps[int(key.rsplit("/", 1)[-1])] = int(value)
            except ValueError:
                log.warning("bagua_x.jax watchdog: ignoring unexpected key %r = %r", key, value)
        return steps

    def arrivals(self, step: int) -> str:
        """Which processes have not entered ``step``, and the last step each one entered."""
        steps = self.last_steps()
        if isinstance(steps, str):
            return steps
        if self.processes == 1:
            return "single process: nobody else to wait for"
        missing = [p for p in range(self.processes) if steps.get(p, 0) < step]
        reached = ", ".join(f"process {p}: {steps[p] if p in steps else 'none'}" for p in range(self.processes))
        return f"processes that never arrived at step {step}: {missing}; last step each process entered: {reached}"

    def report(self, step: int, waited: float) -> str:
        where = f"process {self.process} of {self.processes}" if self.processes > 1 else "a single-process run"
        return (
            f"bagua_x.jax: step {step} has not finished after {waited:.1f} s (wrap(timeout={self.timeout:g})) in "
            f"{where}; {self.arrivals(step)}. A process that never arrived has died or stopped calling the step "
            "(see its log); with everyone present, a step this slow is a hung device or a timeout too small for "
            f"the step. Exiting with status {EXIT_STATUS} so that an elastic launcher (torchrun --max-restarts) "
            "restarts the job from its last checkpoint."
        )

    def _watch(self) -> None:
        poll = min(1.0, self.timeout / 10)
        while True:
            time.sleep(poll)
            with self._lock:
                since, step, failure = self._since, self._step, self._failure
            if since is None or time.monotonic() - since <= self.timeout:
                continue
            if failure is None:
                message = self.report(step, time.monotonic() - since)
            else:
                message = (f"{failure}\nbagua_x.jax: the process is still running {time.monotonic() - since:.1f} s "
                           f"after step {step} began (JAX's shutdown waits for processes that are gone); exiting "
                           f"with status {EXIT_STATUS}.")
            log.error(message)
            try:
                sys.stderr.write(message + "\n")
                sys.stderr.flush()
            finally:
                self._exit(EXIT_STATUS)
            return
