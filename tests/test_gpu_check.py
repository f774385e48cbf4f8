"""benchmarks/gpu_check.py's CPU dry run: every check's code runs here first, so the minutes on a GPU machine
are not spent finding a typo; and the driver's verdict (a failing check fails the run)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU_ONLY = {0, 3, 5, 6, 8, 11, 13}  # nothing of these is judged without CUDA


def _driver(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(400)
def test_cpu_dry_run_runs_every_check_and_fails_none(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", str(out)],
                          capture_output=True, text=True, timeout=360, cwd=ROOT, env={**os.environ, "OUT": ""})
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "cpu dry run"
    assert report["machine"]["torch"] and report["machine"]["cuda"] is False
    checks = {c["number"]: c for c in report["checks"]}
    assert sorted(checks) == list(range(14))
    for c in checks.values():
        assert c["name"] and c["criterion"] and isinstance(c["values"], dict) and "seconds" in c
    failed = {n: c.get("problems") or c.get("traceback") for n, c in checks.items() if c["status"] == "fail"}
    assert not failed
    assert {n for n, c in checks.items() if c["status"] == "needs GPU"} == GPU_ONLY
    assert all(checks[n]["status"] == "pass" for n in set(checks) - GPU_ONLY)

    # what the stand-ins measured, not only that they ran
    assert checks[1]["values"]["max_diff"] <= 1e-6 and all(checks[1]["values"]["views"])
    algorithms = checks[2]["values"]
    assert len([k for k in algorithms if k != "parameters"]) == 8
    assert all(len(v["losses"]) == 5 for k, v in algorithms.items() if k != "parameters")
    assert algorithms["ByteGrad"]["error_in_steps"] <= 1.0
    hang = checks[9]["values"]["rank 0"]
    assert hang["raised"] == "BaguaXError" and hang["seconds"] <= 4.0
    assert all(v == "ran" for k, v in checks[10]["values"].items() if "map" in k)
    assert set(checks[12]["values"]) == {"rank 0", "rank 1"}
    assert "needs GPU" in proc.stdout and "PASS" in proc.stdout


def test_a_failing_check_fails_the_run_with_its_traceback(tmp_path, monkeypatch):
    driver = _driver(monkeypatch)
    broken = driver.Check(99, "broken", "never", "json:loads", 60, "json.loads('cpu') raises")
    monkeypatch.setattr(driver, "CHECKS", [broken])
    out = tmp_path / "results.json"
    assert driver.main(["--cpu", str(out)]) == 1
    (entry,) = json.loads(out.read_text())["checks"]
    assert entry["status"] == "fail" and "JSONDecodeError" in entry["traceback"]


def test_a_spent_budget_fails_the_checks_left(tmp_path, monkeypatch):
    driver = _driver(monkeypatch)
    monkeypatch.setattr(driver, "CHECKS", [driver.CHECKS[1]])
    out = tmp_path / "results.json"
    assert driver.main(["--cpu", "--budget", "1", str(out)]) == 1
    (entry,) = json.loads(out.read_text())["checks"]
    assert entry["status"] == "fail" and "budget" in entry["problems"][0]


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_on_the_gpu_no_host_sync_and_state_across_streams(tmp_path):
    """On CUDA: check 3 (no host sync: PowerSGD and the DDP comm hook included) and check 13 (algorithm state
    made on the compute stream, read on the communication stream, memory churned meanwhile) pass."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--only", "3,13", str(out)],
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert {c["number"]: c["status"] for c in json.loads(out.read_text())["checks"]} == {3: "pass", 13: "pass"}
