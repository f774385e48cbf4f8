"""``bagua-x cluster``: several "nodes" on this machine, each a network namespace, joined by capped links.

Every node is a fresh network namespace.  Two nodes are joined by one veth
pair; more nodes each get a veth into a switch namespace holding a bridge.
Both ends of every inter-node veth are capped with ``tc qdisc ... tbf rate
RATE burst B latency 500ms``, B what the rate sends in 4 ms, but 96 KiB at
least (a veth hands tc segments of up to 64 KiB) and 512 KiB at most: so a
slow link does not pass a whole small exchange as one free burst.  With
``--delay`` (a long-distance link) a ``netem delay`` sits above the cap, on
both ends: each direction is delayed that much.  Addresses stay in the loopback range: with
``net.ipv4.conf.all.route_localnet=1`` in each namespace, node K's veth end is
``127.1.0.(K+1)/24``.  Ranks inside a node talk over the node's own loopback,
uncapped: a packet to an address of the namespace itself is routed through
``lo`` whichever interface holds the address, so gloo ranks bound to the
node's veth address reach each other over ``lo``.

Each node runs ``python -m torch.distributed.run --nnodes N --node_rank K
--nproc_per_node P --master_addr 127.1.0.1`` inside its namespace, under
``unshare --uts --mount`` with its own host name (``bx-nodeK``) and a
bind-mounted hosts file naming every node's veth address.  So both frontends
find their address: torch's gloo through ``GLOO_SOCKET_IFNAME=<the node's
veth>``, JAX's gloo (which resolves the host name) through the hosts file;
``bagua_x.jax.init_distributed()`` reads torchrun's RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT, and LOCAL_WORLD_SIZE gives the node size to
hierarchical algorithms.

Needs root and iproute2 (``ip``, ``tc``), ``unshare``, ``mount`` and
``hostname``.  The namespaces (named ``bxc-<pid>-<tag>-...``) are deleted on
every exit path: normal end, a failed rank (the other nodes are then
stopped), ``--timeout``, SIGINT/SIGTERM/SIGHUP.  Only a SIGKILL of this
process itself leaves them behind (``ip netns list``; ``ip netns delete``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

LATENCY = "500ms"
BURST_MIN, BURST_MAX = 96 * 1024, 512 * 1024
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "bps": 8, "kbps": 8e3, "mbps": 8e6,
          "gbps": 8e9}


def burst_bytes(rate: str) -> int:
    """tbf's bucket for ``rate`` (tc syntax: 10mbit, 1gbit...): 4 ms of it, within [96 KiB, 512 KiB]."""
    text = rate.strip().lower()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            try:
                bits_per_s = float(text[:-len(unit)]) * _UNITS[unit]
            except ValueError:
                break
            return int(min(BURST_MAX, max(BURST_MIN, bits_per_s / 8 * 0.004)))
    raise ValueError(f"cannot read the rate {rate!r}: give tc's syntax, e.g. 10mbit, 100mbit, 1gbit")
SUBNET = "127.1.0"
TOOLS = ("ip", "tc", "unshare", "mount", "hostname")


class ClusterUnavailable(RuntimeError):
    """The cluster cannot be set up here (not root, a tool missing); the message says why, in one line."""


