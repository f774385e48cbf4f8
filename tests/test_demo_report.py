"""The demo's report, its runs' stopping rule and its choice of network, without running any rank: fast."""

import argparse
import math
import subprocess
from types import SimpleNamespace

import pytest

from bagua_x.algorithms import ByteGrad, DiLoCo, ModelAverage
from bagua_x.apps import demo
from bagua_x.apps.demo_report import plot, summarize, table, time_to_target
from bagua_x.apps.demo_run import Plan, exchange_period, plan_for


def run(frontend, algorithm, evals, step_s=0.5, steps=20, link=None, **more):
    return {"frontend": frontend, "algorithm": algorithm, "losses": [2.0 / (1 + i) for i in range(steps)],
            "seconds": [step_s * i for i in range(steps)], "evals": evals, "accuracy": evals[-1][1],
            "step_ms": 1000 * step_s, "bytes_per_step": 1e6, "link": link, **more}


def test_time_to_target_is_the_clock_at_the_first_evaluation_reaching_it():
    runs = [run("torch", "allreduce", [[4, 0.5], [8, 0.91], [12, 0.88], [16, 0.95]]),
            run("torch", "bytegrad", [[4, 0.9], [8, 0.95]], step_s=0.25),
            run("torch", "lowprec", [[4, 0.5], [8, 0.89]]),  # never gets there: no speedup, no crash
            run("jax", "bytegrad", [[5, 0.95]])]  # no allreduce in this frontend: no speedup
    summarize(runs, 0.9)
    assert [r["time_to_target_s"] for r in runs] == [3.5, 0.75, None, 2.0]
    assert runs[0]["speedup_vs_allreduce"] == 1.0
    assert runs[1]["speedup_vs_allreduce"] == pytest.approx(3.5 / 0.75)
    assert runs[2]["speedup_vs_allreduce"] is None and runs[3]["speedup_vs_allreduce"] is None
    text = table(runs, 0.9)
    assert "to 90% acc" in text and "not reached" in text and "4.67x" in text and "3.5 s" in text
    last_ten = sum(2.0 / (1 + i) for i in range(10, 20)) / 10  # the mean of the last 10 losses, not the last one
    assert "final loss" in text and f"{last_ten:10.4f}" in text


def test_at_a_slower_link_the_time_is_the_clock_at_the_reference_step_or_projected_past_the_cap():
    # ran to the reference step (12): the clock there, whatever the evaluations said
    full = run("torch", "diloco", [[12, 0.5]], step_s=0.25, steps=12, link="10mbit", reference_step=12, window=4)
    assert time_to_target(full, 0.9) == (0.25 * 11, False)
    # stopped after 10 steps of a run that reaches the target at step 30: the 20 steps left at the mean step time of
    # the last window (4 steps: one exchange period), not of the whole run
    seconds = [0.0, 1, 2, 3, 4, 5, 6, 7.5, 8, 8.5, 11]  # the period's sync is the slow step
    cut = {**run("torch", "diloco", [[10, 0.5]], steps=len(seconds), link="10mbit", reference_step=30, window=4),
           "seconds": seconds}
    per_step = (11 - 6) / 4
    assert time_to_target(cut, 0.9) == (pytest.approx(11 + (30 - 11) * per_step), True)
    base = run("torch", "allreduce", [[4, 0.5]], step_s=10.0, steps=3, link="10mbit", reference_step=12, window=1)
    runs = [base, cut, full, run("torch", "allreduce", [[12, 0.95]], step_s=0.5, steps=12, link="1gbit")]
    summarize(runs, 0.9)
    # speedups compare runs at one link: the 1 Gbit allreduce is not the 10 Mbit one's baseline
    assert base["time_to_target_s"] == pytest.approx(20 + (12 - 3) * 10) and base["projected"]
    assert cut["speedup_vs_allreduce"] == pytest.approx(110 / (11 + 19 * per_step))
    assert runs[3]["speedup_vs_allreduce"] == 1.0
    text = table(runs, 0.9)
    assert "~110.0 s" in text and "~: projected" in text and "10mbit" in text and "1gbit" in text


def test_a_slower_link_stops_at_the_reference_step_or_at_the_cap_once_settled():
    first = Plan(seconds=3.0, target=0.9, steps=200, eval_every=4)
    assert not first.done(8, 5.0, reached=False) and not first.done(8, 2.0, reached=True)
    assert first.done(8, 3.0, reached=True) and [s for s in range(1, 13) if first.evaluates(s)] == [4, 8, 12]
    slow = Plan(seconds=3.0, target=0.9, steps=200, eval_every=4, reference_step=40, cap=5.0, window=8, lead=13)
    assert slow.settled == 21
    # past the cap but inside the form trial or the exchange period: on, evaluating every step once settled
    assert not slow.done(20, 60.0, reached=False) and slow.done(21, 60.0, reached=False)
    assert not slow.done(30, 4.9, reached=True) and slow.done(40, 0.1, reached=False)
    assert [s for s in range(17, 24) if slow.evaluates(s)] == [20, 21, 22, 23]
    assert Plan(seconds=0, target=0.9, steps=200, eval_every=4, reference_step=6).evaluates(6)


