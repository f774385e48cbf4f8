"""Launching local ranks with torch's elastic agent, optionally on a bandwidth-capped link."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid

from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(fn, nproc: int, *args):
    """Run ``fn(*args)`` on ``nproc`` local ranks (torchrun's machinery); return rank 0's result."""
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:8],
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
        monitor_interval=0.1, start_method="spawn",
    )
    return elastic_launch(config, fn)(*args)[0]


def rerun_in_capped_namespace(rate: str, argv: list[str]) -> int:
    """Re-run this command inside a fresh network namespace whose loopback is capped at ``rate``.

    Every rank talks over 127.0.0.1, so capping that namespace's loopback caps
    the links between ranks.  Needs root and iproute2 (``ip``, ``tc``).
    """
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        raise SystemExit(
            f"--bandwidth {rate} runs the ranks in a network namespace with a capped loopback, which needs root "
            "and iproute2 (ip, tc); run as root or leave out --bandwidth"
        )
    ns = f"baguax{uuid.uuid4().hex[:6]}"
    setup = [
        ["ip", "netns", "add", ns],
        ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "mtu", "9000", "up"],
        ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
         "burst", "512kb", "latency", "500ms"],
    ]
    try:
        for cmd in setup:
            subprocess.run(cmd, check=True)
        env = dict(os.environ, BAGUA_X_LINK=rate)
        return subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "bagua_x.cli", *argv], env=env).returncode
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=False)