def missing_prerequisite(euid: Optional[int] = None, which: Callable[[str], Optional[str]] = shutil.which) -> Optional[str]:
    """Why a cluster cannot be made here, in one line, or None.  ``euid``/``which`` are for tests."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        return ("bagua-x cluster needs root: it creates network namespaces, veth links and tc caps "
                "(run it as root, e.g. with sudo)")
    missing = [tool for tool in TOOLS if which(tool) is None]
    if missing:
        return (f"bagua-x cluster needs {', '.join(missing)} on PATH "
                f"(iproute2 for ip and tc; util-linux for unshare and mount; hostname)")
    return None


def node_address(k: int) -> str:
    return f"{SUBNET}.{k + 1}"


def _run(cmd: Sequence[str]) -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")


@dataclass
class Cluster:
    """Network namespaces for ``nodes`` nodes; ``setup()`` makes them, ``teardown()`` removes them (idempotent)."""

    nodes: int
    rate: str = "1gbit"
    delay: Optional[str] = None
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:4])
    created: list = field(default_factory=list)
    hosts_dir: Optional[str] = None

    @property
    def prefix(self) -> str:
        return f"bxc-{os.getpid()}-{self.tag}"

    def namespace(self, k: int) -> str:
        return f"{self.prefix}-node{k}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-switch"

    def veth(self, k: int, peer: bool = False) -> str:
        # interface names are at most 15 characters; unique per run through the tag
        return f"bx{self.tag}{'s' if peer else 'n'}{k}"

    def hostname(self, k: int) -> str:
        return f"bx-node{k}"

    def hosts_file(self) -> str:
        return os.path.join(self.hosts_dir, "hosts")

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.created.append(name)
        _run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"])
        _run(["ip", "netns", "exec", name, "sysctl", "-q", "-w", "net.ipv4.conf.all.route_localnet=1"])

    def _cap(self, ns: str, dev: str) -> None:
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        cap = ["tbf", "rate", self.rate, "burst", str(burst_bytes(self.rate)), "latency", LATENCY]
        if self.delay is None:
            _run(tc + ["root"] + cap)
        else:
            try:
                _run(tc + ["root", "handle", "1:", "netem", "delay", self.delay])
            except RuntimeError as e:
                if "unknown" not in str(e):
                    raise
                raise RuntimeError(f"--delay needs tc's netem qdisc (the kernel's sch_netem), which this kernel lacks "
                                   f"({e}); run without --delay, or on a kernel with netem") from e
            _run(tc + ["parent", "1:", "handle", "2:"] + cap)

    def setup(self) -> None:
        if self.nodes < 2:
            raise ValueError("a cluster has at least 2 nodes")
        if self.nodes > 254:
            raise ValueError("at most 254 nodes (one /24 of 127.1.0.x)")
        for k in range(self.nodes):
            self._add_namespace(self.namespace(k))
        if self.nodes == 2:  # one veth pair, as in DESIGN.md
            pairs = [(self.namespace(0), self.veth(0), self.namespace(1), self.veth(1))]
        else:  # each node's veth into a bridge in the switch namespace
            self._add_namespace(self.switch)
            _run(["ip", "netns", "exec", self.switch, "ip", "link", "add", "br0", "type", "bridge"])
            _run(["ip", "netns", "exec", self.switch, "ip", "link", "set", "br0", "up"])
            pairs = [(self.namespace(k), self.veth(k), self.switch, self.veth(k, peer=True)) for k in range(self.nodes)]
        for ns_a, dev_a, ns_b, dev_b in pairs:
            _run(["ip", "link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b])
            for ns, dev in ((ns_a, dev_a), (ns_b, dev_b)):
                self._cap(ns, dev)
                if ns == self.switch:
                    _run(["ip", "netns", "exec", ns, "ip", "link", "set", dev, "master", "br0"])
                _run(["ip", "netns", "exec", ns, "ip", "link", "set", dev, "up"])
        for k in range(self.nodes):
            _run(["ip", "netns", "exec", self.namespace(k), "ip", "addr", "add", f"{node_address(k)}/24",
                  "dev", self.veth(k)])
        self.hosts_dir = tempfile.mkdtemp(prefix="bagua_x_cluster_")
        with open(self.hosts_file(), "w") as f:
            f.write("127.0.0.1 localhost\n")
            for k in range(self.nodes):
                f.write(f"{node_address(k)} {self.hostname(k)}\n")

    def pids(self) -> list[int]:
        """Processes inside this cluster's namespaces."""
        found = []
        for ns in self.created:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
            found += [int(p) for p in out.split()]
        return found

    def kill_all(self) -> None:
        """SIGKILL every process left in the namespaces (all of them were started by this cluster)."""
        for _ in range(50):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def teardown(self) -> None:
        try:
            self.kill_all()
        finally:
            for ns in reversed(self.created):
                subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
            self.created.clear()
            if self.hosts_dir:
                shutil.rmtree(self.hosts_dir, ignore_errors=True)
                self.hosts_dir = None

    def kill_ranks(self, k: int, match: str) -> int:
        """SIGKILL node ``k``'s processes whose command line holds ``match``, but not its torchrun launcher (which
        then restarts them, under ``--fault-tolerant``); how many were killed.  A fault to measure recovery by."""
        out = subprocess.run(["ip", "netns", "pids", self.namespace(k)], capture_output=True, text=True,
                             timeout=30).stdout
        killed = 0
        for pid in map(int, out.split()):
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if match in cmdline and "torch.distributed.run" not in cmdline:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
        return killed

    def set_link(self, k: int, up: bool) -> None:
        """Take node ``k``'s inter-node link down or up again: a partition, to measure recovery by."""
        _run(["ip", "netns", "exec", self.namespace(k), "ip", "link", "set", self.veth(k), "up" if up else "down"])

    def node_wrapper(self, k: int) -> list[str]:
        """Prefix that runs a command on node ``k``: its namespace, its host name, the cluster's hosts file."""
        script = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
        return ["ip", "netns", "exec", self.namespace(k), "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", script, "bagua-x-node", self.hostname(k), self.hosts_file()]


