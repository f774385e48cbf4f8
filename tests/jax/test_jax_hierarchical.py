"""Hierarchical variants traced by JAX: 4 CPU devices as 2 nodes of 2 under pmap, against the numpy references.

The references (``tests/algorithms/reference.py``) differ from the flat
algorithms' here, so a variant that ran flat would fail; ``wrap`` then trains
with them through ``devices_per_node`` and stays equal to the direct calls.
"""

import re

import jax
import numpy as np
import pytest

from bagua_x import testing
import bx_jax_workers as w
from algorithms import reference as ref
from bagua_x.algorithms import ByteGrad, Decentralized, LowPrecisionDecentralized, QAdam
from bagua_x.jax import AxisCommunicator, wrap
from test_jax_algorithms import assert_close_but_rare_code_flips, flat_layout

N, LOCAL, NUMEL, STEPS = 4, 2, 512, 4


def inputs(step, scale=1.0):
    rng = np.random.default_rng(300 + step)
    return [(rng.normal(size=NUMEL) * scale).astype(np.float32) for _ in range(N)]


def traced(algorithm, first):
    """``algorithm.reduce`` under pmap over 2 nodes of 2 devices, its state kept between calls."""
    layout = flat_layout(NUMEL)
    state = jax.pmap(lambda x: algorithm.init(x, layout, N), axis_name="batch")(np.stack(first))
    step = jax.pmap(lambda x, st: algorithm.reduce(x, layout, st, AxisCommunicator("batch", local_size=LOCAL)),
                    axis_name="batch")

    def call(xs):
        nonlocal state
        out, state = step(np.stack(xs), state)
        return [np.asarray(o) for o in out], state
    return call


@pytest.mark.parametrize("average", [True, False])
def test_bytegrad(average):
    run = traced(ByteGrad(average=average), inputs(0))
    for s in range(STEPS):
        xs = inputs(s)
        got, _ = run(xs)
        want = ref.bytegrad_hierarchical(xs, LOCAL, average)
        flat = ref.bytegrad(xs, average)
        assert len(got) == N
        for r in range(N):
            assert np.array_equal(got[r], got[r - r % LOCAL])  # a node's ranks agree bitwise
            step = max(testing.reference.step_size(c) for c in np.split(want[r], N))
            # XLA vs numpy: float32 rounding (seen <= 4.8e-7 mean, 1.9e-6 sum) and, rarely, a code at a tie
            # (seen: none here; a step is ~0.03)
            assert_close_but_rare_code_flips(got[r], want[r], atol=1e-6 if average else 2.5e-6,
                                             flip_tol=1.01 * step, max_flips=2)
        assert np.abs(want[0] - flat[0]).max() > 1e-3  # the flat algorithm would fail the comparison


def psums(algorithm):
    """The groups of every psum in ``algorithm.reduce``'s traced step on 2 nodes of 2 (``None``: the whole axis)."""
    layout = flat_layout(NUMEL)
    xs = np.stack(inputs(0))
    state = jax.pmap(lambda x: algorithm.init(x, layout, N), axis_name="batch")(xs)
    jaxpr = jax.make_jaxpr(jax.pmap(
        lambda x, st: algorithm.reduce(x, layout, st, AxisCommunicator("batch", local_size=LOCAL)),
        axis_name="batch"))(xs, state)
    return re.findall(r"psum\[axes=\('batch',\) axis_index_groups=(None|\(\(.*?\)\))\]", str(jaxpr))


@pytest.mark.parametrize("mode", ["all", "shift_one"])
def test_decentralized(mode):
    alg = Decentralized(peer_selection_mode=mode)
    run = traced(alg, inputs(0))
    for s in range(STEPS):
        xs = inputs(s)
        got, _ = run(xs)
        for g, want in zip(got, ref.decentralized_hierarchical(xs, LOCAL, mode, s, 1)):
            np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)
    if mode == "all":  # the mean of the node means is the mean: the numbers cannot tell the forms apart, the
        # collectives can -- the average among the nodes runs on one place per node, never on the whole axis
        assert "((0, 2), (1, 3))" in psums(alg) and "None" not in psums(alg), psums(alg)


