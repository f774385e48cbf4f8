"""Training through faults on a 2 x 2 ``bagua-x cluster --fault-tolerant``: throughput kept, loss, batches.

    sudo .venv/bin/python benchmarks/fault_tolerance.py [--frontend torch] [--algorithm allreduce]
        [--link 100mbit] [--batches 1200] [--kills 2] [--partition 10] [--json OUT]

Runs the same job twice with the same seeds: once without faults, once with
``--kills`` SIGKILLs of every rank of node 1 (its torchrun restarts them and
they heal from node 0) and one partition of node 1's link for ``--partition``
seconds, spread over the run.  Each job trains a teacher-student MLP
(32-1024-1024-10) until the nodes have committed ``--batches`` batches between
them (torchft's count: a node's committed step, for DiLoCo an outer one, counts
one batch), so both jobs see the same number of samples.  ``--frontend jax``
runs each node as one JAX process (a ``jax.jit`` step over its mesh of
``JAX_DEVICES`` CPU devices, ``dp.sync_replicas`` between nodes), with DiLoCo.

Printed (and written to ``--json``): each job's time and committed steps per
second, the throughput kept (batches trained per second with faults over without), the
held-out loss of each (and their ratio), the steps discarded, and the check
that the committed steps consumed the global batch count exactly once (from
node 0's log: each committed step starts where the previous one ended; not
counted for DiLoCo, null: a killed node's inner steps since its last outer
step are lost by design, and a healed node goes on from its peer's count).  A
fault-free job with discarded steps is a false failure (a saturated link
starving the lighthouse's heartbeats).

The worker side (``--worker``) is what every rank runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

IN, HIDDEN, OUT, BATCH = 32, 1024, 10, 64  # BATCH: the global batch of a step, over both nodes
LR, SYNC_EVERY = 0.05, 10
# the inner SGD's momentum: none under DiLoCo, whose outer Nesterov momentum on top of 0.9 diverges on this model
# (one JAX node, 800 inner steps at H = 10: held-out loss 2.32, chance; 0.5: 0.56; none: 0.38)
MOMENTUM = {"allreduce": 0.9, "bytegrad": 0.9, "diloco": 0.0}
# a JAX node's CPU devices.  One: on 2 cores, two nodes of 2 forced devices each spin in XLA's in-process
# rendezvous for the psum across a node's devices, and an inner step took 0.12-0.77 s instead of 5-10 ms
JAX_DEVICES = 1


def _data(index: int, rank: int, ranks: int):
    import torch

    g = torch.Generator().manual_seed(1_000_003 * index + rank)  # batch `index`, this rank's part of it
    x = torch.randn(BATCH // ranks, IN, generator=g)
    return x, _teacher()(x).argmax(dim=1)


_TEACHER = []


def _teacher():
    import torch

    if not _TEACHER:
        g = torch.Generator().manual_seed(12345)
        _TEACHER.append(torch.nn.Linear(IN, OUT).requires_grad_(False))
        _TEACHER[0].weight.copy_(torch.randn(OUT, IN, generator=g))
    return _TEACHER[0]


def _record(log, replicas, committed: bool, index: int, place, loss: float) -> None:
    """One line of a node's log (its first rank's): one step, whether it committed one (DiLoCo: an outer one),
    and the steps this process discarded so far."""
    manager = replicas.manager
    log.write(json.dumps({"time": time.time(), "step": manager.current_step(), "committed": committed,
                          "discarded": replicas.discarded, "nodes": manager.num_participants(), "index": index,
                          "place": place, "loss": loss,
                          "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}) + "\n")
    log.flush()


def _start_gate(log_dir: str, node: int, nodes: int = 2, timeout: float = 300.0) -> None:
    """Wait until every node's manager exists (heartbeating to the lighthouse) before the first step.

    Without it the node that imports faster forms a quorum alone and trains a few steps solo (2, 3 and 8
    in three runs), so two jobs of the same seeds started from different points and their held-out losses
    differed by more than the faults did.  A node restarted after a fault finds every file and goes on."""
    Path(log_dir, f"ready-node{node}").touch()
    deadline = time.time() + timeout
    while not all(Path(log_dir, f"ready-node{n}").exists() for n in range(nodes)):
        if time.time() > deadline:
            raise RuntimeError(f"node {node}: not every node was up within {timeout:.0f} s")
        time.sleep(0.05)


def torch_worker(algorithm: str, batches: int, log_dir: str) -> None:
    import torch

    import bagua_x.algorithms as alg
    import bagua_x.torch as bxt

    rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = int(os.environ["REPLICA_GROUP_ID"].removeprefix("node"))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                              torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM[algorithm])
    algo = {"allreduce": alg.GradientAllReduce(), "bytegrad": alg.ByteGrad(),
            "diloco": alg.DiLoCo(sync_every=SYNC_EVERY)}[algorithm]
    model = bxt.wrap(net, opt, algorithm=algo, fault_tolerance=bxt.FaultTolerance(timeout=10, quorum_timeout=30),
                     timeout=120)
    replicas, manager = model.replicas, model.replicas.manager
    per_step = not isinstance(algo, alg.DiLoCo)
    position = {"batch": 0}  # DiLoCo: this node's own count of batches trained (healed with the rest)
    replicas.keep("data", lambda: dict(position), position.update)
    _start_gate(log_dir, node)
    path = Path(log_dir) / f"node{node}-rank{rank}.jsonl"
    with open(path, "a") as log:
        while manager.batches_committed() < batches:
            if per_step:
                replicas.begin()  # the members of this step first: they number its batches
                place = manager.participating_rank()
                index = manager.batches_committed() + place
            else:
                place, index = None, 1_000_000 * node + position["batch"]
            x, y = _data(index, rank, ranks)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            before = manager.current_step()
            opt.step()
            position["batch"] += 1
            if rank == 0:
                _record(log, replicas, manager.current_step() > before, index, place, loss.item())
    if rank == 0 and node == 0:
        g = torch.Generator().manual_seed(999)
        x = torch.randn(4096, IN, generator=g)
        with torch.no_grad():
            held_out = torch.nn.functional.cross_entropy(net(x), _teacher()(x).argmax(dim=1)).item()
        (Path(log_dir) / "held_out.json").write_text(json.dumps({"loss": held_out}))
    model.shutdown()


def jax_worker(algorithm: str, batches: int, log_dir: str) -> None:
    """A JAX node: one process, its ``JAX_DEVICES`` CPU devices, a ``jax.jit`` inner step over its mesh, and
    ``dp.sync_replicas`` between nodes on the host (``bagua_x.jax`` fault tolerance)."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={JAX_DEVICES}"
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    import bagua_x.algorithms as alg
    import bagua_x.jax as bxj

    node = int(os.environ["REPLICA_GROUP_ID"].removeprefix("node"))
    rng = np.random.default_rng(0)  # every node starts from the same weights (init_sync=False)
    sizes = [(IN, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, OUT)]
    params = [{"w": (rng.uniform(-1, 1, size) / np.sqrt(size[0])).astype(np.float32),
               "b": np.zeros(size[1], np.float32)} for size in sizes]
    teacher = np.random.default_rng(12345).normal(size=(IN, OUT)).astype(np.float32)

    def data(seed: int, samples: int = BATCH // 2):  # a node's half of the global batch
        x = np.random.default_rng(seed).normal(size=(samples, IN)).astype(np.float32)
        return x, (x @ teacher).argmax(axis=1)

    def loss_fn(params, x, y):
        for layer in params[:-1]:
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        logits = x @ params[-1]["w"] + params[-1]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    algo = {"diloco": alg.DiLoCo(sync_every=SYNC_EVERY)}[algorithm]
    mesh = jax.make_mesh((JAX_DEVICES,), ("batch",))
    dp = bxj.wrap(params, algorithm=algo, mesh=mesh,
                  fault_tolerance=bxj.FaultTolerance(timeout=10, quorum_timeout=30, init_sync=False))
    tx = optax.sgd(LR, momentum=MOMENTUM[algorithm] or None)
    p, o = dp.replicate(params, per_device=True), dp.replicate(tx.init(params), per_device=True)
    state = dp.init()

    @jax.jit
    def step(p, o, state, x, y):
        (loss, grads), state = dp.value_and_grad(loss_fn)(p, x, y, state=state)
        updates, o = jax.vmap(tx.update)(grads, o, p)
        return optax.apply_updates(p, updates), o, state, loss.mean()

    sharding = NamedSharding(mesh, PartitionSpec("batch"))
    manager = dp.replicas.manager
    position = {"batch": 0}
    dp.replicas.keep("data", lambda: dict(position), position.update)
    _start_gate(log_dir, node)
    with open(Path(log_dir) / f"node{node}-rank0.jsonl", "a") as log:
        while manager.batches_committed() < batches:
            index = 1_000_000 * node + position["batch"]
            x, y = (jax.device_put(a, sharding) for a in data(index))
            p, o, state, loss = step(p, o, state, x, y)
            before = manager.current_step()
            p, o, state = dp.sync_replicas(p, o, state)
            position["batch"] += 1
            _record(log, dp.replicas, manager.current_step() > before, index, None, float(loss))
    if node == 0:
        x, y = data(999, 4096)
        weights = jax.tree.map(lambda a: np.asarray(a)[0], p)
        (Path(log_dir) / "held_out.json").write_text(json.dumps({"loss": float(loss_fn(weights, x, y))}))
    dp.shutdown()


def _faults(kills: int, partition: float, span: float, log_dir: Path):
    """The fault schedule, run on the cluster's thread: kills and one partition spread over ``span`` seconds."""
    def inject(cluster) -> None:
        events = [("kill", span * (i + 1) / (kills + 2)) for i in range(kills)]
        if partition:
            events.append(("partition", span * (kills + 1) / (kills + 2)))
        node1 = log_dir / "node1-rank0.jsonl"
        while not (node1.exists() and '"nodes": 2' in node1.read_text()):  # from when both nodes train together
            time.sleep(0.2)
        start = time.time()
        with open(log_dir / "faults.jsonl", "a") as record:
            for what, at in sorted(events, key=lambda e: e[1]):
                time.sleep(max(0.0, start + at - time.time()))
                if what == "kill":
                    n = cluster.kill_ranks(1, "--worker")
                    record.write(json.dumps({"time": time.time(), "fault": "kill", "ranks": n}) + "\n")
                else:
                    cluster.set_link(1, up=False)
                    record.write(json.dumps({"time": time.time(), "fault": "partition", "seconds": partition}) + "\n")
                    time.sleep(partition)
                    cluster.set_link(1, up=True)
                record.flush()
    return inject


def _job(args, faults: bool) -> dict:
    from bagua_x.apps import cluster

    log_dir = Path(tempfile.mkdtemp(prefix="bagua_x_ft_bench_"))
    env = dict(os.environ, RUST_LOG="warn", PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                                          os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", args.frontend, args.algorithm,
               str(args.batches), str(log_dir)]
    started = time.time()
    rc = cluster.run(command, nodes=2, nproc_per_node=2 if args.frontend == "torch" else 1, inter_node=args.link, timeout=args.timeout, env=env,
                     max_restarts=args.kills + 1,
                     while_running=_faults(args.kills, args.partition, args.span, log_dir) if faults else None)
    seconds = time.time() - started
    lines = [json.loads(x) for x in (log_dir / "node0-rank0.jsonl").read_text().splitlines()]
    committed = [e for e in lines if e["committed"]]
    consumed_once = None
    if args.algorithm != "diloco":
        starts = [e["index"] - e["place"] for e in committed]
        consumed_once = all(b == a + e["nodes"] for a, b, e in zip(starts, starts[1:], committed))
    train_seconds = committed[-1]["time"] - lines[0]["time"]
    return {"faults": faults, "rc": rc, "seconds": round(seconds, 1), "train_seconds": round(train_seconds, 1),
            "committed_steps": len(committed), "discarded_steps": lines[-1]["discarded"],  # node 0 is never restarted
            "steps_per_second": round(len(committed) / train_seconds, 3),
            "batches_per_second": round(args.batches / train_seconds, 3),
            "held_out_loss": json.loads((log_dir / "held_out.json").read_text())["loss"],
            "solo_steps_at_start": next((i for i, e in enumerate(committed) if e["nodes"] > 1), len(committed)),
            "batches_consumed_once": consumed_once,
            "fault_log": [json.loads(x) for x in (log_dir / "faults.jsonl").read_text().splitlines()]
            if faults else [], "logs": str(log_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=4, metavar=("FRONTEND", "ALGORITHM", "BATCHES", "LOG_DIR"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--frontend", default="torch", choices=["torch", "jax"],
                        help="jax: one process per node, DiLoCo only")
    parser.add_argument("--algorithm", default="allreduce", choices=["allreduce", "bytegrad", "diloco"])
    parser.add_argument("--link", default="100mbit", help="tc rate of the node link")
    parser.add_argument("--batches", type=int, default=1200, help="batches the nodes commit between them")
    parser.add_argument("--kills", type=int, default=2, help="SIGKILLs of every rank of node 1")
    parser.add_argument("--partition", type=float, default=10.0, help="seconds node 1's link is down (0: none)")
    parser.add_argument("--span", type=float, default=60.0, help="seconds over which the faults are spread")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.worker:
        frontend, algorithm, batches, log_dir = args.worker
        (torch_worker if frontend == "torch" else jax_worker)(algorithm, int(batches), log_dir)
        return
    if args.frontend == "jax" and args.algorithm != "diloco":
        parser.error("JAX nodes survive faults with DiLoCo only (--algorithm diloco): a gradient algorithm would "
                     "stop on the host at every step")
    clean = _job(args, faults=False) if not os.environ.get("BX_FT_ONLY_FAULTS") else None
    faulty = _job(args, faults=True)
    if clean is None:
        print(json.dumps(faulty, indent=1))
        return
    report = {"frontend": args.frontend, "algorithm": args.algorithm, "link": args.link, "batches": args.batches, "without_faults": clean,
              "with_faults": faulty,
              "throughput_kept": round(faulty["batches_per_second"] / clean["batches_per_second"], 3),
              "held_out_loss_ratio": round(faulty["held_out_loss"] / clean["held_out_loss"], 4)}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