def program(command: Sequence[str]) -> list[str]:
    """The user's command with ``python`` made this interpreter and a bare ``script.py`` run by it."""
    command = list(command)
    if not command:
        raise ValueError("no command to run (put it after --, e.g. -- python train.py)")
    if command[0] in ("python", "python3"):
        command[0] = sys.executable
    elif command[0].endswith(".py"):
        command.insert(0, sys.executable)
    return command


def torchrun_command(cluster: Cluster, k: int, nproc_per_node: int, master_port: int, command: Sequence[str],
                     max_restarts: Optional[int] = None) -> list[str]:
    """Node ``k``'s launcher: one torchrun over every node, or (``max_restarts`` given: fault-tolerant) a torchrun
    of this node alone, its store on its own address, restarting its ranks up to ``max_restarts`` times."""
    own = max_restarts is not None
    return [
        *cluster.node_wrapper(k), sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1" if own else str(cluster.nodes), "--node_rank", "0" if own else str(k),
        "--nproc_per_node", str(nproc_per_node), "--master_addr", node_address(k if own else 0),
        "--master_port", str(master_port), "--max_restarts", str(max_restarts or 0),
        "--monitor_interval", "0.2", "--no-python", *program(command),
    ]


LIGHTHOUSE_PORT = 29510
#: --fault-tolerant: once a node has finished the job, the others' seconds to finish too before they are stopped
#: (one may be restarting, with no live node left to heal from)
FINISH_GRACE_S = 60.0


