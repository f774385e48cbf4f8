"""Worker functions for fault and bad-input tests (import name ``bx_fault_workers``).

Each returns what the test checks, or lets the BaguaXError propagate so that
``run_workers(..., expect_failure=True)`` reports it per rank.
"""

from __future__ import annotations

import os
import time


def _init():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _step(wrapped, opt, backward=True):
    import torch

    opt.zero_grad()
    loss = wrapped(torch.randn(3, 4)).sum()
    if backward:
        loss.backward()
    opt.step()


def rank_dies(algorithm="GradientAllReduce", timeout=5.0, steps_before=3, kwargs=None):
    """Rank 1 exits abruptly after a few steps; rank 0 must raise a BaguaXError within the timeout (DiLoCo with
    ``sync_every`` > ``steps_before``: at its next sync, the first collective after the death)."""
    import torch

    from bagua_x import algorithms
    import bagua_x.torch as bxt

    rank, _ = _init()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    wrapped = bxt.wrap(model, opt, algorithm=getattr(algorithms, algorithm)(**(kwargs or {})), timeout=timeout)
    for _ in range(steps_before):
        _step(wrapped, opt)
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        while time.monotonic() - start < timeout + 10:
            _step(wrapped, opt)
            time.sleep(0.01)  # AsyncModelAverage: let its thread run into the dead peer
    except Exception as e:  # noqa: BLE001 -- the test checks type and message
        return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"type": None, "seconds": time.monotonic() - start}


def rank_skips_backward(timeout=4.0, algorithm="GradientAllReduce", skipper=1):
    """Rank ``skipper`` skips one backward (a weight algorithm: one optimizer step) and then idles: the
    others' last backward (optimizer step) must name the bucket and that rank."""
    import torch

    from bagua_x import algorithms
    import bagua_x.torch as bxt

    rank, _ = _init()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    wrapped = bxt.wrap(model, opt, algorithm=getattr(algorithms, algorithm)(), timeout=timeout)
    start = time.monotonic()
    try:
        for step in range(3):
            if rank == skipper and step == 1 and algorithm == "ModelAverage":
                _step(wrapped, torch.optim.SGD(model.parameters(), lr=0.01))  # not the hooked optimizer
                continue
            _step(wrapped, opt, backward=not (rank == skipper and step == 1))
    except Exception as e:  # noqa: BLE001
        seconds = time.monotonic() - start
        if rank == 0:  # rank 0 hosts the store: stay until the other ranks have their reports too
            time.sleep(4)
        return {"type": type(e).__name__, "message": str(e), "seconds": seconds}
    if rank == skipper:
        time.sleep(timeout + 6)  # alive but not communicating ("not ready", not dead) while the others report
    return {"type": None}


def bad_input(case):
    """wrap() or the first steps on a bad model: the BaguaXError message (same on every rank)."""
    import torch

    from bagua_x.algorithms import ModelAverage
    from bagua_x.core import BaguaXError
    import bagua_x.torch as bxt

    _init()
    torch.manual_seed(0)
    try:
        if case == "complex":
            model = torch.nn.Linear(3, 3)
            model.weight = torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.complex64))
            bxt.wrap(model)
        elif case == "sparse":
            bxt.wrap(torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2)))
        elif case == "sparse_at_backward":
            model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
            wrapped = bxt.wrap(model)
            model[0].sparse = True  # after wrap: only backward can tell
            wrapped(torch.tensor([1, 2])).sum().backward()
        elif case == "devices":
            model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3, device="meta"))
            bxt.wrap(model)
        elif case == "shape":
            model = torch.nn.Linear(4, 4)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            wrapped = bxt.wrap(model, opt, algorithm=ModelAverage())
            model.weight.data = torch.zeros(4, 5)  # re-pointed by the user to a differently shaped tensor
            wrapped(torch.randn(3, 5)).sum().backward()
            opt.step()
        elif case == "nonfinite":
            model = torch.nn.Linear(4, 2)
            wrapped = bxt.wrap(model, check_finite=True)
            x = torch.ones(3, 4)
            if torch.distributed.get_rank() == 1:
                x[0, 0] = float("nan")
            wrapped(x).sum().backward()
        elif case == "nonfinite_off":
            model = torch.nn.Linear(4, 2)
            wrapped = bxt.wrap(model)
            wrapped(torch.full((3, 4), float("inf"))).sum().backward()
            return None
    except BaguaXError as e:
        return str(e)
    return "no error"



def nonfinite_weights(name, kwargs, timeout=20.0):
    """A weight algorithm with check_finite; rank 1 alone gets a NaN weight before step 1's forward.
    Returns (step, message, seconds since wrap) of the BaguaXError this rank raised, or None."""
    import torch

    import bagua_x.torch as bxt
    from bagua_x import algorithms
    from bagua_x.core.errors import BaguaXError

    rank, _ = _init()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = bxt.wrap(model, opt, algorithm=getattr(algorithms, name)(**kwargs), check_finite=True, timeout=timeout)
    start = time.monotonic()
    for step in range(4):
        if rank == 1 and step == 1:
            with torch.no_grad():
                model[2].weight[0, 0] = float("nan")
        try:
            _step(wrapped, opt)
        except BaguaXError as e:
            return step, str(e), time.monotonic() - start
    return None
