"""``bagua-x demo``: loss against wall-clock time for every algorithm, on a link where communication matters.

On uncapped loopback communication is nearly free, every algorithm follows the
same curve and compression only adds work; the point of the algorithms shows
on a slow link.  So the PyTorch runs, the headline, train a 4.3 M-parameter MLP
(17 MB of gradient a step) on 2 nodes x 2 ranks joined by a 1 Gbit/s link
(``bagua-x cluster``'s network namespaces) when run as root; failing that, 4
ranks on one loopback capped at 1 Gbit/s (root and iproute2); failing that,
plain loopback, with a note.  Every algorithm gets the same clock budget
(more if it has not reached the target accuracy by then), and the demo reports
the time to reach the target held-out accuracy and the speedup over allreduce.

The JAX runs train a small MLP on 2 processes on loopback for a fixed number
of steps: they show the same algorithms train in JAX.  They stay off the
cluster because, with JAX's compile per algorithm and 4 processes on a 2-core
machine, the big model there would double the demo's time.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import cluster
from .algorithms import NAMES
from .demo_report import plot, summarize, table
from .launch import can_cap, capped_namespace, free_port, launch, torchrun

SETTINGS = ("auto", "cluster", "capped", "loopback")


def add_arguments(parser) -> None:
    parser.add_argument("--frontend", choices=["torch", "jax", "both"], default="both")
    parser.add_argument("--algorithms", nargs="+", default=NAMES, metavar="NAME", help=f"from {', '.join(NAMES)}")
    parser.add_argument("--setting", choices=SETTINGS, default="auto",
                        help="torch's network: 2x2 cluster, one capped loopback, or plain loopback (auto: the first "
                             "that works here)")
    parser.add_argument("--link", default="1gbit", metavar="RATE", help="inter-node (or capped) link rate, tc syntax")
    parser.add_argument("--target", type=float, default=0.9, help="held-out accuracy whose time to reach is reported")
    parser.add_argument("--seconds", type=float, default=8.0,
                        help="torch: training clock per algorithm (longer until --target is reached)")
    parser.add_argument("--steps", type=int, default=200, help="torch: at most this many steps per algorithm")
    parser.add_argument("--jax-steps", type=int, default=100, help="JAX: steps per algorithm")
    parser.add_argument("--hidden", type=int, default=2048, help="torch: width of the MLP's 2 hidden layers")
    parser.add_argument("--batch", type=int, default=16, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (QAdam uses its own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bagua_x_demo_out", help="where the table (JSON) and figure (PNG) go")


DESCRIBED = {"cluster": "2 nodes x 2 ranks, {rate} inter-node link (network namespaces)",
             "capped": "4 ranks on one loopback capped at {rate}", "loopback": "4 ranks on uncapped loopback"}
LOOPBACK_NOTE = ("the ranks talk over uncapped loopback, where communication is nearly free, so compression "
                 "cannot pay off here; as root the demo runs on a 2-node cluster with a 1 Gbit/s link")


def torch_title(args, setting: str) -> str:
    return f"PyTorch: MLP 64-{args.hidden}-{args.hidden}-10, {DESCRIBED[setting].format(rate=args.link)}"


def choose_setting(requested: str, rate: str) -> tuple[str, str]:
    """(setting, a note saying why not the cluster, or "")."""
    why = cluster.missing_prerequisite()
    if requested == "cluster" and why:
        raise SystemExit(f"--setting cluster: {why}")
    if requested == "capped" and not can_cap():
        raise SystemExit("--setting capped needs root and iproute2 (ip, tc)")
    setting = requested if requested != "auto" else "cluster" if not why else "capped" if can_cap() else "loopback"
    if setting == "capped" and requested == "auto":
        return setting, f"note: no cluster here ({why}), so every link is capped at {rate}, intra-node ones too"
    return setting, "note: " + LOOPBACK_NOTE if setting == "loopback" else ""


def run_torch(args, setting: str, note: str) -> tuple[list, str, str]:
    """All algorithms in one torch job (``demo_torch``): (rank 0's runs, the setting used, its note).

    With ``--setting auto``, a network whose namespaces cannot be made here
    (root without the right to make them, as in some containers) gives way to
    the next one: cluster, then capped, then loopback.
    """
    while True:
        print(f"bagua-x demo on the digits, target {args.target:.0%} held-out accuracy; {torch_title(args, setting)}")
        if note:
            print(note)
        sys.stdout.flush()  # before the ranks' output
        try:
            return _torch_job(args, setting), setting, note
        except (cluster.ClusterUnavailable, subprocess.CalledProcessError) as e:
            if args.setting != "auto" or setting == "loopback":
                raise SystemExit(f"bagua-x demo: {e}") from e
            failed, setting = setting, "capped" if setting == "cluster" and can_cap() else "loopback"
            note = f"note: the {failed} setting could not be made here ({e})" + (
                f"; {LOOPBACK_NOTE}" if setting == "loopback" else "")


def _torch_job(args, setting: str) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bagua_x_demo_") as tmp:
        path = os.path.join(tmp, "torch.json")
        argv = ["-m", "bagua_x.apps.demo_torch", "--json", path, "--steps", str(args.steps),
                "--seconds", str(args.seconds), "--target", str(args.target), "--hidden", str(args.hidden),
                "--batch", str(args.batch), "--lr", str(args.lr), "--seed", str(args.seed), *args.algorithms]
        if setting == "cluster":
            code = cluster.run([sys.executable, *argv], nodes=2, nproc_per_node=2, inter_node=args.link,
                               master_port=free_port())
        elif setting == "capped":
            with capped_namespace(args.link) as prefix:
                code = torchrun(4, argv, prefix)
        else:
            code = torchrun(4, argv)
        if code != 0:
            raise SystemExit(f"bagua-x demo: the torch runs failed (exit status {code})")
        return json.loads(Path(path).read_text())


def run_jax(args) -> list[dict]:
    from . import demo_jax

    # JAX's coordinator gets a port checked free here: MASTER_PORT + 1 (init_distributed's
    # default) may be taken by some other connection, and JAX then crashes instead of raising
    worker = functools.update_wrapper(functools.partial(demo_jax.train, coordinator_port=free_port()), demo_jax.train)
    runs = launch(worker, 2, args.algorithms, args.jax_steps, args.batch, args.lr, args.seed, 5)
    for r in runs:
        print(f"  jax   {r['algorithm']:14s} {len(r['losses']):4d} steps in {r['seconds'][-1]:5.1f} s, "
              f"held-out accuracy {r['accuracy']:.3f}", flush=True)
    return runs


def main(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's warnings about namespaces' host names
    unknown = set(args.algorithms) - set(NAMES)
    if unknown:
        raise SystemExit(f"unknown algorithm {', '.join(sorted(unknown))}; choose from {', '.join(NAMES)}")
    started = time.monotonic()
    setting, note = choose_setting(args.setting, args.link)
    runs = []
    if args.frontend in ("torch", "both"):
        runs, setting, note = run_torch(args, setting, note)
        print(f"  ({time.monotonic() - started:.0f} s so far)")
    titles = {"torch": torch_title(args, setting),
              "jax": f"JAX: MLP 64-128-10, 2 processes on uncapped loopback, {args.jax_steps} steps "
                     "(ms steps: a check that JAX trains, not a timing)"}
    if args.frontend in ("jax", "both"):  # its workers drop gloo's C++ lines themselves (apps/quiet.py)
        print(titles["jax"], flush=True)
        runs += run_jax(args)
    summarize(runs, args.target)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(runs, titles, args.target, out / "demo.png")
    wall = time.monotonic() - started
    (out / "demo.json").write_text(json.dumps({
        "setting": setting, "description": titles["torch"], "link": args.link if setting != "loopback" else None,
        "note": note, "target_accuracy": args.target, "wall_s": wall, "runs": runs}, indent=1))
    print()
    print(table(runs, args.target))
    print(f"\n{wall:.0f} s in all; wrote {out / 'demo.json'} (table) and {out / 'demo.png'} (loss vs time)")
    return 0