def lighthouse_command(cluster: Cluster, join_timeout_ms: int = 10_000, heartbeat_timeout_ms: int = 5_000) -> list[str]:
    """torchft's lighthouse (from the torchft wheel) on node 0, for ``--fault-tolerant`` jobs: one node suffices
    for a quorum; stragglers that heartbeat are awaited ``join_timeout_ms``."""
    binary = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    if not os.path.exists(binary):
        binary = shutil.which("torchft_lighthouse")
    if binary is None:
        raise ClusterUnavailable("bagua-x cluster --fault-tolerant needs torchft's lighthouse: pip install "
                                 "'bagua-x[ft]'")
    return [*cluster.node_wrapper(0), binary, "--min_replicas", "1", "--bind", f"[::]:{LIGHTHOUSE_PORT}",
            "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)]


class _Stop(BaseException):
    pass


def run(
    command: Sequence[str],
    nodes: int = 2,
    nproc_per_node: int = 1,
    inter_node: str = "1gbit",
    delay: Optional[str] = None,
    timeout: float = 600.0,
    master_port: int = 29500,
    euid: Optional[int] = None,
    env: Optional[dict] = None,
    grace: float = 5.0,
    max_restarts: Optional[int] = None,
    while_running: Optional[Callable[[Cluster], None]] = None,
) -> int:
    """Run ``command`` on every rank of a ``nodes`` x ``nproc_per_node`` cluster; 0 when every rank succeeded.

    A failed rank stops the other nodes (their launchers get SIGTERM, then
    everything left is killed); past ``timeout`` seconds everything is killed
    and 124 is returned.  Raises :class:`ClusterUnavailable` when the cluster
    cannot be made here.

    ``max_restarts`` (``--fault-tolerant``): each node is a torchft replica group instead: torchft's lighthouse
    runs on node 0 (``TORCHFT_LIGHTHOUSE``), each node has a torchrun of its own that restarts its ranks when
    one dies (up to ``max_restarts`` times; ``REPLICA_GROUP_ID`` names the node), and a node that fails for
    good leaves the others training.  The job is done when a node finishes: the others get ``FINISH_GRACE_S``
    to finish too, then they are stopped; 0, unless every node failed (the first failure's code).
    ``while_running(cluster)`` runs on a thread of its own once the ranks are launched (faults to inject).
    """
    why = missing_prerequisite(euid)
    if why:
        raise ClusterUnavailable(why)
    cluster = Cluster(nodes, inter_node, delay)
    handlers = {}
    stopping = []  # non-empty once ranks are being stopped: later signals must not cut the teardown short

    def stop(signum, frame):
        if stopping:
            print(f"bagua-x cluster: got signal {signum} again; still stopping, the namespaces are deleted first",
                  file=sys.stderr)
            return
        stopping.append(signum)
        raise _Stop(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            handlers[sig] = signal.signal(sig, stop)
        except ValueError:  # not the main thread: rely on the finally below
            pass
    launchers: list[subprocess.Popen] = []
    try:
        try:
            cluster.setup()
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as e:
            raise ClusterUnavailable(f"bagua-x cluster: setting up the namespaces failed: {e}") from e
        base = dict(os.environ if env is None else env)
        base.setdefault("PYTHONUNBUFFERED", "1")
        fault_tolerant = max_restarts is not None
        if fault_tolerant:
            launchers.append(subprocess.Popen(lighthouse_command(cluster), env=base, start_new_session=True,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            base["TORCHFT_LIGHTHOUSE"] = f"http://{node_address(0)}:{LIGHTHOUSE_PORT}"
        for k in range(nodes):
            node_env = dict(base, GLOO_SOCKET_IFNAME=cluster.veth(k), BAGUA_X_CLUSTER_NODE=str(k),
                            BAGUA_X_LINK=inter_node)
            if fault_tolerant:
                node_env["REPLICA_GROUP_ID"] = f"node{k}"
            launchers.append(subprocess.Popen(torchrun_command(cluster, k, nproc_per_node, master_port, command,
                                                               max_restarts),
                                              env=node_env, start_new_session=True))
        lighthouse, nodes_launched = (launchers[0], launchers[1:]) if fault_tolerant else (None, launchers)
        if while_running is not None:
            threading.Thread(target=while_running, args=(cluster,), daemon=True, name="bagua-x-cluster-faults").start()
        deadline = time.monotonic() + timeout
        finished = None  # when the first node finished its job (--fault-tolerant)
        while True:
            codes = [p.poll() for p in nodes_launched]
            failed = [(k, c) for k, c in enumerate(codes) if c not in (None, 0)]
            if fault_tolerant and lighthouse.poll() is not None:
                print(f"bagua-x cluster: the lighthouse exited with {lighthouse.returncode}; stopping every node",
                      file=sys.stderr)
                _stop(launchers, grace)
                return lighthouse.returncode or 1
            if fault_tolerant and 0 in codes and None in codes:  # the job is done: the others follow, or stop
                finished = finished or time.monotonic()
                if time.monotonic() - finished > FINISH_GRACE_S:
                    print(f"bagua-x cluster: node {codes.index(0)} finished; stopping the nodes still running "
                          f"{FINISH_GRACE_S:g} s later", file=sys.stderr)
                    _stop(launchers, grace)
                    return 0
            if fault_tolerant and failed and all(c is not None for c in codes):
                k, code = failed[0]
                if 0 in codes:  # a node that failed for good while another finished the job
                    print(f"bagua-x cluster: node {codes.index(0)} finished; node {k} had failed with {code}",
                          file=sys.stderr)
                    _stop(launchers, 0)
                    return 0
                print(f"bagua-x cluster: every node has ended; node {k} failed with {code}", file=sys.stderr)
                _stop(launchers, 0)
                return code
            if failed and not fault_tolerant:
                k, code = failed[0]
                print(f"bagua-x cluster: node {k} exited with {code}; stopping the other nodes", file=sys.stderr)
                _stop(launchers, grace)
                return code
            if all(c == 0 for c in codes):
                if lighthouse is not None:
                    _stop([lighthouse], 0)
                return 0
            if time.monotonic() > deadline:
                print(f"bagua-x cluster: still running after --timeout {timeout:g} s; killing every rank",
                      file=sys.stderr)
                _stop(launchers, 0)
                return 124
            time.sleep(0.1)
    except _Stop as e:
        print(f"bagua-x cluster: got signal {e.args[0]}; stopping every rank", file=sys.stderr)
        _stop(launchers, grace)
        return 128 + int(e.args[0])
    finally:
        stopping.append(None)
        try:
            for p in launchers:
                if p.poll() is None:
                    _signal_group(p, signal.SIGKILL)
            cluster.teardown()
            for p in launchers:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            for sig, old in handlers.items():
                signal.signal(sig, old)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(launchers: list, grace: float) -> None:
    """SIGTERM the node launchers (torchrun then stops its ranks); SIGKILL what is left after ``grace`` seconds."""
    for p in launchers:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM if grace > 0 else signal.SIGKILL)
    end = time.monotonic() + grace
    while time.monotonic() < end and any(p.poll() is None for p in launchers):
        time.sleep(0.1)
    for p in launchers:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)


def add_arguments(parser) -> None:
    parser.add_argument("--nodes", type=int, default=2, help="number of nodes (network namespaces), at least 2")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node (torchrun's --nproc_per_node)")
    parser.add_argument("--inter-node", default="1gbit", metavar="RATE",
                        help="tc rate of every inter-node link, both directions (e.g. 1gbit, 100mbit, 10mbit)")
    parser.add_argument("--delay", default=None, metavar="TIME",
                        help="added one-way delay of every inter-node link (tc netem, e.g. 30ms): a long-distance link")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds after which every rank is killed and the run fails (exit 124)")
    parser.add_argument("--master-port", type=int, default=29500,
                        help="torchrun's store port on node 0 (JAX's coordinator takes the next one)")
    parser.add_argument("--fault-tolerant", action="store_true",
                        help="each node a torchft replica group (bagua_x.torch.FaultTolerance): the lighthouse on "
                             "node 0, a torchrun per node that restarts its ranks when one dies; needs bagua-x[ft]")
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="with --fault-tolerant: restarts of a node's ranks before that node fails for good")
    parser.add_argument("cmd", nargs="...", metavar="-- COMMAND",
                        help="what every rank runs: python train.py args, or train.py args")


def main(args, euid: Optional[int] = None) -> int:
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("bagua-x cluster: no command; e.g. bagua-x cluster --nodes 2 -- python train.py", file=sys.stderr)
        return 2
    try:
        return run(command, nodes=args.nodes, nproc_per_node=args.nproc_per_node, inter_node=args.inter_node,
                   delay=args.delay, timeout=args.timeout, master_port=args.master_port, euid=euid,
                   max_restarts=args.max_restarts if args.fault_tolerant else None)
    except ClusterUnavailable as e:
        print(str(e), file=sys.stderr)
        return 2