def qadam_switch_mismatch(timeout=4.0):
    """Rank 1's QAdam optimizer is past warmup (as if it loaded a later checkpoint), rank 0's is not."""
    import bagua_x.torch as bxt

    rank, _ = _init()
    model = _model()
    opt = bxt.QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=2)
    wrapped = bxt.wrap(model, opt, timeout=timeout)
    if rank == 1:
        opt.step_id = 5
    try:
        _step(wrapped, opt)
    except Exception as e:  # noqa: BLE001
        if rank == 0:
            time.sleep(3)  # rank 0 hosts the store: stay until rank 1's check has timed out too
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None}


def qadam_switch_agrees():
    """Both ranks cross the end of warmup: the store-based bucket check passes and training goes on."""
    import bagua_x.torch as bxt

    _init()
    model = _model()
    opt = bxt.QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=2)
    wrapped = bxt.wrap(model, opt, bucket_cap_mb=5e-5)
    for _ in range(4):
        _step(wrapped, opt)
    return [b.name for b in wrapped.buckets]


class _Planted:
    """A pickle that, if ever unpickled, creates the file at ``path`` (what an attacker's payload would do)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def crafted_pickle_refused(marker):
    """Rank 1 plays an attacker with access to the store and the process group; rank 0 runs bagua_x's checks.

    Returns rank 0's two error messages (the model check at wrap, the store check QAdam uses).
    """
    import pickle

    import torch
    import torch.distributed as dist

    import bagua_x.torch as bxt
    from bagua_x.core.errors import BaguaXError
    from bagua_x.torch.distributed import allgather_bytes, check_same_buckets, private_group
    from bagua_x.torch.node_form import agree_on_nodes
    from bagua_x.torch.store import restart_count

    rank, _ = _init()
    payload = pickle.dumps(_Planted(marker))
    out = {}
    if rank == 1:
        group = private_group(None, 20.0)  # wrap's own group, made first
        agree_on_nodes(group, False)  # passes wrap's node check, as GradientAllReduce would
        allgather_bytes(payload, group, torch.device("cpu"))  # where wrap() gathers model descriptions
        # rank 1's key in rank 0's first bucket check over the default group (named "0"; store.check_tag)
        dist.distributed_c10d._get_default_store().set(f"bagua_x/check/{restart_count()}/0/buckets/1/1", payload)
        dist.barrier()
        return out
    try:
        bxt.wrap(_model())
    except BaguaXError as e:
        out["wrap"] = str(e)
    try:
        check_same_buckets([], {}, None, 20, "bucket check")
    except BaguaXError as e:
        out["store"] = str(e)
    dist.barrier()
    return out


class _CountingStore:
    """A torch.distributed store that records the name of every request made through it or its clones."""

    def __init__(self, store, calls):
        self._store, self._calls = store, calls

    def clone(self):
        self._calls.append("clone")
        return _CountingStore(self._store.clone(), self._calls)

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def request(*args, **kwargs):
            self._calls.append(name)
            return attr(*args, **kwargs)
        return request


def store_requests_during_training(steps=20):
    """The store requests bagua_x makes during ``steps`` training steps of a gradient, a decentralized and a
    weight-averaging engine (several buckets each), after one warm-up step."""
    import torch
    import torch.distributed as dist

    import bagua_x.torch as bxt
    from bagua_x.algorithms import Decentralized, GradientAllReduce, ModelAverage

    _init()
    c10d = dist.distributed_c10d
    calls = []
    counting = _CountingStore(c10d._get_default_store(), calls)
    c10d._get_default_store = lambda: counting  # where bagua_x gets the store from
    wrapped = []
    for algorithm in (GradientAllReduce(), Decentralized(), ModelAverage()):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        wrapped.append((bxt.wrap(model, opt, algorithm=algorithm, bucket_cap_mb=5e-5), opt))
    for w, opt in wrapped:
        _step(w, opt)
    deadline = time.monotonic() + 30
    while "wait" not in calls and time.monotonic() < deadline:  # the responder thread has started waiting
        time.sleep(0.05)
    dist.barrier()
    before = len(calls)
    for _ in range(steps):
        for w, opt in wrapped:
            _step(w, opt)
    dist.barrier()
    return {"setup": sorted(set(calls[:before])), "during": calls[before:],
            "buckets": sum(len(w.buckets) for w, _ in wrapped)}


def store_host_gone_before_inspector():
    """Rank 0, the store's host, exits; then rank 1 builds a StallInspector (as wrap() does for each engine) and
    asks it for a stall report: how long each took, and the report."""
    import torch.distributed as dist

    from bagua_x.algorithms.base import Target
    from bagua_x.core.bucket import Bucket
    from bagua_x.torch.engine.registration import register_parameters
    from bagua_x.torch.stall import StallInspector

    rank, _ = _init()
    dist.barrier()
    if rank == 0:
        os._exit(0)
    time.sleep(1)
    bucket = Bucket("weight_bucket_0", register_parameters(list(_model().named_parameters()), Target.WEIGHT))
    start = time.monotonic()
    inspector = StallInspector(None)
    built = time.monotonic()
    message = inspector.report(bucket, stuck=True)
    return {"build_s": built - start, "report_s": time.monotonic() - built, "message": message}


def ft_without_lighthouse():
    """wrap with fault tolerance while no lighthouse listens (FaultTolerance(timeout=2))."""
    import torch

    import bagua_x.torch as bxt

    _init()
    model = _model()
    bxt.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), fault_tolerance=bxt.FaultTolerance(timeout=2))
