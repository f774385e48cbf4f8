"""Communication threads end with the model or the process: closing a worker joins its thread, and at
interpreter exit a thread still running is stopped and joined (a daemon thread inside a collective while the
interpreter finalises can abort the process)."""

import os
import subprocess
import sys
import textwrap
import time

import torch

from bagua_x.torch.engine.comm_thread import CommWorker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_close_joins_the_thread_after_the_jobs_queued():
    worker = CommWorker("test-close", torch.device("cpu"))
    ran = []
    worker.submit("a slow job", lambda: (time.sleep(0.3), ran.append(1)))
    worker.close()
    assert ran == [1] and not worker._thread.is_alive()


def test_a_thread_still_running_at_exit_is_joined():
    """A worker never closed, a job still running when the script ends: the job completes before the process
    exits (a daemon thread would be cut off)."""
    script = textwrap.dedent("""
        import time, torch
        from bagua_x.torch.engine.comm_thread import CommWorker
        worker = CommWorker("test-exit", torch.device("cpu"))
        worker.submit("a slow job", lambda: (time.sleep(0.5), print("job done", flush=True)))
        time.sleep(0.1)  # the job has started
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "job done" in done.stdout, (done.stdout, done.stderr[-3000:])
