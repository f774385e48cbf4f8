"""``@multirank(nproc)``: a test whose body runs on ``nproc`` real processes, assertions inline.

As torch's ``MultiProcessTestCase``: the decorated test starts ``nproc`` processes (tests/launch.py:
127.0.0.1, a free port, a hard timeout), each imports the test's file, initialises torch.distributed
(gloo) and runs the test's body; the first rank to fail is re-raised here with its rank and its
traceback.  So a test reads top to bottom in one place, instead of a worker function returning a dict
of flags that another file asserts.  Inside the body, ``torch.distributed.get_rank()`` says which rank
this is; pytest's parameters and picklable fixtures (``tmp_path``) reach every rank.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import time
import traceback

from launch import run_workers


class RankFailed(AssertionError):
    """The test body failed on a rank: the message carries that rank's traceback."""


def multirank(nproc: int = 2, timeout: float = 120, env: dict | None = None, init_process_group: bool = True):
    """Run the decorated test's body on ``nproc`` processes with torch.distributed (gloo) initialised.

    Args:
        nproc: the number of ranks.
        timeout: seconds for the whole run; a collective still waiting after half of it raises on its rank
            (gloo's timeout), and a rank still running at the end is killed: a hang fails the test.
        env: added to every rank's environment (``LOCAL_WORLD_SIZE``...).
        init_process_group: False leaves torch.distributed uninitialised (for tests of code that initialises
            it from the torchrun-style variables every rank has).
    """
    def decorate(body):
        @functools.wraps(body)
        def test(*args, **kwargs):
            outcomes = run_workers("multirank:run_body", nproc=nproc, timeout=timeout, env=env,
                                   args=(body.__code__.co_filename, body.__qualname__, args, kwargs,
                                         timeout / 2 if init_process_group else None))
            failures = sorted((o[1], rank, o[2]) for rank, o in enumerate(outcomes) if o is not None)
            if failures:
                _, rank, trace = failures[0]
                others = "".join(f"\n--- then rank {r}:\n{t.strip().splitlines()[-1]}" for _, r, t in failures[1:])
                raise RankFailed(f"rank {rank} of {nproc} failed first:\n{trace}{others}")

        return test

    return decorate


def run_body(path: str, qualname: str, args: tuple, kwargs: dict, collective_timeout: float | None):
    """One rank: the test's undecorated body; ``None`` when it passes, ``("failed", time, traceback)`` when it
    fails.  ``collective_timeout``: gloo's, or None to leave torch.distributed uninitialised."""
    import datetime

    import torch.distributed as dist

    import conftest  # noqa: F401 - the sys.path and environment of the pytest run

    spec = importlib.util.spec_from_file_location(f"multirank_{os.path.basename(path)[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    body = functools.reduce(getattr, qualname.split("."), module).__wrapped__
    if collective_timeout is not None:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=collective_timeout))
    try:
        body(*args, **kwargs)
    except BaseException:  # noqa: BLE001 - reported with its rank by the decorator
        return ("failed", time.time(), traceback.format_exc())
    if dist.is_initialized():
        dist.destroy_process_group()
    return None
