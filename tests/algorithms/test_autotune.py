"""The choice of flat or over nodes by measurement (bagua_x.core.autotune) on simulated ranks: every rank takes
the form the slowest rank's times favour, whatever its own times say."""

import logging
import time

import numpy as np
import pytest

from bagua_x.core.autotune import ROUNDS, choose_form
from bagua_x.core.comm import ReduceOp
from bagua_x.testing import run

# (rank, over nodes) -> seconds a round takes: ranks 0 and 1 alone would pick one form, 2 and 3 the other
SKEWS = {True: {(0, False): 0.06, (1, False): 0.06, (2, True): 0.02, (3, True): 0.02},
         False: {(0, True): 0.06, (1, True): 0.06, (2, False): 0.02, (3, False): 0.02}}


def choose_on_4_ranks(delays, calls=None):
    def fn(comm):
        def do_round(two_level):
            if calls is not None and comm.rank == 0:
                calls.append(two_level)
            time.sleep(delays.get((comm.rank, two_level), 0.0))

        def slowest(values):
            return comm.allreduce(np.asarray(values, np.float64), ReduceOp.MAX).tolist()

        return choose_form(do_round, slowest, "ByteGrad")

    return run(4, fn, timeout=30)[0]


@pytest.mark.parametrize("two_level", [True, False])
def test_every_rank_takes_the_form_the_slowest_times_favour(two_level, caplog):
    with caplog.at_level(logging.INFO, logger="bagua_x"):
        choices = choose_on_4_ranks(SKEWS[two_level])
    assert len(set(choices)) == 1, choices  # the same decision and the same times everywhere
    choice = choices[0]
    assert choice.two_level is two_level
    slow, fast = (choice.flat_seconds, choice.two_level_seconds)[::1 if two_level else -1]
    assert slow >= 0.06 and 0.02 <= fast < 0.06, choice  # each form at its slowest rank's median
    logged = [r.getMessage() for r in caplog.records if "by measurement" in r.getMessage()]
    assert len(logged) == 4 and len(set(logged)) == 1, logged
    assert logged[0].startswith(f"bagua_x: ByteGrad runs {'over nodes' if two_level else 'flat'}, by measurement: "
                                "one reduce of every bucket took ")


def test_rounds_alternate_the_forms_after_one_warm_up_each():
    calls = []
    choose_on_4_ranks({}, calls)
    assert calls == [False, True] * (1 + ROUNDS)


def trial_on_4_ranks(step_seconds):
    """Each rank runs StepTrial's plan, its steps taking ``step_seconds(rank, two_level)`` (no sleeping: the clock
    is advanced by hand); returns every rank's choice and the forms its steps ran in."""
    from bagua_x.core.autotune import StepTrial

    def fn(comm):
        trial, now, forms = StepTrial(), 0.0, []
        while True:
            trial.end(now)
            form = trial.form()
            if form is None:
                break
            now += 0.5  # a switch's own cost, which is not timed
            trial.begin(now)
            forms.append(form)
            now += step_seconds(comm.rank, form)

        def slowest(values):
            return comm.allreduce(np.asarray(values, np.float64), ReduceOp.MAX).tolist()

        return trial.choose(slowest, "LowPrecisionDecentralized"), forms

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
    from bagua_x.core.autotune import StepTrial

    results = trial_on_4_ranks(lambda rank, form: 1.0 if form else 2.0)
    _, forms = results[0]
    assert forms == ([False] * (StepTrial.BLOCK + 1) + [True] * (StepTrial.BLOCK + 1)) * StepTrial.ROUNDS
    assert len(forms) == StepTrial().steps == 12
    choice = results[0][0]
    assert (choice.flat_seconds, choice.two_level_seconds) == (2.0, 1.0)  # switch time excluded
