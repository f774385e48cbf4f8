"""Stall reports that name the lagging ranks, with no store traffic while training runs.

When a rank dies or stops calling backward, the others block inside a
collective, which cannot say who is missing: it is what is stuck.  Each rank
counts in memory how many times it has launched each bucket: a store write per
bucket per step would be hundreds of thousands of requests a second on the
rank hosting the store at 256 ranks.  The store is used only once a wait has
timed out or a collective has failed, when the job is over anyway:

* the failing rank sets every rank's *wake* key (one ``multi_set``) and waits
  at most ``ANSWER_SECONDS`` for every rank's *progress* key;
* every rank keeps one *responder* thread blocked on its own wake key; woken,
  it publishes the rank's counters, and from then on the rank republishes them
  at every launch, so a progress key is never older than the rank's last
  launch (counters only grow: a value read later is at most an underestimate);
* the failing rank names the ranks that are behind on the stuck bucket (how
  far each got), or that never answered (dead, exited before the alarm, or
  frozen).  A rank that answered and then exited still counts, by its answer.

Every blocking request runs on a connection of its own (``store.clone()``,
opened by the responder thread when the first engine is built): a TCPStore
client is one socket that serves one request at a time, so a ``wait`` on the
shared default store holds up every other request of the process until it
returns.  That, and ranks that
exited before a later alarm reached them, made an earlier per-alarm design
miss answers at 4 ranks.

At interpreter exit a responder still waiting is told to stop and joined: a
thread left blocked in C++ while Python finalises would abort the process
("terminate called without an active exception").  Keys carry torchrun's
restart count, so a restarted job never reads the previous attempt's keys.
Counters travel as JSON (``core.wire``), checked on arrival.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
from typing import Optional

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..core.bucket import Bucket
from ..core.errors import BaguaXError
from ..core.wire import decode, encode
from .store import restart_count

__all__ = ["StallInspector", "ANSWER_SECONDS"]

log = logging.getLogger(__name__)

ANSWER_SECONDS = 2.0  # how long a failing rank waits for the others' counters
# any other request of a report: a store host that vanished without closing its socket must not hang the rank
_REQUEST_SECONDS = 5.0


def _key(kind: str, rank: int) -> str:
    return f"bagua_x/stall/{restart_count()}/{kind}/{rank}"


class _Progress:
    """This process's launch counts (``"<inspector>/<bucket>" -> launches``), published once a report asks."""

    def __init__(self):
        self._lock = threading.Lock()  # counts and publishing, so a published value never goes back
        self._counts: dict[str, int] = {}
        self._publisher = None  # the responder's connection once woken: counts are then published at each launch
        self._rank = -1
        self.responder: Optional[_Responder] = None

    def start(self) -> None:
        """Start the responder for the current default store (once; again after a new init_process_group)."""
        with self._lock:
            store = c10d._get_default_store()
            if self.responder is None or self.responder.store is not store:
                self._rank, self._publisher = dist.get_rank(), None
                self.responder = _Responder(store, self._rank, self._woken)

    def bump(self, key: str) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1
            if self._publisher is not None:
                self._publish()

    def get(self, key: str) -> int:
        with self._lock:
            return self._counts.get(key, 0)

    def _woken(self, conn) -> None:
        with self._lock:
            self._publisher = conn
            self._publish()

    def _publish(self) -> None:
        try:
            self._publisher.set(_key("progress", self._rank), encode(sorted(self._counts.items())))
        except Exception as e:  # noqa: BLE001 -- diagnostics must never break training
            log.debug("bagua_x: could not publish launch counts for a stall report: %s", e)