def test_low_precision_decentralized():
    rng = np.random.default_rng(9)
    xs = [inputs(0, 0.1)[0]] * N  # the same weights everywhere, as after replicate()
    run = traced(LowPrecisionDecentralized(), xs)
    node_states = [{"w": xs[0].copy(), "left": xs[0].copy(), "right": xs[0].copy()} for _ in range(N // LOCAL)]
    for s in range(STEPS):
        moved = [x + 0.01 * rng.normal(size=NUMEL).astype(np.float32) for x in xs]  # each rank's optimizer step
        got, state = run(moved)
        xs, node_states = ref.low_precision_hierarchical(moved, LOCAL, node_states, s, 1)
        for r in range(N):
            step = testing.reference.step_size(xs[r] - node_states[r // LOCAL]["left"] / 3)
            assert_close_but_rare_code_flips(got[r], xs[r], atol=1e-6, flip_tol=0.15 * step, max_flips=1)
            assert_close_but_rare_code_flips(np.asarray(state.left[r]), node_states[r // LOCAL]["left"],
                                             atol=1e-6, flip_tol=0.15 * step, max_flips=1)
        xs = got


def test_qadam_step():
    alg = QAdam(lr=0.01, warmup_steps=1)
    rng = np.random.default_rng(4)
    sign = np.where(rng.random(NUMEL) < 0.5, -1, 1).astype(np.float32)
    grads = [[(sign * rng.uniform(0.05, 0.15, NUMEL)).astype(np.float32) for _ in range(N)] for _ in range(STEPS)]
    start = (rng.standard_normal(NUMEL) * 0.5).astype(np.float32)
    layout = flat_layout(NUMEL)
    state = jax.pmap(lambda x: alg.init(x, layout, N), axis_name="batch")(np.stack([start] * N))
    step = jax.pmap(lambda g, p, st: alg.step(g, p, layout, st, AxisCommunicator("batch", local_size=LOCAL)),
                    axis_name="batch")
    p = np.stack([start] * N)
    want = ref.qadam(start, grads, lr=0.01, warmup_steps=1, local=LOCAL)
    for t in range(STEPS):
        update, state = step(np.stack(grads[t]), p, state)
        p = p + np.asarray(update)
        for r in range(N):
            assert np.abs(p[r] - want[t]).max() <= 1e-6  # XLA float32 Adam vs float64: seen <= 7.2e-7


def test_wrap_trains_hierarchically_with_devices_per_node():
    params = w.make_params(0)
    x, y = w.make_data(40, N, per_device=16, seed=2)
    dp = wrap(params, algorithm=ByteGrad(hierarchical=True), devices_per_node=LOCAL)
    traces = []
    every = w.bagua_pmap(dp, params, x, y, lr=2e-2, every_device=True, traces=traces)
    assert len(traces) == 1
    xe, ye = x[-1].reshape(-1, w.IN), y[-1].reshape(-1, w.OUT)
    start = float(w.loss_fn(params, xe, ye))
    final = [float(w.loss_fn(jax.tree.map(lambda a: a[r], every), xe, ye)) for r in range(N)]
    assert max(final) < 0.1 * start, (start, final)
    for r in range(1, N):  # every rank ends with the same weights (hierarchical ByteGrad is exact across ranks)
        jax.tree.map(lambda a: np.testing.assert_array_equal(a[r], a[0]), every)
    # the traced step holds grouped collectives: the hierarchical path really ran
    grads = dp.replicate(params)
    jaxpr = str(jax.make_jaxpr(jax.pmap(lambda g, s: dp.reduce_gradients(g, s), axis_name="batch"))(
        grads, dp.init()))
    assert "axis_index_groups=((0, 2), (1, 3))" in jaxpr and "axis_index_groups=((0, 1), (2, 3))" in jaxpr
    flat = wrap(params, algorithm=ByteGrad(), devices_per_node=N)  # one node: flat, no groups
    jaxpr = str(jax.make_jaxpr(jax.pmap(lambda g, s: flat.reduce_gradients(g, s), axis_name="batch"))(
        grads, flat.init()))
    assert "axis_index_groups=((" not in jaxpr


def test_hierarchical_true_without_node_groups_is_refused():
    """shard_map (no grouped collectives) and nodes that do not divide the axis: an error, not a flat run."""
    from bx_jax_node_workers import refusals

    got = refusals()
    assert re.fullmatch(r"reduce_gradients: ByteGrad\(average=True, hierarchical=True\) asks for hierarchical=True, "
                        r"but axis 'batch' is a shard_map axis, .* run the step under jax\.pmap for node groups; or "
                        r"pass hierarchical=None .* or hierarchical=False", got["shard_map"]), got
    assert re.fullmatch(r"reduce_gradients: .* but axis 'batch' has 4 devices, which do not split into nodes of 3 "
                        r"\(wrap\(devices_per_node=\.\.\.\), .*\); pass a devices_per_node that divides the axis; or "
                        r"pass hierarchical=None .*", got["pmap"]), got


def test_an_open_form_runs_flat_until_a_trial_and_under_shard_map(caplog):
    """hierarchical=None on node groups: wrap says the step runs flat until dp.step's trial, and the state says
    flat and undecided; without dp.step, under pmap, the step is bitwise the forced flat one (and not the forced
    over-nodes one); shard_map has no node groups, so dp.step times no forms and the step runs flat."""
    from bagua_x.jax.node_form import FormState

    params = w.make_params(0)
    x, y = w.make_data(3, N)
    mesh = jax.make_mesh((N,), ("batch",))
    with caplog.at_level("INFO", logger="bagua_x"):
        open_form = wrap(params, algorithm=ByteGrad(), devices_per_node=LOCAL)
    assert f"bagua_x: ByteGrad runs flat on {N // LOCAL} nodes of {LOCAL} devices until the first 12 steps through " \
        "dp.step have timed both forms; a step not run through dp.step stays flat" in caplog.messages
    state = open_form.init_state()[0]
    assert isinstance(state, FormState) and not state.over_nodes and int(state.form_code) == UNDECIDED
    flat = wrap(params, algorithm=ByteGrad(hierarchical=False), devices_per_node=LOCAL)
    nodes = wrap(params, algorithm=ByteGrad(hierarchical=True), devices_per_node=LOCAL)
    assert not isinstance(flat.init_state()[0], FormState)  # forced: no trial
    got = w.bagua_pmap(open_form, params, x, y)
    jax.tree.map(np.testing.assert_array_equal, got, w.bagua_pmap(flat, params, x, y))
    assert max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(got),
                                                         jax.tree.leaves(w.bagua_pmap(nodes, params, x, y)))) > 0
    got, want = w.bagua_shard_map(open_form, params, x, y, mesh), w.bagua_shard_map(flat, params, x, y, mesh)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    with caplog.at_level("INFO", logger="bagua_x"):
        got = w.bagua_shard_map(open_form, params, x, y, mesh, through_step=True)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert "bagua_x: ByteGrad runs flat: the step has no node groups (shard_map), so the forms are not timed" \
        in caplog.messages, caplog.messages


PLAN = [0, 0, 0, 1, 1, 1]  # the first forms of dp.step's trial (1: over nodes), StepTrial's plan
UNDECIDED = 2


def _codes(state):
    """Each bucket's form code (device 0's) of a FormState, pmap layout."""
    return [int(m.form_code[0]) for m in state]


def test_dp_step_calls_without_bagua_x_state_or_that_raise_are_not_trial_steps(caplog):
    """A call whose arguments hold no bagua_x state (an evaluation, a step that closes over its state) passes
    through, said once, and a call that raises is not counted: neither ends nor advances the trial, so the calls
    holding the state run the plan's steps in order, as without them."""
    dp = wrap(w.make_params(0), algorithm=ByteGrad(), devices_per_node=LOCAL)
    evaluate, train = dp.step(lambda a: a + 1), dp.step(lambda state: state)  # train: returns the state written

    @dp.step
    def fails(state):
        raise ValueError("a bad batch")

    state, forms = dp.init(), []
    with caplog.at_level("INFO", logger="bagua_x"):
        for s in range(len(PLAN)):
            assert evaluate(s) == s + 1
            if s in (1, 3):
                with pytest.raises(ValueError, match="a bad batch"):
                    fails(state)
            state = train(state)
            forms.append([(int(m.over_nodes), _codes([m])[0]) for m in state])
    assert forms == [[(f, UNDECIDED)] for f in PLAN]  # the form set for the step; the code is the step's to write
    assert caplog.messages == ["bagua_x: ByteGrad: a call through dp.step whose arguments hold no bagua_x state of "
                               "this wrap is not a step of the trial of forms (a step that closes over its state "
                               "runs flat)"], caplog.messages


def test_two_wraps_states_through_one_dp_step_are_each_driven_by_their_own_wrap(caplog):
    """Two LowPrecisionDecentralized wraps whose states go through one function: through ``a.step`` alone, the
    trial switches ``a``'s states only, and ``b``'s weights come out bitwise as from the plain calls of the same
    step (its state's form untouched); through ``a.step(b.step(fn))`` each wrap runs its own trial."""
    alg, params = LowPrecisionDecentralized(), {"w": np.zeros(32, np.float32)}
    a, b = (wrap(params, algorithm=alg, devices_per_node=LOCAL) for _ in range(2))
    noise = np.random.default_rng(5).standard_normal((len(PLAN), N, 32)).astype(np.float32) * 0.01

    def step_of(a, b):
        return jax.pmap(lambda pa, sa, pb, sb, n: (*a.sync_params({"w": pa["w"] + n}, sa),
                                                  *b.sync_params({"w": pb["w"] + n}, sb)), axis_name="batch")

    def run(fn):
        carry, codes = (a.replicate(params), a.init(), b.replicate(params), b.init()), []
        for n in noise:
            carry = fn(*carry, n)
            codes.append((_codes(carry[1]), _codes(carry[3])))
        return carry, codes

    step = step_of(a, b)
    plain, _ = run(step)
    with caplog.at_level("INFO", logger="bagua_x"):
        through_a, codes = run(a.step(step))
    assert codes == [([UNDECIDED | f], _codes(b.init())) for f in PLAN]
    np.testing.assert_array_equal(through_a[2]["w"], plain[2]["w"])
    assert np.abs(through_a[0]["w"] - plain[0]["w"]).max() > 0  # a's switched (the forms differ)
    assert any("also hold another wrap's bagua_x states" in m for m in caplog.messages), caplog.messages
    a, b = (wrap(params, algorithm=alg, devices_per_node=LOCAL) for _ in range(2))  # fresh trials
    _, codes = run(a.step(b.step(step_of(a, b))))
    assert codes == [([UNDECIDED | f], [UNDECIDED | f]) for f in PLAN]
