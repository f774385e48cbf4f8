"""``dp.step``: what the host does around each compiled training step.

A compiled step is out of Python's reach while it runs, so three things wait on the host between calls,
each in its own module, and :class:`StepGuard` runs them in order:

* the branch keys (:mod:`.schedule`): each bagua_x state among the call's arguments gets the key of the
  step about to run, so the step compiles one program per key with one branch each;
* the trial of forms (:class:`~.node_form.StepForms`): on node groups at ``hierarchical=None``, the first
  12 steps alternate flat and over nodes, timed, then every process keeps the faster;
* the watchdog (:mod:`.watchdog`, ``wrap(timeout=...)``): a step that does not finish in time ends the
  process with a report of who never arrived; a failed program becomes a BaguaXError naming the step.

Each call waits for the step's results (``jax.block_until_ready``): a step that is only dispatched has not
been through its collectives yet, and only its results say that it has, which a ``with`` block around the
call could not wait for, hence a decorator.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

import jax

from ..core.errors import BaguaXError
from .checks import FiniteCheck
from .distributed import heartbeat_timeout
from .node_form import StepForms
from .schedule import with_keys
from .watchdog import StepWatchdog

__all__ = ["StepGuard", "check_timeouts"]

logger = logging.getLogger(__name__)

HEARTBEAT_MARGIN = 10.0  # seconds between wrap's timeout and JAX's heartbeat abort, for the report to come first


def check_timeouts(timeout: Optional[float], first_step_timeout: Optional[float]) -> None:
    """Raise for settings the watchdog cannot honour (at ``wrap``, before anything is set up)."""
    if first_step_timeout is not None and timeout is None:
        raise BaguaXError("bagua_x.jax.wrap: first_step_timeout is the first step's limit in place of timeout; "
                          "pass timeout=... too, or neither")
    if timeout is not None:
        if not float(timeout) > 0:
            raise BaguaXError(f"bagua_x.jax.wrap: timeout must be a positive number of seconds (or None), "
                              f"got {timeout}")
        if jax.process_count() > 1 and float(timeout) + HEARTBEAT_MARGIN > heartbeat_timeout():
            raise BaguaXError(
                f"bagua_x.jax.wrap: timeout={float(timeout):g} s is not at least {HEARTBEAT_MARGIN:g} s below JAX's "
                f"heartbeat timeout ({heartbeat_timeout():g} s), after which JAX aborts every process with its own "
                "terse message before bagua_x can report; pass a smaller timeout, or a larger "
                "heartbeat_timeout_seconds to bagua_x.jax.init_distributed"
            )
    if first_step_timeout is not None and not float(first_step_timeout) > 0:
        raise BaguaXError(f"bagua_x.jax.wrap: first_step_timeout must be a positive number of seconds (or None), "
                          f"got {first_step_timeout}")


class StepGuard:
    """The host's side of one wrap's steps: see the module docstring; :meth:`guard` is ``dp.step``."""

    def __init__(self, timeout: Optional[float], first_step_timeout: Optional[float], finite: Optional[FiniteCheck],
                 forms: Optional[StepForms], branches: bool):
        self._finite, self._forms, self._branches = finite, forms, branches
        # check_finite alone needs the step count and the failure report, not the time limit
        self._watchdog = (StepWatchdog(float(timeout) if timeout is not None else float("inf"),
                                       first_step_timeout=None if first_step_timeout is None
                                       else float(first_step_timeout))
                          if timeout is not None or finite is not None else None)

    def guard(self, fn: Callable) -> Callable:
        """``fn`` with the host's work around each call, or ``fn`` itself where there is none."""
        watchdog, branches = self._watchdog, self._branches
        if watchdog is None and self._forms is None and not branches:
            return fn

        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            forms = self._forms if self._forms is not None and not self._forms.done else None
            if forms is not None:
                args, kwargs = forms.before(args, kwargs)
            if branches:
                args, kwargs = with_keys(args, kwargs)
            if watchdog is None:
                out = jax.block_until_ready(fn(*args, **kwargs))
            else:
                out = self._watched(watchdog, fn, args, kwargs)
            if forms is not None:
                forms.after()
            return out

        return guarded

    def _watched(self, watchdog: StepWatchdog, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """``fn(*args, **kwargs)``, its results ready, with the watchdog armed for the step."""
        step = watchdog.enter()
        try:
            out = jax.block_until_ready(fn(*args, **kwargs))
        except Exception as e:
            error = self._step_failed(watchdog, step, e)
            if error is None:
                raise
            raise error from e
        except BaseException:  # Ctrl-C (KeyboardInterrupt), SystemExit: the step is over, nothing to report
            watchdog.leave()
            raise
        watchdog.leave()
        return out

    def _step_failed(self, watchdog: StepWatchdog, step: int, e: Exception) -> Optional[BaguaXError]:
        """The error to raise for a step that raised ``e`` (None: ``e`` itself).

        The step is over, so the watchdog lets go, except after a failure of
        the compiled program with a process gone (see :mod:`.watchdog`).
        """
        finite = self._finite.take() if self._finite is not None else None
        if finite is not None or not isinstance(e, jax.errors.JaxRuntimeError):
            # the caller's exception, a tracing error, or check_finite's (raised on every process at this
            # step): nothing is broken, the caller may catch it and go on
            watchdog.leave()
            return None if finite is None else BaguaXError(f"step {step}: {finite}")
        arrivals, gone = watchdog.arrivals(step)
        message = (f"bagua_x.jax: step {step} failed on process {watchdog.process} ({type(e).__name__}: "
                   f"{str(e)[:300]}); {arrivals}. If a process died, see its log; restart "
                   "the job from its last checkpoint (torchrun --max-restarts does it)")
        logger.error("%s", message)
        if gone:
            watchdog.failed(message)  # still armed: JAX's shutdown would wait for the dead process (.watchdog)
        else:
            watchdog.leave()
        return BaguaXError(message)
