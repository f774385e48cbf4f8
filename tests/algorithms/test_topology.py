"""The choice of flat or over nodes by timing whole steps (bagua_x.core.topology) on simulated ranks: every rank
takes the form the slowest rank's times favour, whatever its own times say."""

import logging

import numpy as np
import pytest

from bagua_x.core.comm import ReduceOp
from bagua_x.testing import run

def trial_on_4_ranks(step_seconds, known=()):
    """Each rank runs StepTrial's plan (checking the ``known`` decisions first), its steps taking
    ``step_seconds(rank, two_level)`` (no sleeping: the clock is advanced by hand), as a frontend drives it;
    returns every rank's choice and the forms its steps ran in."""
    from bagua_x.core.topology import StepTrial

    def fn(comm):
        def slowest(values):
            return comm.allreduce(np.asarray(values, np.float64), ReduceOp.MAX).tolist()

        trial, now, forms = StepTrial(known), 0.0, []
        while True:
            trial.end(now)
            form = trial.form()
            if form is None:
                choice = trial.choose(slowest, "LowPrecisionDecentralized")
                if choice is not None:
                    return choice, forms
                form = trial.form()
            now += 0.5  # a switch's own cost, which is not timed
            trial.begin(now)
            forms.append(form)
            now += step_seconds(comm.rank, form)

    return run(4, fn, timeout=30)[0]


@pytest.mark.parametrize("two_level", [True, False])
def test_step_trial_takes_the_form_of_the_slowest_ranks_median_step(two_level, caplog):
    def seconds(rank, form):  # ranks 0, 1 alone would choose one form, ranks 2, 3 the other
        slow = {(0, not two_level): 0.3, (1, not two_level): 0.3, (2, two_level): 0.2, (3, two_level): 0.2}
        return 0.1 + slow.get((rank, form), 0.0)

    with caplog.at_level(logging.INFO, logger="bagua_x"):
        results = trial_on_4_ranks(seconds)
    choices = [c for c, _ in results]
    assert len(set(choices)) == 1, choices
    choice = choices[0]
    assert choice.two_level is two_level
    assert (choice.two_level_seconds, choice.flat_seconds)[::1 if two_level else -1] == pytest.approx((0.3, 0.4))
    logged = {r.getMessage() for r in caplog.records if "by measurement" in r.getMessage()}
    assert logged == {f"bagua_x: LowPrecisionDecentralized runs {'over nodes' if two_level else 'flat'}, by "
                      f"measurement: a training step took {choice.flat_seconds * 1e3:.2f} ms flat and "
                      f"{choice.two_level_seconds * 1e3:.2f} ms over nodes (median of 4 steps each, slowest rank)"}


def test_step_trial_plan_warms_each_form_then_alternates_blocks_and_times_only_those():
    from bagua_x.core.topology import StepTrial

    results = trial_on_4_ranks(lambda rank, form: 1.0 if form else 2.0)
    _, forms = results[0]
    assert forms == ([False] * (StepTrial.BLOCK + 1) + [True] * (StepTrial.BLOCK + 1)) * StepTrial.ROUNDS
    assert len(forms) == StepTrial().steps == 12
    choice = results[0][0]
    assert (choice.flat_seconds, choice.two_level_seconds) == (2.0, 1.0)  # switch time excluded


# the form cache (bagua_x.core.form_cache): decisions of earlier jobs, checked by timing a block in the latest's form

def _over_nodes_faster(rank, form):  # the slowest rank: 0.4 s flat, 0.3 s over nodes
    return 0.1 + {(0, False): 0.3, (2, True): 0.2}.get((rank, form), 0.0)


def test_a_recorded_decision_that_fits_is_kept_after_one_block_in_its_form(caplog):
    from bagua_x.core.topology import FormChoice, StepTrial

    recorded = FormChoice(True, 0.41, 0.28)  # 0.3 s measured over nodes: within 25 % of 0.28
    with caplog.at_level(logging.INFO, logger="bagua_x"):
        results = trial_on_4_ranks(_over_nodes_faster, [recorded])
    for choice, forms in results:
        assert choice == recorded and forms == [True] * (StepTrial.BLOCK + 1)  # no step flat
    logged = {r.getMessage() for r in caplog.records if "recorded" in r.getMessage()}
    assert logged == {"bagua_x: LowPrecisionDecentralized runs over nodes, as recorded for this topology: a training "
                      "step took 300.00 ms over nodes, recorded 280.00 ms (decided then on 410.00 ms flat and "
                      "280.00 ms over nodes)"}


