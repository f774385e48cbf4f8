"""A fault-tolerant job of the tests of both frontends: a torchft lighthouse from the wheel and the processes
of each node (a frontend's test says how to start them), all killed at the end whatever happens.

Each process ``rank`` of node ``node`` writes its output to ``node{node}-rank{rank}.out`` and one JSON line per
step to :meth:`FaultJob.log`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path


class FaultJob:
    """The lighthouse (waits 2 s for late joiners; a node is dead after 3 s without a heartbeat) and the nodes."""

    def __init__(self, tmp: Path, min_replicas: int = 1):
        self.tmp = tmp
        self.procs: dict[int, list[subprocess.Popen]] = {}
        code = ("import time\nfrom torchft._torchft import LighthouseServer\n"
                f"lh = LighthouseServer(bind='[::]:0', min_replicas={min_replicas}, join_timeout_ms=2000,\n"
                "                      heartbeat_timeout_ms=3000)\n"
                "print(lh.address().rsplit(':', 1)[1], flush=True)\ntime.sleep(3600)\n")
        self.lighthouse = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                           stderr=open(tmp / "lighthouse.err", "w"), text=True)
        self.address = f"http://127.0.0.1:{self.lighthouse.stdout.readline().strip()}"

    def log(self, node: int, rank: int = 0) -> Path:
        return self.tmp / f"node{node}-rank{rank}.jsonl"

    def out(self, node: int, rank: int = 0) -> Path:
        return self.tmp / f"node{node}-rank{rank}.out"

    def kill(self, node: int) -> float:
        """SIGKILL to every process of ``node``; the time it was dead."""
        for p in self.procs[node]:
            p.send_signal(signal.SIGKILL)
        for p in self.procs[node]:
            p.wait()
        return time.time()

    def lines(self, node: int, rank: int = 0) -> list[dict]:
        path = self.log(node, rank)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while not predicate():
            for node, procs in self.procs.items():
                for p in procs:
                    if p.poll() not in (None, 0, -signal.SIGKILL):
                        raise AssertionError(f"node {node} exited with {p.returncode} while waiting for {what}:\n"
                                             + self.output(node))
            if time.time() > deadline:
                raise AssertionError(f"no {what} within {timeout} s:\n" + self.output(0) + self.output(1))
            time.sleep(0.05)

    def finish(self, timeout: float) -> None:
        for node, procs in self.procs.items():
            for p in procs:
                try:
                    rc = p.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"node {node} did not finish within {timeout} s:\n" + self.output(node))
                assert rc == 0, f"node {node} exited with {rc}:\n" + self.output(node)

    def output(self, node: int) -> str:
        """The last lines of each of ``node``'s processes (torchft's own log lines left out)."""
        tails = []
        for rank in range(len(self.procs.get(node, [])) or 1):
            path = self.out(node, rank)
            lines = path.read_text().splitlines() if path.exists() else []
            tails.append(f"--- node {node} rank {rank} ---\n" + "\n".join(
                [line for line in lines if "torchft::" not in line][-30:]))
        return "\n".join(tails) + "\n"

    def close(self) -> None:
        for procs in self.procs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
        self.lighthouse.kill()
