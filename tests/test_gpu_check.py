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


MULTI_GPU_ONLY = {20, 25, 26, 27}  # their criteria are timings, placement or host syncs on GPUs


@pytest.mark.timeout(600)
def test_the_multi_gpu_dry_run_judges_what_needs_no_gpu(tmp_path):
    """``--gpus 4 --cpu``: 4 gloo processes (one process of 4 CPU devices for check 30); the checks of
    numbers pass and say what they measured, the GPU-only ones say "needs 4 GPUs" without failing the run."""
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--gpus", "4", str(out)],
                          capture_output=True, text=True, timeout=560, cwd=ROOT, env={**os.environ, "OUT": ""})
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["gpus_asked"] == 4
    checks = {c["number"]: c for c in report["checks"]}
    assert sorted(checks) == list(range(20, 31))
    assert {n for n, c in checks.items() if c["status"] == "needs 4 GPUs"} == MULTI_GPU_ONLY
    assert all(checks[n]["status"] == "pass" for n in set(checks) - MULTI_GPU_ONLY), \
        {n: c.get("problems") for n, c in checks.items()}
    ranks = [f"rank {r}" for r in range(4)]
    assert sorted(checks[21]["values"]) == ranks
    for r in ranks:
        parity = checks[21]["values"][r]
        assert parity["world_size"] == 4 and parity["head_moved"] > 0 and parity["max_diff"] <= 1e-3 * parity["moved"]
        algorithms = checks[22]["values"][r]
        assert len(algorithms) == 10 and algorithms["AsyncModelAverage"]["rounds"] >= 3
        assert algorithms["ByteGrad"]["quantisation_step"] > 0 and algorithms["GradientAllReduce"]["max_error"] <= 1e-5
        assert checks[23]["values"][r]["ByteGrad"]["equal_in_node"]
    assert [checks[23]["values"][r]["within"] for r in ranks] == [[0, 2], [1, 2], [0, 2], [1, 2]]
    killed = [checks[28]["values"][r] for r in ranks[:3]]  # rank 3 is the one killed: no result
    assert sorted(checks[28]["values"]) == ranks[:3]
    assert all(k["raised"] == "BaguaXError" and k["seconds"] <= 12 for k in killed), killed
    processes, devices = checks[29]["values"]["rank 0"], checks[30]["values"]
    assert (processes["processes"], processes["local_devices"]) == (4, 1)
    assert (devices["processes"], devices["local_devices"]) == (1, 4)
    for jax_run in (processes, devices):
        assert len([k for k, v in jax_run.items() if isinstance(v, dict)]) == 9


def summing_communicator(mode):
    """Checks 21 and 22 with a communicator that sums where a mean was asked (a plausible bug)."""
    import gpu_check_multi
    from bagua_x.core import ReduceOp
    from bagua_x.torch import TorchCommunicator

    allreduce = TorchCommunicator.allreduce
    TorchCommunicator.allreduce = lambda self, x, op=ReduceOp.SUM: allreduce(self, x, ReduceOp.SUM)
    parity, algorithms = gpu_check_multi.ddp_parity(mode), gpu_check_multi.every_algorithm(mode)
    return {"values": {}, "problems": parity["problems"] + algorithms["problems"], "judged": True}


@pytest.mark.timeout(300)
def test_the_multi_gpu_checks_fail_on_a_summing_communicator(tmp_path, monkeypatch):
    driver = _driver(monkeypatch)
    broken = driver.MultiCheck(99, "sums", "", "test_gpu_check:summing_communicator", 200, "gloo")
    monkeypatch.setattr(driver, "MULTI_CHECKS", [broken])
    out = tmp_path / "results.json"
    assert driver.main(["--cpu", "--gpus", "2", str(out)]) == 1
    (entry,) = json.loads(out.read_text())["checks"]
    problems = " ".join(entry["problems"])
    assert entry["status"] == "fail" and "wrap and DDP differ" in problems, entry
    for name in ("GradientAllReduce:", "ModelAverage:", "DiLoCo:"):
        assert name in problems, (name, problems)


def test_asked_for_more_gpus_than_there_are_the_rest_fail(monkeypatch):
    """On a machine with 1 GPU, ``--gpus 8`` runs what one GPU simulates, and the rest fail as "needs 8 GPUs"."""
    driver = _driver(monkeypatch)
    modes = {c.number: driver.multi_mode(c, "cuda", 8, 1) for c in driver.MULTI_CHECKS}
    assert {n for n, m in modes.items() if m is None} == {20, 26, 27, 29, 30}  # 25: a pause on the side stream
    assert {m for m in modes.values() if m} == {"one gpu"}
    assert {driver.multi_mode(c, "cuda", 8, 8) for c in driver.MULTI_CHECKS} == {"gpus"}
    entry = driver.run_multi_check(driver.MULTI_CHECKS[0], 8, None, 60, {})
    assert entry["status"] == "needs 8 GPUs"
    two_levels = next(c for c in driver.MULTI_CHECKS if c.number == 23)  # 2 nodes of >= 2 ranks: N >= 4
    assert driver.run_multi_check(two_levels, 2, "gpus", 60, {})["status"] == "not applicable"


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
