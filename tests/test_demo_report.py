"""The demo's report and its choice of network, without running any rank: fast."""

import argparse
import subprocess

import pytest

from bagua_x.apps import demo
from bagua_x.apps.demo_report import plot, summarize, table


def run(frontend, algorithm, evals, step_s=0.5, steps=20):
    return {"frontend": frontend, "algorithm": algorithm, "losses": [2.0 / (1 + i) for i in range(steps)],
            "seconds": [step_s * i for i in range(steps)], "evals": evals, "accuracy": evals[-1][1],
            "step_ms": 1000 * step_s, "bytes_per_step": 1e6}


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


def test_the_figure_is_drawn_with_a_run_that_missed_the_target(tmp_path):
    runs = [run("torch", "allreduce", [[8, 0.95]]), run("torch", "qadam", [[8, 0.2]]),
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
    chosen, said = demo.choose_setting("auto", "1gbit")
    assert chosen == setting and (note in said if note else said == "")


def test_a_setting_that_cannot_be_made_here_is_refused(monkeypatch):
    monkeypatch.setattr(demo.cluster, "missing_prerequisite", lambda: "needs root")
    monkeypatch.setattr(demo, "can_cap", lambda: False)
    with pytest.raises(SystemExit, match="needs root"):
        demo.choose_setting("cluster", "1gbit")
    with pytest.raises(SystemExit, match="root and iproute2"):
        demo.choose_setting("capped", "1gbit")
    assert demo.choose_setting("loopback", "1gbit") == ("loopback", "note: " + demo.LOOPBACK_NOTE)


def _args(*argv):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


def _job_fails_on(monkeypatch, failing):
    """``_job`` as on a root machine where namespaces cannot be made: the settings in ``failing`` raise."""
    errors = {"cluster": demo.cluster.ClusterUnavailable("bagua-x cluster: setting up the namespaces failed"),
              "capped": subprocess.CalledProcessError(1, ["ip", "netns", "add"])}
    tried = []

    def job(frontend, args, setting):
        tried.append(setting)
        if setting in failing:
            raise errors[setting]
        return [{"setting": setting}]

    monkeypatch.setattr(demo, "_job", job)
    monkeypatch.setattr(demo, "can_cap", lambda: True)
    return tried


def test_auto_falls_back_when_the_namespaces_cannot_be_made(monkeypatch, capsys):
    tried = _job_fails_on(monkeypatch, {"cluster", "capped"})
    runs, setting, note = demo.run("torch", _args(), "cluster", "")
    assert tried == ["cluster", "capped", "loopback"] and runs == [{"setting": "loopback"}]
    assert setting == "loopback" and "capped setting could not be made" in note and "uncapped loopback" in note
    assert capsys.readouterr().out.count("bagua-x demo on the digits") == 3


def test_a_requested_setting_that_fails_is_an_error_not_a_fallback(monkeypatch):
    tried = _job_fails_on(monkeypatch, {"cluster"})
    with pytest.raises(SystemExit, match="setting up the namespaces failed"):
        demo.run("torch", _args("--setting", "cluster"), "cluster", "")
    assert tried == ["cluster"]
