"""Stall reports that name the lagging ranks, with no store traffic while training runs.

When a rank dies or stops calling backward, the others block inside a
collective, which cannot say who is missing: it is what is stuck.  Each rank
counts in memory how many times it has launched each bucket (no store traffic
per step: on hundreds of ranks a store write per bucket per step would swamp
the rank hosting the store).  Only when a wait has failed or timed out does a
rank raise an *alarm* in the torch.distributed store: it wakes every rank's
responder.  Each rank keeps one thread blocked on its next wake-up key over a
connection of its own (a clone of the store client, so nothing else waits
behind it); it answers an alarm with its counters, even while its training
thread is stuck or idle.  The alarmed rank waits briefly for the answers and
names the ranks that are behind on the stuck bucket, or that did not answer
at all (dead or frozen).  At interpreter exit the responder is woken with a
stop and joined: a thread left blocked in C++ while Python finalises would
abort the process ("terminate called without an active exception").

Keys carry torchrun's restart count, so a restarted job never reads the
previous attempt's alarms.  Answers are JSON (``core.wire``), checked on arrival.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import logging
import threading
from typing import Optional

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..core.bucket import Bucket
from ..core.errors import BaguaXError
from ..core.wire import decode, encode
from .watchdog import restart_count

__all__ = ["StallInspector", "ANSWER_SECONDS"]

log = logging.getLogger(__name__)

ANSWER_SECONDS = 2.0  # how long an alarmed rank waits for the others' counters
_inspector_ids = itertools.count()  # engines are created in the same order on every rank


class _Counters:
    """This process's launch counts, ``"<inspector>/<bucket>" -> launches``, and the thread that answers alarms."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._responder: Optional[threading.Thread] = None

    def bump(self, key: str) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1

    def get(self, key: str) -> int:
        with self._lock:
            return self._counts.get(key, 0)

    def snapshot(self) -> list:
        with self._lock:
            return sorted(self._counts.items())

    def ensure_responder(self) -> None:
        with self._lock:
            if self._responder is None or not self._responder.is_alive():
                rank, default = dist.get_rank(), c10d._get_default_store()
                # connections of its own: the responder's blocking wait delays nobody, and the stop at exit
                # does not queue behind that wait
                store, control = default.clone(), default.clone()
                self._responder = threading.Thread(target=self._answer_alarms, args=(store, rank),
                                                   name="bagua_x-stall-responder", daemon=True)
                self._responder.start()
                atexit.register(_stop_responder, self._responder, control, rank)

    def _answer_alarms(self, store, rank: int) -> None:
        wake = 1
        while True:
            try:
                store.wait([_wake_key(rank, wake)], datetime.timedelta(days=1))
                message = store.get(_wake_key(rank, wake))
            except Exception:  # noqa: BLE001 -- a long wait expired, or the store has gone
                try:
                    store.check([_wake_key(rank, wake)])
                except Exception:  # noqa: BLE001 -- the job is over (or its store host died): stop answering
                    return
                continue
            wake += 1
            if message == b"stop":
                return
            try:
                store.set(_answer_key(int(message), rank), encode(self.snapshot()))
            except Exception as e:  # noqa: BLE001 -- diagnostics (or a garbled wake-up) must never break training
                log.debug("bagua_x: could not answer stall alarm %r: %s", message[:64], e)


_COUNTERS = _Counters()


def _wake_key(rank: int, k: int) -> str:
    """The ``k``-th wake-up of ``rank``'s responder (an alarm number, or ``stop``)."""
    return f"bagua_x/stall/{restart_count()}/wake/{rank}/{k}"


def _wake(store, rank: int, message: bytes) -> None:
    k = store.add(f"bagua_x/stall/{restart_count()}/wakes/{rank}", 1)
    store.set(_wake_key(rank, k), message)


def _stop_responder(thread: threading.Thread, control, rank: int) -> None:
    try:
        _wake(control, rank, b"stop")
    except Exception:  # noqa: BLE001 -- the store is gone, and with it the responder's wait
        pass
    thread.join(timeout=5)


def _answer_key(n: int, rank: int) -> str:
    return f"bagua_x/stall/{restart_count()}/answer/{n}/{rank}"


def _parse_answer(data: bytes, rank: int) -> dict[str, int]:
    pairs = decode(data, f"rank {rank}'s answer to a stall alarm")
    if not isinstance(pairs, tuple) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and type(p[1]) is int for p in pairs
    ):
        raise BaguaXError(f"rank {rank}'s answer to a stall alarm is not a list of (bucket, count) pairs")
    return dict(pairs)


def collect_counts(ranks: list[int]) -> dict[int, Optional[dict[str, int]]]:
    """Raise an alarm; every rank's counters that arrive within ``ANSWER_SECONDS`` (None: no answer)."""
    store = c10d._get_default_store()
    alarm = store.add(f"bagua_x/stall/{restart_count()}/alarms", 1)
    for r in ranks:
        _wake(store, r, str(alarm).encode())
    keys = [_answer_key(alarm, r) for r in ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=ANSWER_SECONDS))
    except Exception:  # noqa: BLE001 -- some ranks did not answer: reported as such below
        pass
    answers: dict[int, Optional[dict[str, int]]] = {}
    for r, key in zip(ranks, keys):
        answers[r] = _parse_answer(store.get(key), r) if store.check([key]) else None
    return answers


class StallInspector:
    """Launch counters of one engine's buckets on this rank, and the report naming who is behind."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self._ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self._me = dist.get_rank()
        self._name = str(next(_inspector_ids))
        _COUNTERS.ensure_responder()

    def launched(self, bucket: Bucket) -> None:
        """Record that this rank marked ``bucket`` ready once more (called before its collective)."""
        _COUNTERS.bump(f"{self._name}/{bucket.name}")

    def report(self, bucket: Optional[Bucket], stuck: bool = False) -> str:
        """The bucket's tensors and the ranks that had not marked it ready as often as this rank (for errors).

        ``stuck``: the collective did not return; if no rank is behind, say that the collective itself hangs.
        """
        if bucket is None:
            return ""
        key = f"{self._name}/{bucket.name}"
        mine = _COUNTERS.get(key)
        try:
            answers = collect_counts(self._ranks)
        except Exception as e:  # noqa: BLE001
            return (f"; the readiness of other ranks is unknown: the torch.distributed store is unreachable ({e}), "
                    "so the rank hosting it (MASTER_ADDR, usually rank 0) has probably died")
        counts = {r: None if a is None else a.get(key, 0) for r, a in answers.items()}
        behind = [r for r, c in counts.items() if c is None or c < mine]
        tensors = f"; tensors {bucket.layout.names}"
        if not behind:
            return tensors + (f"; every rank marked it ready ({_times(mine)}), so the collective itself hangs: a "
                              "rank died or its network failed (see the other ranks' logs)" if stuck else "")
        seen = ", ".join(f"rank {r}: {_seen(counts[r])}" for r in behind)
        return (f"{tensors}; ranks {behind} had not marked it ready ({seen}; this rank {self._me}: {_times(mine)}): "
                "they died, hang, or skipped a backward / optimizer step that this rank ran")


def _seen(count: Optional[int]) -> str:
    if count is None:
        return f"no answer within {ANSWER_SECONDS:g} s (dead, or its process is frozen)"
    return "never" if count == 0 else _times(count)


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"
