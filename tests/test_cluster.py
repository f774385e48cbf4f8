"""``bagua-x cluster``: 2 network-namespace nodes joined by a 1 Gbit/s veth; torch and JAX ranks across them.

The runs need root and iproute2 (they create network namespaces) and are
skipped otherwise; the prerequisite messages are tested everywhere.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bagua_x.algorithms import TopK
from bagua_x.apps import cluster

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "cluster_scripts"
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or cluster.missing_prerequisite() is not None,
    reason="bagua-x cluster needs root and ip, tc, unshare, mount, hostname (network namespaces)",
)


def run_cluster(*args, env=None, timeout=90):
    """``bagua-x cluster ARGS`` in a subprocess; (completed process, the namespace prefix it used)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen([sys.executable, "-m", "bagua_x.cli", "cluster", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # its handler deletes the namespaces
        out, _ = proc.communicate(timeout=30)
        raise
    return proc.returncode, out, f"bxc-{proc.pid}-"


def own_namespaces(prefix):
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(prefix)]


def alive(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def results(out_dir, n):
    found = sorted(out_dir.glob("rank*.json"))
    assert len(found) == n, [p.name for p in found]
    return [json.loads(p.read_text()) for p in found]


@needs_root
def test_torch_hierarchical_and_flat_allreduce_across_two_nodes(tmp_path):
    rc, out, prefix = run_cluster("--nodes", "2", "--nproc-per-node", "2", "--timeout", "80", "--",
                                  "python", str(SCRIPTS / "torch_allreduce.py"), str(tmp_path))
    assert rc == 0, out[-3000:]
    ranks = results(tmp_path, 4)
    for r in ranks:
        assert r["world"] == 4 and r["local_world_size"] == 2
        assert r["hierarchical_ok"] and r["flat_ok"], r
        assert r["node"] == r["rank"] // 2 and r["hostname"] == f"bx-node{r['node']}"
    assert len({r["ifname"] for r in ranks}) == 2  # each node's ranks bound to their own node's veth
    assert own_namespaces(prefix) == []


@needs_root
def test_jax_psum_across_two_nodes(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    rc, out, prefix = run_cluster("--nodes", "2", "--nproc-per-node", "1", "--timeout", "80", "--",
                                  "python", str(SCRIPTS / "jax_psum.py"), str(tmp_path), env=env)
    assert rc == 0, out[-3000:]
    for r in results(tmp_path, 2):
        assert r["processes"] == 2 and r["devices"] == 4 and r["local_devices"] == 2 and r["local_world_size"] == 1
        assert r["psum_ok"], r
        assert r["hostname"] == f"bx-node{r['rank']}"
    assert own_namespaces(prefix) == []


@needs_root
def test_a_crashed_rank_fails_the_run_and_leaves_nothing_behind(tmp_path):
    rc, out, prefix = run_cluster("--nodes", "2", "--nproc-per-node", "2", "--timeout", "80", "--",
                                  "python", str(SCRIPTS / "torch_allreduce.py"), str(tmp_path), "--crash-rank", "3")
    assert rc != 0, out[-3000:]
    assert "rank 3 crashes on purpose" in out
    assert re.search(r"node 1 exited with \d+; stopping the other nodes", out), out[-3000:]
    assert own_namespaces(prefix) == []
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    assert len(pids) == 4
    assert not [pid for pid in pids if alive(pid)]


@needs_root
def test_a_hung_rank_is_killed_after_the_timeout():
    rc, out, prefix = run_cluster("--nodes", "2", "--nproc-per-node", "1", "--timeout", "3", "--", "sleep", "1000")
    assert rc == 124, out[-3000:]
    assert "--timeout 3 s" in out
    assert own_namespaces(prefix) == []


_SLOW_TEARDOWN = """
import sys, time
from bagua_x.algorithms import TopK
from bagua_x.apps import cluster
kill_all = cluster.Cluster.kill_all
def slow_kill_all(self):  # a teardown long enough for the test's later Ctrl-Cs to land in it
    time.sleep(2.5)
    kill_all(self)
cluster.Cluster.kill_all = slow_kill_all
sys.exit(cluster.run(["sleep", "1000"], nodes=2, nproc_per_node=1, timeout=60))
"""


@needs_root
def test_repeated_ctrl_c_still_deletes_every_namespace():
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_TEARDOWN], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    prefix = f"bxc-{proc.pid}-"
    try:
        deadline = time.monotonic() + 30
        while len(own_namespaces(prefix)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # the node launchers are running
        for _ in range(4):  # the first starts the teardown, the others land in it
            proc.send_signal(signal.SIGINT)
            time.sleep(0.4)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
    # no exception out of the teardown: a traceback through cluster.py (torchrun's agent, stopped by SIGTERM, may
    # print its own SignalException, as it did once under load: that one is torch's and says nothing of ours)
    assert "apps/cluster.py" not in out and '"<string>"' not in out and "_Stop" not in out, out[-3000:]
    assert out.count("still stopping") == 3, out[-3000:]
    assert own_namespaces(prefix) == []


def test_without_root_one_line_and_non_zero_exit(capsys):
    import argparse

    parser = argparse.ArgumentParser()
    cluster.add_arguments(parser)
    args = parser.parse_args(["--", "python", "train.py"])
    assert cluster.main(args, euid=1000) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs root" in err
    with pytest.raises(cluster.ClusterUnavailable, match="needs root"):
        cluster.run(["python", "train.py"], euid=1000)


def test_missing_tools_are_named():
    why = cluster.missing_prerequisite(euid=0, which=lambda tool: None if tool in ("tc", "unshare") else "/bin/" + tool)
    assert "needs tc, unshare" in why
    assert cluster.missing_prerequisite(euid=0, which=lambda tool: "/bin/" + tool) is None


def test_the_command_runs_under_this_interpreter():
    assert cluster.program(["python", "t.py", "-x"]) == [sys.executable, "t.py", "-x"]
    assert cluster.program(["t.py"]) == [sys.executable, "t.py"]
    assert cluster.program(["sleep", "1"]) == ["sleep", "1"]


@needs_root
def test_a_failed_setup_is_reported_and_cleaned_up():
    before = set(own_namespaces(f"bxc-{os.getpid()}-"))
    with pytest.raises(cluster.ClusterUnavailable, match="setting up the namespaces failed"):
        cluster.run(["true"], inter_node="not-a-rate")
    assert set(own_namespaces(f"bxc-{os.getpid()}-")) == before == set()


def link_bytes(numel, bits, ranks_per_node, two_level, topk=None):
    """Bytes (both directions) crossing the link of a 2-node cluster for one DiLoCo exchange of ``numel`` float32.

    Derived from how gloo runs each collective (checked with plain collectives on this cluster): an allreduce
    is a ring in rank order, which crosses the link on 2 of its edges, each carrying ``2 (n-1)/n`` of the
    buffer; an alltoall sends every rank's chunk for each rank of the other node straight there; an allgather
    is a ring too (``n - 1`` chunks per crossing edge).  Flat, the exchange runs once over the ``2 L`` ranks;
    two-level, once per shard over the 2 ranks holding it (one per node), each of the ``L`` shards ``numel / L``.
    Compressed chunks carry ``numel bits / 8 / n`` bytes and an 8-byte min/max.  A TopK exchange is one
    allgather of each worker's payload; two-level, each of a node's ranks sends the payload of its share of the
    chunks (whole chunks, so the last share may be padded).
    """
    groups, n, elems = (ranks_per_node, 2, numel / ranks_per_node) if two_level else (1, 2 * ranks_per_node, numel)
    if topk is not None:
        span = -(-topk.chunks(numel) // groups) * topk.chunk if two_level else numel
        return groups * 2 * (n - 1) * topk.payload_bytes(span)
    if bits == 32:
        per_group = 2 * 2 * (n - 1) / n * elems * 4
    else:
        chunk = elems * bits / 8 / n + 8
        per_group = 2 * (n // 2) ** 2 * chunk + 2 * (n - 1) * chunk
    return groups * per_group


DILOCO_FORMS = [("false", False), ("none", True)]
DILOCO_CONFIGS = [{"bits": 32, "fragments": 1}, {"bits": 8, "fragments": 1}, {"bits": 4, "fragments": 1},
                  {"bits": 32, "fragments": 4}, {"topk": {"fraction": 0.02, "bits": 2}, "fragments": 1, "side": 2048}]


@needs_root
@pytest.mark.parametrize("setting,two_level", DILOCO_FORMS)
def test_diloco_bytes_across_the_node_link_are_the_payload(tmp_path, setting, two_level):
    """The veth counters of node 0 around every step of DiLoCo(sync_every=8) on 2 nodes x 2 ranks.

    Control traffic (the barriers around each reading, their ACKs: a few kB a step) is the median of the
    steps that do not sync, subtracted from every step.  Then each sync step moves the analytic payload,
    the other steps nothing more, so the whole run moves (syncs x payload), and with 4 fragments each sync
    moves a quarter of what one fragment does; the sparse form (TopK, 2 % at 2 bits) moves its payload, at most
    1/50 of the pseudo-gradient in float32 in the two-level form (on a 2048 x 2048 layer: a sync's few kB of
    protocol, seen ~4.5 kB, would be 20 % of the 512 x 512 layer's 19 kB sparse payload).  The 10 % bound (the issue's) covers what still rides on the
    payload: TCP/IP and Ethernet headers (66 bytes per segment of up to 64 KiB with GSO, and the ACKs) and
    gloo's message headers; measured, 0.5 to 2 % here.
    """
    rc, out, prefix = run_cluster("--nodes", "2", "--nproc-per-node", "2", "--timeout", "120", "--", "python",
                                  str(SCRIPTS / "torch_diloco_bytes.py"), str(tmp_path), setting,
                                  json.dumps(DILOCO_CONFIGS), timeout=150)
    assert rc == 0, out[-3000:]
    report = json.loads((tmp_path / "bytes.json").read_text())
    assert (report["world"], report["local_world_size"]) == (4, 2)
    per_sync = {}
    for r in report["results"]:
        steps = [b - a for a, b in zip(r["readings"], r["readings"][1:])]
        synced = [any(s >= o and (s - o) % r["sync_every"] == 0 for o in r["offsets"]) for s in range(1, len(steps) + 1)]
        control = sorted(b for b, s in zip(steps, synced) if not s)[sum(not s for s in synced) // 2]
        topk = TopK(**r["topk"]) if "topk" in r else None
        payload = link_bytes(r["numel"] // r["fragments"], r.get("bits"), 2, two_level, topk)
        moved = [b - control for b, s in zip(steps, synced) if s]
        quiet = [b - control for b, s in zip(steps, synced) if not s]
        where = f"{r}: syncs moved {moved}, other steps {quiet}, payload {payload:.0f} per sync"
        assert len(moved) == len(steps) * r["fragments"] // r["sync_every"], where
        assert all(abs(m / payload - 1) < 0.1 for m in moved), where
        assert max(quiet) < 0.05 * payload, where
        assert abs(sum(steps) - control * len(steps) - len(moved) * payload) < 0.1 * len(moved) * payload, where
        per_sync[(r.get("bits", "topk"), r["fragments"])] = max(moved)
    assert abs(per_sync[(32, 4)] * 4 / per_sync[(32, 1)] - 1) < 0.1, per_sync
    ratio = per_sync[("topk", 1)] / (4 * 2048 ** 2)
    assert ratio < (1 / 50 if two_level else 1 / 15), (ratio, per_sync)  # flat: every payload crosses 3 times
    assert per_sync[("topk", 1)] / 16 < per_sync[(32, 1)] / (90 if two_level else 50), per_sync  # 16x the model
    assert own_namespaces(prefix) == []


def link_timing(*flags):
    """``link_timing.py`` on 2 nodes x 1 rank with the given cluster flags: (rc, output, timings or None)."""
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        rc, text, prefix = run_cluster("--nodes", "2", "--nproc-per-node", "1", *flags, "--timeout", "80", "--",
                                       "python", str(SCRIPTS / "link_timing.py"), out)
        found = Path(out) / "link.json"
        link = json.loads(found.read_text()) if found.exists() else None
    assert own_namespaces(prefix) == []
    return rc, text, link


@needs_root
def test_a_10_mbit_link():
    """``--inter-node 10mbit``: 10 Mbit take a second, not less (the cap's burst is 96 KiB at this rate, not the
    512 KiB of a 1 Gbit/s link, which would pass a small exchange for free)."""
    rc, text, link = link_timing("--inter-node", "10mbit")
    assert rc == 0, text[-3000:]
    # 1 s of line rate less the 96 KiB burst (0.08 s); the old 512 KiB burst gave 0.6 s: seen 0.98 s
    assert 0.85 <= link["bulk_s"] < 2.0, link
    assert link["round_trip_s"] < 0.05, link


@needs_root
def test_a_long_distance_link():
    """``--delay 30ms`` on a 10 Mbit/s link: a round trip takes both delays (60 ms); on a kernel without netem the
    cluster says so in one line and fails (this machine's kernel has none: then that is what is tested)."""
    rc, text, link = link_timing("--inter-node", "10mbit", "--delay", "30ms")
    if "lacks" in text:
        assert rc != 0 and "--delay needs tc's netem qdisc" in text, text[-3000:]
        pytest.skip("this kernel has no netem qdisc: --delay cannot be measured here")
    assert rc == 0, text[-3000:]
    assert 0.060 <= link["round_trip_s"] < 0.2, link
    assert 0.85 <= link["bulk_s"] < 2.5, link


def test_the_burst_follows_the_rate():
    assert cluster.burst_bytes("10mbit") == cluster.BURST_MIN
    assert cluster.burst_bytes("1gbit") == 500_000 and cluster.burst_bytes("10gbit") == cluster.BURST_MAX
    with pytest.raises(ValueError, match="cannot read the rate 'fast'"):
        cluster.burst_bytes("fast")


@needs_root
@pytest.mark.timeout(300)
def test_fault_tolerant_cluster_restarts_a_dead_node_which_heals_across_namespaces(tmp_path):
    """``--fault-tolerant``: the lighthouse on node 0, a torchrun per node.  Every rank of node 1 kills itself at
    its 40th step; its torchrun restarts it, and it heals from node 0 across the namespaces (the checkpoint
    server and the store are advertised at the node's veth address, not its host name, which the other node
    cannot resolve to it).  The run ends well and every rank holds the same weights."""
    pytest.importorskip("torchft")
    env = dict(os.environ, BX_FT_DIE_AT="40", RUST_LOG="warn")
    log = tmp_path / "node{node}-rank{rank}.jsonl"
    rc, out, prefix = run_cluster("--nodes", "2", "--nproc-per-node", "2", "--fault-tolerant", "--max-restarts", "1",
                                  "--timeout", "200", "--", "python", str(ROOT / "tests" / "torch" / "bx_ft_node.py"),
                                  "allreduce", "150", str(log), "0.02", env=env, timeout=260)
    assert rc == 0, out[-5000:]
    lines = {(n, r): [json.loads(x) for x in (tmp_path / f"node{n}-rank{r}.jsonl").read_text().splitlines()]
             for n in (0, 1) for r in (0, 1)}
    node1 = lines[(1, 0)]
    gaps = [i for i in range(1, len(node1)) if node1[i]["time"] - node1[i - 1]["time"] > 1]  # the restart
    assert gaps == [40], (gaps, out[-3000:])  # died at its 40th step, once
    died_at, back = node1[39], node1[40]
    assert back["step"] > died_at["step"], "the restarted node started over instead of healing to node 0's step"
    # node 0 was never restarted nor healed: it committed every step once, in order (it waited for the quorum or
    # trained alone while node 1 was away, as the lighthouse's heartbeat timeout and the restart's speed decide)
    committed = [e["step"] for e in lines[(0, 0)] if e["committed"]]
    assert committed == list(range(committed[0], 151)), committed
    assert node1[-1]["step"] == lines[(0, 0)][-1]["step"] == 150
    import torch

    weights = [torch.load(f"{tmp_path}/node{n}-rank{r}.jsonl.pt")["model"] for n in (0, 1) for r in (0, 1)]
    for w in weights[1:]:
        assert all(torch.equal(w[k], weights[0][k]) for k in weights[0])
    assert own_namespaces(prefix) == []


@needs_root
@pytest.mark.timeout(300)
def test_a_fault_tolerant_jax_node_restarts_and_heals_across_namespaces(tmp_path):
    """The same with JAX nodes (one process and 2 CPU devices each, DiLoCo at H = 4, the outer exchange on the
    host through torchft): node 1 kills itself at its 30th inner step, its torchrun restarts it, and it heals
    from node 0 across the namespaces: its data position jumps to node 0's, every outer step of node 0 is
    committed once, and both end with the same weights and DiLoCo state."""
    pytest.importorskip("torchft")
    env = dict(os.environ, BX_FT_DIE_AT="30", RUST_LOG="warn")
    log = tmp_path / "node{node}.jsonl"
    rc, out, prefix = run_cluster("--nodes", "2", "--nproc-per-node", "1", "--fault-tolerant", "--max-restarts", "1",
                                  "--timeout", "200", "--", "python", str(ROOT / "tests" / "jax" / "bx_ft_jax_node.py"),
                                  "diloco", "4", "200", str(log), "0.02", env=env, timeout=260)
    assert rc == 0, out[-5000:]
    lines = [[json.loads(x) for x in (tmp_path / f"node{n}.jsonl").read_text().splitlines()] for n in (0, 1)]
    node1 = lines[1]
    gaps = [i for i in range(1, len(node1)) if node1[i]["inner"] <= node1[i - 1]["inner"]]  # the restart
    assert gaps == [30], (gaps, out[-3000:])
    healed = next(e for e in node1[30:] if e["committed"])
    assert healed["inner"] > 30 and healed["nodes"] == 2, "the restarted node started over instead of healing"
    committed = [e["step"] for e in lines[0] if e["committed"]]
    assert committed == list(range(1, len(committed) + 1)), committed
    finals = [np.load(tmp_path / f"node{n}.jsonl.npz") for n in (0, 1)]
    assert finals[0].files == finals[1].files
    for name in finals[0].files:
        assert np.array_equal(finals[0][name], finals[1][name]), name
    assert own_namespaces(prefix) == []


@needs_root
@pytest.mark.timeout(300)
def test_a_partitioned_jax_node_comes_back_without_a_restart(tmp_path):
    """Node 1's link down for 10 s once both nodes trained together (JAX DiLoCo nodes, no restarts allowed):
    node 0 commits outer steps alone meanwhile; node 1's collective in flight fails (its step discarded), its
    quorum requests are asked again until the link is back, and it heals from node 0 -- its data position
    jumps to node 0's -- within 30 s of the link's return, in the same process.  Both end at the same outer
    step with the same weights and DiLoCo state."""
    pytest.importorskip("torchft")
    import time

    log = tmp_path / "node{node}.jsonl"
    events = {}

    def partition(c):
        deadline = time.time() + 120
        while time.time() < deadline:  # both nodes committed together: the job runs
            path = tmp_path / "node1.jsonl"
            if path.exists() and any(json.loads(x)["nodes"] == 2 and json.loads(x)["committed"]
                                     for x in path.read_text().splitlines()[-20:] if x.strip()):
                break
            time.sleep(0.2)
        events["down"] = time.time()
        c.set_link(1, False)
        time.sleep(10)
        c.set_link(1, True)
        events["up"] = time.time()

    env = dict(os.environ, RUST_LOG="warn", PYTHONPATH=str(ROOT))
    rc = cluster.run(["python", str(ROOT / "tests" / "jax" / "bx_ft_jax_node.py"), "diloco", "4", "800", str(log),
                      "0.05"], nodes=2, nproc_per_node=1, timeout=240, env=env, max_restarts=0,
                     while_running=partition)
    assert rc == 0 and "up" in events, events
    lines = [[json.loads(x) for x in (tmp_path / f"node{n}.jsonl").read_text().splitlines()] for n in (0, 1)]
    node0, node1 = lines
    assert all(b["inner"] > a["inner"] for a, b in zip(node1, node1[1:])), "node 1 was restarted"
    alone = [e for e in node0 if e["committed"] and e["nodes"] == 1 and events["down"] < e["time"] < events["up"]]
    assert alone, "node 0 did not train on alone while node 1 was cut off"
    jump = next(i for i in range(1, len(node1)) if node1[i]["inner"] > node1[i - 1]["inner"] + 1)
    back = node1[jump]
    assert back["committed"] and back["nodes"] == 2, back
    assert back["time"] - events["up"] < 30, f"node 1 back {back['time'] - events['up']:.1f} s after the link"
    assert node0[-1]["step"] == node1[-1]["step"] and node0[-1]["inner"] == node1[-1]["inner"] == 800
    finals = [np.load(tmp_path / f"node{n}.jsonl.npz") for n in (0, 1)]
    for name in finals[0].files:
        assert np.array_equal(finals[0][name], finals[1][name]), name
    print(f"node 1 trained with node 0 again {back['time'] - events['up']:.1f} s after its link came back")