class _Responder:
    """A thread that waits for this rank's wake key, and the connection this rank's reports use.

    Both connections are opened on the thread: opening one retries for the
    store's whole timeout (30 min by default) if the store host has just
    exited, which must not hold up wrap() or a report.
    """

    def __init__(self, store, rank: int, on_alarm):
        self.store, self._rank, self._on_alarm = store, rank, on_alarm
        self._reporter = None  # for alarms and the wait for answers
        self._connected = threading.Event()  # set once the connections are open, or could not be
        self._report_lock = threading.Lock()  # one report at a time on that connection
        self._thread = threading.Thread(target=self._run, name="bagua_x-stall-responder", daemon=True)
        self._thread.start()
        atexit.register(self._stop)

    def _run(self) -> None:
        try:
            conn = self.store.clone()
            self._reporter = self.store.clone()
            self._reporter.set_timeout(datetime.timedelta(seconds=_REQUEST_SECONDS))
        except Exception as e:  # noqa: BLE001 -- diagnostics must never break training
            log.warning("bagua_x: stall reports will not say which ranks are behind: could not connect to the "
                        "torch.distributed store (MASTER_ADDR): %s", e)
            return
        finally:
            self._connected.set()
        wake = _key("wake", self._rank)
        while True:
            try:
                conn.wait([wake], datetime.timedelta(days=1))
                message = conn.get(wake)
                break
            except Exception:  # noqa: BLE001 -- a day passed, or the store has gone
                try:
                    conn.check([wake])
                except Exception:  # noqa: BLE001 -- the job is over (or its store host died): stop answering
                    return
        if message != b"stop":
            self._on_alarm(conn)

    def _stop(self) -> None:
        """At exit: wake the thread with ``stop`` if it still waits, and join it (a thread left blocked in C++
        while Python finalises aborts the process)."""
        if not self._thread.is_alive():
            return
        if self._reporter is not None:
            try:
                self._reporter.set(_key("wake", self._rank), b"stop")
            except Exception:  # noqa: BLE001 -- the store is gone, and with it the thread's wait
                pass
        self._thread.join(timeout=5)

    def collect(self, ranks: list[int]) -> dict[int, Optional[dict[str, int]]]:
        """Wake ``ranks``; their counters that are in the store within ``ANSWER_SECONDS`` (None: no answer)."""
        if not self._connected.wait(_REQUEST_SECONDS) or self._reporter is None:
            raise BaguaXError(f"this rank could not connect to the torch.distributed store (MASTER_ADDR) within "
                              f"{_REQUEST_SECONDS:g} s of wrap() to ask the others: its host has probably died")
        if not self._report_lock.acquire(timeout=ANSWER_SECONDS + 3 * _REQUEST_SECONDS):
            raise BaguaXError("another stall report of this rank is still waiting for the torch.distributed store "
                              "(MASTER_ADDR), which may be unreachable; see that report")
        try:
            store = self._reporter
            store.multi_set([_key("wake", r) for r in ranks], [b"alarm"] * len(ranks))
            keys = [_key("progress", r) for r in ranks]
            try:
                store.wait(keys, datetime.timedelta(seconds=ANSWER_SECONDS))
                present = list(zip(ranks, keys))
            except Exception:  # noqa: BLE001 -- some ranks did not answer: reported as such below
                present = [(r, k) for r, k in zip(ranks, keys) if store.check([k])]
            values = store.multi_get([k for _, k in present]) if present else []
        finally:
            self._report_lock.release()
        answers: dict[int, Optional[dict[str, int]]] = dict.fromkeys(ranks)
        for (r, _), data in zip(present, values):
            answers[r] = _parse_answer(data, r)
        return answers


_PROGRESS = _Progress()


def _parse_answer(data: bytes, rank: int) -> dict[str, int]:
    pairs = decode(data, f"rank {rank}'s launch counts for a stall report")
    if not isinstance(pairs, tuple) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and type(p[1]) is int for p in pairs
    ):
        raise BaguaXError(f"rank {rank}'s launch counts for a stall report are not a list of (bucket, count) pairs")
    return dict(pairs)


class StallInspector:
    """Launch counters of one engine's buckets on this rank, and the report naming who is behind."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self._ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self._me = dist.get_rank()
        # the group's name, the same on its every rank (no store request: the store may be gone); engines over one
        # group share a bucket's count, as every rank made the same engines, so the counts still compare
        self._name = c10d._get_process_group_name(group if group is not None else dist.group.WORLD)
        _PROGRESS.start()

    def launched(self, bucket: Bucket) -> None:
        """Record that this rank marked ``bucket`` ready once more (called before its collective)."""
        _PROGRESS.bump(f"{self._name}/{bucket.name}")

    def report(self, bucket: Optional[Bucket], stuck: bool = False) -> str:
        """The bucket's tensors and the ranks that had not marked it ready as often as this rank (for errors).

        ``stuck``: the collective did not return; if no rank is behind, say that the collective itself hangs.
        """
        if bucket is None:
            return ""
        key = f"{self._name}/{bucket.name}"
        mine = _PROGRESS.get(key)
        tensors = f"; tensors {bucket.layout.names}"
        try:
            answers = _PROGRESS.responder.collect(self._ranks)
        except BaguaXError as e:
            return f"{tensors}; the readiness of other ranks is unknown: {e}"
        except Exception as e:  # noqa: BLE001
            return (f"{tensors}; the readiness of other ranks is unknown: the torch.distributed store is unreachable "
                    f"({e}), so the rank hosting it (MASTER_ADDR, usually rank 0) has probably died")
        counts = {r: None if a is None else a.get(key, 0) for r, a in answers.items()}
        behind = [r for r, c in counts.items() if c is None or c < mine]
        if not behind:
            return tensors + (f"; every rank marked it ready ({_times(mine)}), so the collective itself hangs: a "
                              "rank died or its network failed (see the other ranks' logs)" if stuck else "")
        seen = ", ".join(f"rank {r}: {_seen(counts[r])}" for r in behind)
        return (f"{tensors}; ranks {behind} had not marked it ready ({seen}; this rank {self._me}: {_times(mine)}): "
                "they died, hang, or skipped a backward / optimizer step that this rank ran")


def _seen(count: Optional[int]) -> str:
    if count is None:
        return f"no answer within {ANSWER_SECONDS:g} s (dead, exited, or its process is frozen)"
    return "never" if count == 0 else _times(count)


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"
