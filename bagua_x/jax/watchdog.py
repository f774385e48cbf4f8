"""A step watchdog: no silent hang when a JAX process dies or stops calling the step.

Inside a jitted step a stuck collective cannot report anything -- it is what
is stuck -- and XLA gives it no timeout: gloo waits, and JAX's coordination
service aborts every process only after its heartbeat timeout (100 s by
default) with a terse "another task died".  So the watch runs on the host,
around the call of the step (:meth:`~.wrap.DataParallel.step`):

* each process publishes the step it enters in JAX's distributed key-value
  store (one ``key_value_set`` per step; entering step k also says k - 1 was
  left, so no second write), and notes locally when the step returned.  The
  write is a gRPC round trip, too slow to wait for in every step, so a
  publisher thread makes it, coalescing steps: the training thread only
  stores a number and notifies;
* a thread checks, once per poll interval and without any remote call, how
  long the current step has been running; only when that exceeds its limit
  (``timeout``; the first step's below) does it read the other processes'
  keys, write a report (which step, which processes never arrived, the last
  step each one entered) to the log and stderr, and end the process with
  :data:`EXIT_STATUS` through
  ``os._exit`` (the stuck thread cannot be interrupted), so that an elastic
  launcher (``torchrun --max-restarts``) restarts the job from its checkpoint.

Only a step that is still running is reported.  A step that raises -- the
user's exception, a tracing error, KeyboardInterrupt -- is over: the process
lives on, whether or not the caller catches it.  The one exception is a step
whose compiled program fails while a process is gone (gloo reports a closed
connection when a peer's socket closes; the failing process finds a process
that never arrived at the step, or cannot reach the coordinator): the job is
broken, and a process that then exits would still wait in JAX's shutdown
barrier for the dead one (until JAX's heartbeat timeout), so after that
failure's BaguaXError the watchdog stays armed and ends the process
``timeout`` seconds after the step began.

The first step traces and compiles the program, which can take minutes and
involves no other process, so it has its own limit, ``first_step_timeout``
(default: the larger of ``timeout`` and :data:`FIRST_STEP_TIMEOUT`); later
steps have ``timeout``, including a later call that compiles again because
its input shapes changed.

In one process there is nobody to wait for: the watchdog only bounds the step time.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

import jax

__all__ = ["StepWatchdog", "EXIT_STATUS", "FIRST_STEP_TIMEOUT"]

log = logging.getLogger(__name__)

EXIT_STATUS = 1
FIRST_STEP_TIMEOUT = 600.0  # seconds: the least the first step, which compiles, is given by default
READ_TIMEOUT = 5.0  # seconds to wait for the other processes' steps once a report is due

def _distributed_client():
    """JAX's key-value client, or None in a single-process run (no public accessor in jax 0.10)."""
    from jax._src import distributed

    return distributed.global_state.client


class StepWatchdog:
    """Counts steps, publishes them, and ends the process when one runs longer than its limit.

    The limit is ``timeout`` seconds, and ``first_step_timeout`` (default
    ``max(timeout, FIRST_STEP_TIMEOUT)``) for the first step, which compiles.
    """

    def __init__(self, timeout: float, exit: Callable[[int], None] = os._exit,
                 first_step_timeout: Optional[float] = None):
        self.timeout = float(timeout)
        self.first_step_timeout = float(max(self.timeout, FIRST_STEP_TIMEOUT) if first_step_timeout is None
                                        else first_step_timeout)
        self.process, self.processes = jax.process_index(), jax.process_count()
        self._client = _distributed_client() if self.processes > 1 else None
        self._prefix = f"bagua_x/jax_step/{self._count()}/" if self._client is not None else None
        self._exit = exit
        self._lock = threading.Lock()
        self._step = 0  # steps entered so far; the current (or last) one
        self._since: Optional[float] = None  # when the current step was entered; None between steps
        self._failure: Optional[str] = None  # why the current step failed, once it has
        self._thread: Optional[threading.Thread] = None
        self._to_publish = threading.Condition(self._lock)

    def _count(self) -> int:
        """How many watchdogs this process has made in this job, this one included: the same on every process,
        as wraps are made in one order (wrap is collective), and kept in the job's key-value store under the
        process's own key, not in a module."""
        key = f"bagua_x/count/jax_step/{self.process}"
        try:
            count = int(self._client.key_value_try_get(key)) + 1
        except Exception:  # noqa: BLE001 -- NOT_FOUND: the process's first watchdog
            count = 1
        self._client.key_value_set(key, str(count), allow_overwrite=True)
        return count

    @property
    def step(self) -> int:
        return self._step

    def enter(self) -> int:
        """Mark the start of the next step (called on the training thread) and return its number (from 1)."""
        with self._lock:
            self._step += 1
            self._since = time.monotonic()
            self._failure = None
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
        """The current step is over, returned or raised: nothing left to watch until the next one."""
        with self._lock:
            self._since = None
            self._failure = None

    def failed(self, message: str) -> None:
        """The current step failed with a process gone (``message``): stay armed, so a process that cannot
        exit (JAX's shutdown waits for the dead one) is still ended."""
        with self._lock:
            self._failure = message

    def limit(self, step: int) -> float:
        """Seconds step ``step`` (from 1) may run."""
        return self.first_step_timeout if step == 1 else self.timeout

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

    def arrivals(self, step: int) -> tuple[str, bool]:
        """Which processes have not entered ``step`` and the last step each one entered, and whether one is
        gone: it never arrived, or the coordinator (in process 0) cannot be reached."""
        steps = self.last_steps()
        if isinstance(steps, str):
            return steps, True
        if self.processes == 1:
            return "single process: nobody else to wait for", False
        missing = [p for p in range(self.processes) if steps.get(p, 0) < step]
        reached = ", ".join(f"process {p}: {steps[p] if p in steps else 'none'}" for p in range(self.processes))
        return (f"processes that never arrived at step {step}: {missing}; last step each process entered: {reached}",
                bool(missing))

    def report(self, step: int, waited: float) -> str:
        where = f"process {self.process} of {self.processes}" if self.processes > 1 else "a single-process run"
        limit = (f"wrap(timeout={self.timeout:g})" if step > 1 else
                 f"the first step's limit, wrap(first_step_timeout={self.first_step_timeout:g})")
        return (
            f"bagua_x.jax: step {step} has not finished after {waited:.1f} s ({limit}) in "
            f"{where}; {self.arrivals(step)[0]}. A process that never arrived has died or stopped calling the step "
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
            # after a failure the program has run (compiled): the first step's allowance is spent
            if since is None or time.monotonic() - since <= (self.timeout if failure else self.limit(step)):
                continue
            if failure is None:
                message = self.report(step, time.monotonic() - since)  # reads the store: seconds, at worst
            else:
                message = (f"{failure}\nbagua_x.jax: the process is still running {time.monotonic() - since:.1f} s "
                           f"after step {step} began (JAX's shutdown waits for processes that are gone); exiting "
                           f"with status {EXIT_STATUS}.")
            with self._lock:  # the training thread waits in leave() or enter() until this is decided
                if self._since != since or self._failure != failure:
                    continue  # the step ended meanwhile: only a step still running is reported
                log.error(message)
                try:
                    sys.stderr.write(message + "\n")
                    sys.stderr.flush()
                finally:
                    self._exit(EXIT_STATUS)
            return