def test_a_recorded_decision_that_does_not_fit_is_timed_again(caplog):
    from bagua_x.core.topology import FormChoice, StepTrial

    stale = FormChoice(False, 0.31, 0.35)  # the link was faster then: 0.4 s flat is 29 % off 0.31
    with caplog.at_level(logging.INFO, logger="bagua_x"):
        results = trial_on_4_ranks(_over_nodes_faster, [stale])
    block = StepTrial.BLOCK + 1
    for choice, forms in results:
        assert choice.two_level and (choice.flat_seconds, choice.two_level_seconds) == pytest.approx((0.4, 0.3))
        assert forms == [False] * block + ([False] * block + [True] * block) * StepTrial.ROUNDS
    assert any("took 400.00 ms flat, no recorded decision for this topology within 25 % of it (310.00 ms); "
               "timing both forms" in
               r.getMessage() for r in caplog.records)


def test_the_recorded_decision_closest_in_time_is_taken_whichever_form_it_chose():
    from bagua_x.core.topology import FormChoice, StepTrial

    fast_link, slow_link = FormChoice(True, 0.15, 0.12), FormChoice(False, 0.35, 0.33)  # each link's own decision
    results = trial_on_4_ranks(_over_nodes_faster, [fast_link, slow_link])
    for choice, forms in results:  # 0.3 s over nodes: the slow link's, which ran flat
        assert choice == slow_link and forms == [True] * (StepTrial.BLOCK + 1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    from bagua_x.core import form_cache

    file = tmp_path / "sub" / "forms.json"
    monkeypatch.setenv(form_cache.ENV, str(file))
    return file


def test_form_cache_keeps_the_latest_decisions_per_topology(cache):
    from bagua_x.core import form_cache
    from bagua_x.core.topology import FormChoice

    a, b = form_cache.topology(algorithm="ByteGrad()", world=4, local=2), form_cache.topology(world=4, local=1)
    assert form_cache.topology(world=4, local=2, algorithm="ByteGrad()") == a != b  # order of the facts: none
    assert form_cache.load(a) == []  # no file yet
    regimes = [FormChoice(i % 2 == 0, 0.1 * 2 ** i, 0.12 * 2 ** i) for i in range(form_cache.KEEP + 1)]
    for choice in regimes:
        form_cache.record(a, choice)
    form_cache.record(b, regimes[0])
    assert form_cache.load(a) == regimes[::-1][:form_cache.KEEP]  # the latest first, the oldest dropped
    assert form_cache.load(b) == [regimes[0]]
    same_regime = FormChoice(False, regimes[2].flat_seconds * 1.1, regimes[2].two_level_seconds * 0.9)
    form_cache.record(a, same_regime)  # replaces the decision of its own regime, not another's
    assert form_cache.load(a) == [same_regime, regimes[4], regimes[3], regimes[1]]


def test_form_cache_off_unreadable_or_malformed_times_the_forms(cache, monkeypatch, caplog):
    from bagua_x.core import form_cache
    from bagua_x.core.topology import FormChoice

    cache.parent.mkdir()
    cache.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="bagua_x"):
        assert form_cache.load("k") == []
    assert any("cannot be read" in r.getMessage() for r in caplog.records)
    cache.write_text('{"k": [[true, "fast", 0.1]]}')
    assert form_cache.load("k") == []
    form_cache.record("k", FormChoice(True, 0.2, 0.1))  # a malformed file is replaced by a good one
    assert form_cache.load("k") == [FormChoice(True, 0.2, 0.1)]
    monkeypatch.delenv(form_cache.ENV)
    form_cache.record("k", FormChoice(False, 0.1, 0.2))  # off: nothing written, nothing read
    assert form_cache.load("k") == []
    monkeypatch.setenv(form_cache.ENV, str(cache))
    assert form_cache.load("k") == [FormChoice(True, 0.2, 0.1)]


def test_form_cache_share_gives_every_rank_the_first_ranks_decisions():
    from bagua_x.core import form_cache
    from bagua_x.core.topology import FormChoice

    mine = [FormChoice(True, 0.5, 0.25), FormChoice(False, 1.0, 2.0)]

    def fn(comm):
        def slowest(values):
            return comm.allreduce(np.asarray(values, np.float64), ReduceOp.MAX).tolist()

        # other ranks' files may hold other (or more) decisions: only the first rank's count
        theirs = mine if comm.rank == 0 else [FormChoice(False, 9.0, 9.0)] * form_cache.KEEP
        return form_cache.share(theirs, comm.rank == 0, slowest), form_cache.share([], comm.rank == 0, slowest)

    for shared, none in run(4, fn, timeout=30)[0]:
        assert shared == mine and none == []
