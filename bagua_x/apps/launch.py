"""Starting the demo's and the bench's ranks: torchrun on this machine, optionally inside a capped network namespace."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import uuid


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, argv: list[str], prefix: tuple = ()) -> int:
    """``python -m torch.distributed.run --nproc_per_node nproc argv`` on 127.0.0.1, after ``prefix``; its status."""
    cmd = [*prefix, sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--max_restarts", "0", *argv]
    return subprocess.run(cmd).returncode


def can_cap() -> bool:
    return os.geteuid() == 0 and bool(shutil.which("ip")) and bool(shutil.which("tc"))


@contextlib.contextmanager
def capped_namespace(rate: str):
    """A fresh network namespace whose loopback is capped at ``rate``; yields the prefix that runs a command in it.

    Every rank talks over 127.0.0.1, so capping that namespace's loopback caps
    the links between ranks (all of them, unlike a cluster's inter-node link).
    Needs root and iproute2 (``ip``, ``tc``); the namespace is deleted on exit.
    """
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
        yield ("ip", "netns", "exec", ns)
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=False, capture_output=True)
