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

    def start(self, node: int, **env: str) -> None:
        raise NotImplementedError  # each frontend's test starts its node's processes

    def kill_and_restart(self, after: int, rejoin_timeout: float, **restart_env: str) -> dict:
        """Start both nodes; once node 1 committed step ``after`` with node 0, SIGKILL node 1; once node 0
        committed a step past node 1's last, start node 1 again (with ``restart_env``) and run the job to its end.

        What was measured: ``survivor_resumed`` (s from the kill to node 0's first commit of a step past node
        1's last), ``alone`` (that commit had one node), ``steps_at_kill`` (node 0's committed steps then), ``rejoined`` (s from the
        restart to node 1's first commit), ``first_commit_after_restart`` (its log line) and ``before`` (node
        1's log lines before the restart).
        """
        self.start(0)
        self.start(1)
        self.wait_for(lambda: any(e["committed"] and e["nodes"] == 2 and e["step"] >= after for e in self.lines(1)),
                      120, "two-node steps before the kill")
        killed_at = self.kill(1)
        # node 0 may commit the step node 1 committed last after the kill's time stamp (both took part in it):
        # the first step node 0 can have taken without node 1 is the next one
        last_joint = max(e["step"] for e in self.lines(1) if e["committed"])
        self.wait_for(lambda: any(e["committed"] and e["step"] > last_joint for e in self.lines(0)), 30,
                      "a commit on node 0 after the kill")
        survivor = [e for e in self.lines(0) if e["committed"] and e["step"] > last_joint]
        steps_at_kill = max(e["step"] for e in self.lines(0) if e["time"] <= killed_at)
        before = len(self.lines(1))
        restarted_at = time.time()
        self.start(1, **restart_env)
        self.wait_for(lambda: any(e["committed"] and e["nodes"] == 2 for e in self.lines(1)[before:]), rejoin_timeout,
                      "a two-node step of the restarted node")
        after_restart = self.lines(1)[before:]
        self.finish(timeout=120)
        first = next(e for e in after_restart if e["committed"])
        measured = {"survivor_resumed": survivor[0]["time"] - killed_at, "alone": survivor[0]["nodes"] == 1,
                    "steps_at_kill": steps_at_kill, "rejoined": first["time"] - restarted_at,
                    "first_commit_after_restart": first, "before": before}
        print(f"node 0 committed again {measured['survivor_resumed']:.1f} s after the kill; node 1 trained with it "
              f"again {measured['rejoined']:.1f} s after its restart")
        return measured

    def close(self) -> None:
        for procs in self.procs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
        self.lighthouse.kill()
