"""Elastic restart in JAX: under torchrun --max-restarts 1, a process killed mid-training brings the job down
(no hang), the agent restarts both processes, ``init_distributed`` starts a new coordinator, training reloads
its last checkpoint and ends with exactly the parameters of an uninterrupted run."""

import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "bx_jax_elastic_train.py")


def torchrun(workdir, kill_at, total=8, every=2):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, HERE]), "OMP_NUM_THREADS": "1",
           "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.5", SCRIPT, str(workdir), str(total), str(every),
           str(kill_at)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    attempts = [line.split() for line in (workdir / "attempts").read_text().splitlines()]
    with np.load(workdir / "final.npz") as final:
        return [final[f"arr_{i}"] for i in range(len(final.files))], attempts


def test_killed_process_restarts_from_checkpoint_with_the_same_result(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "killed").mkdir()
    expected, attempts = torchrun(tmp_path / "plain", kill_at=-1)
    assert [a[:2] for a in attempts] == [["0", "0"]]
    got, attempts = torchrun(tmp_path / "killed", kill_at=5)
    assert [a[:2] for a in attempts] == [["0", "0"], ["1", "4"]], attempts  # once more, from step 4's checkpoint
    print("MASTER_PORT per attempt:", [a[2] for a in attempts])
    assert len(expected) == len(got) == 4
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b)
