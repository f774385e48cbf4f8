"""Elastic restart: under torchrun --max-restarts 1, a rank killed mid-training makes the survivor raise
(wrap's timeout, no hang), the agent restarts both ranks from the last checkpoint, and the job ends with
the same parameters as an uninterrupted run."""

import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "bx_elastic_train.py")


def torchrun(workdir, kill_at, total=8, every=2):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.5", SCRIPT, str(workdir), str(total), str(every),
           str(kill_at)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    attempts = (workdir / "attempts").read_text().split("\n")[:-1]
    return torch.load(workdir / "final.pt"), attempts


def test_killed_rank_restarts_from_checkpoint_with_the_same_result(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "killed").mkdir()
    expected, attempts = torchrun(tmp_path / "plain", kill_at=-1)
    assert attempts == ["0 0"]
    got, attempts = torchrun(tmp_path / "killed", kill_at=5)
    assert attempts == ["0 0", "1 4"], attempts  # restarted once, from the checkpoint after step 4
    assert len(expected) == len(got) > 0
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
