"""Workers of test_jax_hierarchical_processes.py: 2 nodes x 2 processes, one CPU device each, jax.distributed with gloo.

Every hierarchical algorithm reduces the same inputs from the same state
``calls`` times over two multi-MB buckets; each process compares every call's
result with tests/algorithms/reference.py itself (shipping millions of floats
back would cost more than the check) and returns, per call and bucket, how far
it was from the reference and a digest of its bytes.  Multi-MB buckets because
gloo's reduce-scatter (behind ``lax.psum_scatter`` on CPU) went wrong only on
large chunks, and only on some of identical calls.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Optional

import numpy as np

from bx_jax_workers import _host_local

LOCAL = 2  # processes (devices) per node
SIZES = (3_000_000, 900_000)  # two buckets (multiples of 4: ByteGrad's alignment)
LR = 0.01


def inputs(seed: int, n: int, scale: float = 1.0) -> list[list[np.ndarray]]:
    """``inputs(...)[rank][bucket]``: each rank's flat float32 values, the same on every process."""
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal(s) * scale).astype(np.float32) for s in SIZES] for _ in range(n)]


def chunk_steps(x: np.ndarray, chunks: int) -> np.ndarray:
    """Each element's quantisation step ((max - min) / 255 of its chunk), ``x`` cut in ``chunks`` equal chunks."""
    from bagua_x.testing.reference import step_size

    return np.repeat([step_size(c) for c in np.split(x, chunks)], len(x) // chunks)


@dataclasses.dataclass
class Case:
    """One algorithm's call on both buckets: ``args`` in, ``want(bucket)`` (every rank's result) out."""

    algorithm: Any
    args: list  # per rank: a tuple with one per-bucket list of arrays for each argument of ``call``
    start: list  # per rank, per bucket: what init sees
    want: Callable[[int], list]
    # (bucket, rank, that rank's wanted result) -> each element's quantisation step, for compressing algorithms
    steps: Optional[Callable[[int, int, np.ndarray], np.ndarray]] = None
    call: str = "reduce"


def cases(n: int) -> dict[str, Case]:
    from algorithms import reference as ref
    from bagua_x import testing
    from bagua_x.algorithms import ByteGrad, Decentralized, GradientAllReduce, LowPrecisionDecentralized, QAdam

    xs = inputs(1, n)
    by_bucket = lambda per_rank: [[r[b] for r in per_rank] for b in range(len(SIZES))]  # noqa: E731
    grads = by_bucket(xs)
    out = {
        "allreduce": Case(GradientAllReduce(hierarchical=True), [(x,) for x in xs], xs,
                          lambda b: testing.reference.allreduce(grads[b])),
        "bytegrad": Case(ByteGrad(hierarchical=True), [(x,) for x in xs], xs,
                         lambda b: ref.bytegrad_hierarchical(grads[b], LOCAL),
                         lambda b, r, want: chunk_steps(want, n)),  # the final chunks: L shards x G nodes
    }
    for mode in ("all", "shift_one"):
        out[f"decentralized_{mode}"] = Case(Decentralized(mode, hierarchical=True), [(x,) for x in xs], xs,
                                            lambda b, m=mode: ref.decentralized_hierarchical(grads[b], LOCAL, m, 0, 1))
    # LowPrecisionDecentralized: every rank starts from the same weights, then each moves a little
    start = inputs(2, 1, 0.1)[0]
    moved = [[s + e for s, e in zip(start, noise)] for noise in inputs(3, n, 0.01)]

    def lowprec(b):
        state = {"w": start[b], "left": start[b], "right": start[b]}
        return ref.low_precision_hierarchical(by_bucket(moved)[b], LOCAL, [state] * (n // LOCAL), 0, 1)[0]

    out["lowprec"] = Case(LowPrecisionDecentralized(hierarchical=True), [(x,) for x in moved], [start] * n, lowprec,
                          lambda b, r, want: chunk_steps(ref.node_means(by_bucket(moved)[b], LOCAL)[r // LOCAL] - start[b], LOCAL))
    # QAdam: a warmup step (gradients averaged over nodes) then a compressed-momentum step, from the same start
    rng = np.random.default_rng(4)
    sign = [np.where(rng.random(s) < 0.5, -1, 1).astype(np.float32) for s in SIZES]  # averages away from 0
    qgrads = [[[(sg * rng.uniform(0.05, 0.15, sg.size)).astype(np.float32) for sg in sign] for _ in range(n)]
              for _ in range(2)]  # [step][rank][bucket]
    params = [(0.5 * rng.standard_normal(s)).astype(np.float32) for s in SIZES]
    out["qadam"] = Case(QAdam(lr=LR, warmup_steps=1, hierarchical=True),
                        [(g1, g2, params) for g1, g2 in zip(*qgrads)], [params] * n,
                        lambda b: [ref.qadam(params[b], [[g[b] for g in qgrads[t]] for t in range(2)], lr=LR,
                                             warmup_steps=1, local=LOCAL)[-1]] * n,
                        call="two_steps")
    return out


def _program(case: Case, layouts):
    """The pmapped call on both buckets: ``(args per bucket, states per bucket) -> results per bucket``."""
    import jax

    from bagua_x.jax import AxisCommunicator

    alg = case.algorithm

    def body(args, states):
        comm = AxisCommunicator("batch")
        outs = []
        for (arg, lay, st) in zip(args, layouts, states):
            if case.call == "reduce":
                outs.append(alg.reduce(arg[0], lay, st, comm)[0])
            else:  # QAdam as dp.optimizer() runs it: two steps, the weights updated in between
                g1, g2, p = arg
                u, st = alg.step(g1, p, lay, st, comm)
                p = p + u
                outs.append(p + alg.step(g2, p, lay, st, comm)[0])
        return outs

    return jax.pmap(body, axis_name="batch")


def refusals() -> dict:
    """What ``reduce_gradients`` with ``ByteGrad(hierarchical=True)`` raises where the axis has no node groups:
    under shard_map, and under pmap with nodes of 3 devices on an axis of 4 (raised while tracing: nothing runs)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from bagua_x.algorithms import ByteGrad
    from bagua_x.core import BaguaXError
    from bagua_x.jax import wrap

    params = {"w": np.zeros(8, np.float32)}
    n = jax.device_count()
    attempts = {
        "shard_map": (2, lambda dp: jax.jit(jax.shard_map(lambda g: dp.reduce_gradients(
            jax.lax.pcast(g, "batch", to="varying"), dp.init_state())[0],
                                                          mesh=jax.make_mesh((n,), ("batch",)), in_specs=P(),
                                                          out_specs=P())).trace(params)),
        "pmap": (3, lambda dp: jax.pmap(lambda g: dp.reduce_gradients(g, dp.init_state())[0], axis_name="batch")(
            {"w": np.zeros((jax.local_device_count(), 8), np.float32)})),
    }
    out = {}
    for where, (per_node, trace) in attempts.items():
        try:
            trace(wrap(params, algorithm=ByteGrad(hierarchical=True), devices_per_node=per_node))
            out[where] = "no error"
        except BaguaXError as e:
            out[where] = str(e)
    return out


def hierarchical_worker(names: list, calls: int) -> dict:
    """For each algorithm in ``names``: per call, per bucket, ``(max error, elements off by more than 1e-6,
    max error in quantisation steps or None, sha1 of the bytes)`` of this process's result."""
    import jax

    import bagua_x.jax as bxj
    from bagua_x.core.bucket import BucketLayout

    bxj.init_distributed()
    results = {}
    try:
        n, rank = jax.device_count(), jax.process_index()
        assert n == 4 and jax.local_device_count() == 1, (n, jax.local_device_count())
        layouts = [BucketLayout(["x"], [(s,)], "float32") for s in SIZES]
        all_cases = cases(n)
        for name in names:
            case = all_cases[name]
            mine = [tuple(a[None] for a in arg) for arg in zip(*case.args[rank])]  # per bucket: its arguments
            states = [case.algorithm.init(x, lay, n) for x, lay in zip(case.start[rank], layouts)]
            states = jax.tree.map(lambda a: np.asarray(a)[None], states)  # numpy: the same state every call
            program = _program(case, layouts)
            wants = [case.want(b)[rank] for b in range(len(SIZES))]
            steps = [None if case.steps is None else case.steps(b, rank, want) for b, want in enumerate(wants)]
            per_call = []
            for _ in range(calls):
                outs = jax.block_until_ready(program(mine, states))
                row = []
                for out, want, step in zip(outs, wants, steps):
                    got = _host_local(out)[0]
                    err = np.abs(got.astype(np.float64) - want)
                    row.append((float(err.max()), int(np.count_nonzero(err > 1e-6)),
                                None if step is None else float((err / step).max()),
                                hashlib.sha1(got.tobytes()).hexdigest()))
                per_call.append(row)
            results[name] = per_call
        results["refusals"] = refusals()
    finally:
        jax.distributed.shutdown()
    return results


# -- hierarchical=None: the form chosen by measurement at wrap ------------------------------------------------------

def _sleep_then(seconds: float, x):
    import time

    time.sleep(seconds)
    return np.asarray(x)


def _slowed(algorithm, delays: dict):
    """``algorithm`` whose compiled ``reduce`` sleeps ``delays[(process, over nodes)]`` seconds after its
    collectives, for programs traced while ``delays`` is not empty: one form slow on some processes only.  Every
    process gets the callback (sleeping 0 s where no delay is given), so all compile the same program: XLA
    fuses around a callback otherwise than without one, which changed results by an ulp across processes."""
    import functools

    import jax

    from bagua_x.core.comm import Feature

    class Slowed(type(algorithm)):
        def reduce(self, flat, layout, state, comm):
            out, state = super().reduce(flat, layout, state, comm)
            delay = delays.get((jax.process_index(), Feature.HIERARCHICAL in comm.features), 0.0)
            if delays:
                out = jax.pure_callback(functools.partial(_sleep_then, delay),
                                        jax.ShapeDtypeStruct(out.shape, out.dtype), out)
            return out, state

    return Slowed(**{f.name: getattr(algorithm, f.name) for f in dataclasses.fields(algorithm)})


class _Records:
    """The messages bagua_x logs at INFO and above while it is installed."""

    def __enter__(self):
        import logging

        self.messages, self.logger = [], logging.getLogger("bagua_x")
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.messages.append(record.getMessage())
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self.handler)
        return self.messages

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


def open_form_worker(name: str, total: int) -> dict:
    """``name`` at hierarchical=None trained without ``dp.step``: its state's form, wrap's log and the training;
    the same training with each form forced."""
    import jax

    import bagua_x.jax as bxj
    from bagua_x import algorithms
    from bagua_x.jax.node_form import FormState
    from bx_jax_workers import make_data, make_params, resumable_pmap

    def wrap(algorithm):
        with _Records() as messages:
            dp = bxj.wrap(params, algorithm=algorithm)
        state = dp.init_state()[0]
        form = (state.over_nodes, int(state.form_code)) if isinstance(state, FormState) else None
        return dp, messages, form

    bxj.init_distributed()
    try:
        rank = jax.process_index()
        base = getattr(algorithms, name)()
        params = make_params(0)
        x, y = make_data(total, 4)
        x, y = x[:, rank:rank + 1], y[:, rank:rank + 1]
        dp, messages, form = wrap(base)
        out = {"form": form, "messages": messages, "full": resumable_pmap(dp, params, x, y, 0, total)}
        for setting in (True, False):
            forced, forced_messages, forced_form = wrap(dataclasses.replace(base, hierarchical=setting))
            out[setting] = (forced_form, forced_messages, resumable_pmap(forced, params, x, y, 0, total))
    finally:
        jax.distributed.shutdown()
    return out


# -- hierarchical=None: whole training steps through dp.step decide -------------------------------------------------

def _codes(state) -> list[tuple[int, int]]:
    """Per bucket of a pmap-layout bagua_x state (this process's device): the form it is set to run (1: over
    nodes) and its code."""
    import jax

    from bagua_x.jax.node_form import FormState

    states = [m for m in jax.tree.leaves(state, is_leaf=lambda m: isinstance(m, FormState))
              if isinstance(m, FormState)]
    return [(int(m.over_nodes), int(_host_local(m.form_code)[0])) for m in states]


def trial_worker(name: str, in_steps: dict, total: int, saves: tuple, directory: str) -> dict:
    """``name`` at hierarchical=None trained through ``dp.step`` for ``total`` steps, one form slowed by
    ``in_steps`` in the training step: per step, the forms and codes in the state (:func:`_codes`) and this
    process's params; the log; checkpoints at the steps in ``saves``.  Then, from each checkpoint, a fresh wrap
    resumes to ``total``."""
    import os

    import jax

    import bagua_x.jax as bxj
    from bagua_x import algorithms
    from bx_jax_workers import make_data, make_params, training_step

    def train(params, x, y, start, load=None):
        with _Records() as messages:
            dp = bxj.wrap(params, algorithm=_slowed(getattr(algorithms, name)(), dict(in_steps)))
            tx, step = training_step(dp, LR)
            f = dp.step(jax.pmap(step, axis_name="batch"))
            carry = (dp.replicate(params), dp.replicate(tx.init(params)), dp.init())
            if load is not None:
                with np.load(load) as saved:
                    leaves = [saved[f"arr_{i}"] for i in range(len(saved.files))]
                carry = jax.tree.unflatten(jax.tree.structure(carry), leaves)
            steps = []
            for s in range(start, total):
                carry = f(*carry, x[s], y[s])
                steps.append((_codes(carry[2]), [_host_local(a) for a in jax.tree.leaves(carry[0])]))
                if load is None and s + 1 in saves:
                    np.savez(os.path.join(directory, f"{s + 1}-{rank}.npz"),
                             *[_host_local(a) for a in jax.tree.leaves(carry)])
        return {"steps": steps, "messages": messages}

    bxj.init_distributed()
    try:
        rank = jax.process_index()
        params = make_params(0)
        x, y = make_data(total, 4)
        x, y = x[:, rank:rank + 1], y[:, rank:rank + 1]
        out = {"full": train(params, x, y, 0)}
        for k in saves:
            out[k] = train(make_params(1), x, y, k, load=os.path.join(directory, f"{k}-{rank}.npz"))
    finally:
        jax.distributed.shutdown()
    return out


def cached_worker(name: str, in_steps: dict, total: int, path: str) -> dict:
    """Three jobs of ``name`` at hierarchical=None through ``dp.step``, the form cache set on process 0 only: the
    first times the forms (slowed by ``in_steps``) and records its decision, the second (alike) checks it, the
    third (every step 0.5 s slower in both forms) times both forms again.  Per job: each step's codes, the log."""
    import os

    import jax

    import bagua_x.jax as bxj
    from bagua_x import algorithms
    from bx_jax_workers import make_data, make_params, training_step

    bxj.init_distributed()
    try:
        rank = jax.process_index()
        if rank == 0:
            os.environ["BAGUA_X_FORM_CACHE"] = path
        params = make_params(0)
        x, y = make_data(total, 4)
        x, y = x[:, rank:rank + 1], y[:, rank:rank + 1]
        out = {}
        for job, extra in (("first", 0.0), ("second", 0.0), ("third", 0.5)):
            with _Records() as messages:
                delays = {(p, form): in_steps.get((p, form), 0.0) + extra for p in range(4) for form in (False, True)}
                dp = bxj.wrap(params, algorithm=_slowed(getattr(algorithms, name)(), delays))
                tx, step = training_step(dp, LR)
                f = dp.step(jax.pmap(step, axis_name="batch"))
                carry = (dp.replicate(params), dp.replicate(tx.init(params)), dp.init())
                codes = []
                for s in range(total):
                    carry = f(*carry, x[s], y[s])
                    codes.append(_codes(carry[2]))
            out[job] = {"codes": codes, "messages": messages}
    finally:
        jax.distributed.shutdown()
    return out


# -- the trial through dp.step with other calls in between ---------------------------------------------------------

def interrupted_worker(in_steps: dict, trial: int, total: int, evals: tuple, raises: tuple) -> dict:
    """LowPrecisionDecentralized at hierarchical=None through ``dp.step`` for ``total`` steps, one form slowed by
    ``in_steps`` in the training step: each step first moves this process's weights by noise of its own (the
    first ``trial`` steps; then none, so the weights can only agree or not), then syncs them.  Before the steps in
    ``evals``, an evaluation through ``dp.step`` (its arguments hold the weights, no bagua_x state); before those
    in ``raises``, a call of the training step that raises before running (a bad batch).  Per step: the codes in
    the state and this process's weights."""
    import jax
    import jax.numpy as jnp

    import bagua_x.jax as bxj
    from bagua_x.algorithms import LowPrecisionDecentralized

    bxj.init_distributed()
    try:
        rank = jax.process_index()
        params = {"w": np.zeros(32, np.float32)}
        noise = np.random.default_rng(rank).standard_normal((total, 1, 32)).astype(np.float32) * 0.01
        noise[trial:] = 0
        dp = bxj.wrap(params, algorithm=_slowed(LowPrecisionDecentralized(), dict(in_steps)))
        sync = jax.pmap(lambda p, s, n: dp.sync_params({"w": p["w"] + n}, s), axis_name="batch")

        def step(p, s, n):
            if n is None:
                raise ValueError("a bad batch")
            return sync(p, s, n)

        train = dp.step(step)
        evaluate = dp.step(jax.pmap(lambda p: jnp.sum(p["w"] ** 2), axis_name="batch"))
        carry, steps = (dp.replicate(params), dp.init()), []
        with _Records() as messages:
            for s in range(total):
                if s in evals:
                    evaluate(carry[0])
                if s in raises:
                    try:
                        train(*carry, None)
                    except ValueError:
                        pass
                carry = train(*carry, noise[s])
                steps.append((_codes(carry[1]), _host_local(carry[0]["w"])))
    finally:
        jax.distributed.shutdown()
    return {"steps": steps, "messages": messages}