def test_a_run_is_timed_over_one_whole_exchange_period_after_its_form_trial():
    assert exchange_period(DiLoCo(sync_every=8)) == 8 and exchange_period(ModelAverage(period=4)) == 4
    assert exchange_period(ByteGrad()) == 1
    args = SimpleNamespace(seconds=2.0, target=0.9, steps=100, eval_every=4, cap=4.0)
    slow = plan_for(DiLoCo(sync_every=8), args, reference_step=30, trial_steps=0)
    assert (slow.window, slow.lead, slow.cap) == (8, 1, 4.0)
    first = plan_for(ByteGrad(), args, reference_step=None, trial_steps=12)
    assert (first.window, first.lead, first.cap) == (1, 13, math.inf)


def test_the_figure_is_drawn_with_a_run_that_missed_the_target(tmp_path):
    runs = [run("torch", "allreduce", [[8, 0.95]], link="1gbit"), run("torch", "qadam", [[8, 0.2]], link="1gbit"),
            run("torch", "allreduce", [[4, 0.5]], steps=4, link="10mbit", reference_step=8, window=1),
            run("jax", "allreduce", [[8, 1.0]])]
    summarize(runs, 0.9)
    plot(runs, {"torch": "torch title", "jax": "jax title"}, 0.9, tmp_path / "demo.png")
    assert (tmp_path / "demo.png").stat().st_size > 10_000


@pytest.mark.parametrize("why, cap, setting, note", [
    (None, True, "cluster", ""),
    ("needs root", True, "capped", "no cluster here (needs root)"),
    ("needs root", False, "loopback", "uncapped loopback"),
])
def test_auto_takes_the_best_network_this_machine_allows(monkeypatch, why, cap, setting, note):
    monkeypatch.setattr(demo.cluster, "missing_prerequisite", lambda: why)
    monkeypatch.setattr(demo, "can_cap", lambda: cap)
    chosen, said = demo.choose_setting("auto")
    assert chosen == setting and (note in said if note else said == "")


def test_a_setting_that_cannot_be_made_here_is_refused(monkeypatch):
    monkeypatch.setattr(demo.cluster, "missing_prerequisite", lambda: "needs root")
    monkeypatch.setattr(demo, "can_cap", lambda: False)
    with pytest.raises(SystemExit, match="needs root"):
        demo.choose_setting("cluster")
    with pytest.raises(SystemExit, match="root and iproute2"):
        demo.choose_setting("capped")
    assert demo.choose_setting("loopback") == ("loopback", "note: " + demo.LOOPBACK_NOTE)


def _args(*argv):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


def _job_fails_on(monkeypatch, failing):
    """``_job`` as on a root machine where namespaces cannot be made: the settings in ``failing`` raise."""
    errors = {"cluster": demo.cluster.ClusterUnavailable("bagua-x cluster: setting up the namespaces failed"),
              "capped": subprocess.CalledProcessError(1, ["ip", "netns", "add"])}
    tried = []

    def job(frontend, args, setting, link, reference):
        tried.append(setting)
        if setting in failing:
            raise errors[setting]
        return [{"setting": setting}]

    monkeypatch.setattr(demo, "_job", job)
    monkeypatch.setattr(demo, "can_cap", lambda: True)
    return tried


def test_auto_falls_back_when_the_namespaces_cannot_be_made(monkeypatch, capsys):
    tried = _job_fails_on(monkeypatch, {"cluster", "capped"})
    runs, setting, note = demo.run("torch", _args(), "cluster", "", "1gbit")
    assert tried == ["cluster", "capped", "loopback"] and runs == [{"setting": "loopback", "link": None}]
    assert setting == "loopback" and "capped setting could not be made" in note and "uncapped loopback" in note
    assert capsys.readouterr().out.count("bagua-x demo on the digits") == 3


def test_a_requested_setting_that_fails_is_an_error_not_a_fallback(monkeypatch):
    tried = _job_fails_on(monkeypatch, {"cluster"})
    with pytest.raises(SystemExit, match="setting up the namespaces failed"):
        demo.run("torch", _args("--setting", "cluster"), "cluster", "", "1gbit")
    assert tried == ["cluster"]
