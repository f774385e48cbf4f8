"""Decisions of flat against over nodes, kept across jobs per topology: the trial is run once, not per job.

Opt-in: ``BAGUA_X_FORM_CACHE=path/forms.json`` on the first rank (the only
one that reads and writes the file; the others may set it or not).  A
topology is everything that changes the two forms' programs: the frontend,
the algorithm with its settings, the world and node sizes, the bucket sizes,
the device kind and the library versions (:func:`topology`).  What it cannot
name, the links and the load, is checked by timing instead: a job runs its
first steps in the recorded form and keeps the decision only if a step takes
within :data:`~.topology.FITS` of the recorded time
(:class:`~.topology.StepTrial`); otherwise it times both forms and records the
new decision beside the old.  Up to :data:`KEEP` decisions per topology are
kept, the latest first, so a cluster whose link changes between a few speeds
finds each one's.  Deleting the file forgets them all.

The ranks must take the same branch: :func:`share` sends the first rank's
decisions to every rank through ``slowest`` (a maximum over ranks, which the
frontends already have for the trial): the others send -1, below any time.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Callable, Optional, Sequence

from .topology import FITS, FormChoice

__all__ = ["ENV", "KEEP", "topology", "load", "record", "share"]

log = logging.getLogger(__name__)

ENV = "BAGUA_X_FORM_CACHE"
KEEP = 4  # decisions kept per topology: one per link speed and load seen lately


def path() -> Optional[str]:
    """The cache file, or None when the cache is off."""
    return os.environ.get(ENV) or None


def topology(**facts) -> str:
    """The key of a topology: ``facts`` (JSON values) in a stable order."""
    return json.dumps(facts, sort_keys=True, default=str)


def _read(file: str) -> dict:
    try:
        with open(file) as f:
            table = json.load(f)
        return table if isinstance(table, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("bagua_x: the form cache %s cannot be read (%s); timing the forms as without it", file, e)
        return {}


def _entries(table: dict, key: str, file: str) -> list[FormChoice]:
    try:
        return [FormChoice(bool(two), float(flat), float(over)) for two, flat, over in table.get(key, [])][:KEEP]
    except (TypeError, ValueError) as e:
        log.warning("bagua_x: the form cache %s holds a malformed entry (%s); timing the forms as without it", file, e)
        return []


def load(key: str) -> list[FormChoice]:
    """The decisions recorded for ``key``, latest first (none when the cache is off or has none)."""
    file = path()
    return [] if file is None else _entries(_read(file), key, file)


def record(key: str, choice: FormChoice) -> None:
    """Put ``choice`` first among ``key``'s decisions, dropping any it replaces (both forms' times within
    ``FITS`` of its own: the same regime) and the oldest beyond :data:`KEEP`.  Written atomically."""
    file = path()
    if file is None:
        return
    table = _read(file)
    old = _entries(table, key, file)
    same = [c for c in old if all(abs(c.seconds(f) - choice.seconds(f)) <= FITS * choice.seconds(f)
                                  for f in (False, True))]
    kept = [choice] + [c for c in old if c not in same]
    table[key] = [[c.two_level, c.flat_seconds, c.two_level_seconds] for c in kept[:KEEP]]
    folder = os.path.dirname(os.path.abspath(file))
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as f:
            json.dump(table, f, indent=1)
        os.replace(f.name, file)
    except OSError as e:
        log.warning("bagua_x: the form cache %s cannot be written (%s); this decision is not kept", file, e)


def share(choices: Sequence[FormChoice], first: bool,
          slowest: Callable[[Sequence[float]], Sequence[float]]) -> list[FormChoice]:
    """The first rank's ``choices`` on every rank (collective: every rank calls it; the others' are ignored)."""
    values = [-1.0] * (3 * KEEP)
    if first:
        for i, c in enumerate(choices[:KEEP]):
            values[3 * i:3 * i + 3] = [float(c.two_level), c.flat_seconds, c.two_level_seconds]
    got = list(slowest(values))
    return [FormChoice(got[i] > 0.5, got[i + 1], got[i + 2]) for i in range(0, 3 * KEEP, 3) if got[i] >= 0]
