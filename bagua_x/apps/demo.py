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

The JAX runs then do the same on the same network (``demo_jax``: one CPU
device per process, gloo across processes) with a narrower MLP (1.1 M
parameters, 4.5 MB of gradient a step, still communication-bound at 1 Gbit/s)
and a shorter clock (2 s): JAX compiles every algorithm's step first, and 4
JAX processes share the 2 cores, so the big model and the torch clock would
take the demo past its 5 minutes from a fresh clone.
"""

from __future__ import annotations

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
from .launch import can_cap, capped_namespace, free_port, torchrun

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
    parser.add_argument("--hidden", type=int, default=2048, help="torch: width of the MLP's 2 hidden layers")
    parser.add_argument("--jax-seconds", type=float, default=2.0, help="JAX: training clock per algorithm")
    parser.add_argument("--jax-steps", type=int, default=200, help="JAX: at most this many steps per algorithm")
    parser.add_argument("--jax-hidden", type=int, default=1024, help="JAX: width of the MLP's 2 hidden layers")
    parser.add_argument("--batch", type=int, default=16, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (QAdam uses its own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bagua_x_demo_out", help="where the table (JSON) and figure (PNG) go")


DESCRIBED = {"cluster": "2 nodes x 2 ranks, {rate} inter-node link (network namespaces)",
             "capped": "4 ranks on one loopback capped at {rate}", "loopback": "4 ranks on uncapped loopback"}
LOOPBACK_NOTE = ("the ranks talk over uncapped loopback, where communication is nearly free, so compression "
                 "cannot pay off here; as root the demo runs on a 2-node cluster with a 1 Gbit/s link")


def title(frontend: str, args, setting: str) -> str:
    hidden = args.hidden if frontend == "torch" else args.jax_hidden
    name = "PyTorch" if frontend == "torch" else "JAX"
    return f"{name}: MLP 64-{hidden}-{hidden}-10, {DESCRIBED[setting].format(rate=args.link)}"


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


def run(frontend: str, args, setting: str, note: str) -> tuple[list, str, str]:
    """All algorithms of ``frontend`` in one job (``demo_torch`` or ``demo_jax``): (process 0's runs, the setting
    used, its note).

    With ``--setting auto``, a network whose namespaces cannot be made here
    (root without the right to make them, as in some containers) gives way to
    the next one: cluster, then capped, then loopback.
    """
    while True:
        print(f"bagua-x demo on the digits, target {args.target:.0%} held-out accuracy; "
              f"{title(frontend, args, setting)}")
        if note:
            print(note)
        sys.stdout.flush()  # before the ranks' output
        try:
            return _job(frontend, args, setting), setting, note
        except (cluster.ClusterUnavailable, subprocess.CalledProcessError) as e:
            if args.setting != "auto" or setting == "loopback":
                raise SystemExit(f"bagua-x demo: {e}") from e
            failed, setting = setting, "capped" if setting == "cluster" and can_cap() else "loopback"
            note = f"note: the {failed} setting could not be made here ({e})" + (
                f"; {LOOPBACK_NOTE}" if setting == "loopback" else "")


def _job(frontend: str, args, setting: str) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bagua_x_demo_") as tmp:
        path = os.path.join(tmp, f"{frontend}.json")
        steps, seconds, hidden = ((args.steps, args.seconds, args.hidden) if frontend == "torch" else
                                  (args.jax_steps, args.jax_seconds, args.jax_hidden))
        argv = ["-m", f"bagua_x.apps.demo_{frontend}", "--json", path, "--steps", str(steps),
                "--seconds", str(seconds), "--target", str(args.target), "--hidden", str(hidden),
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
            raise SystemExit(f"bagua-x demo: the {frontend} runs failed (exit status {code})")
        return json.loads(Path(path).read_text())


def main(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's warnings about namespaces' host names
    unknown = set(args.algorithms) - set(NAMES)
    if unknown:
        raise SystemExit(f"unknown algorithm {', '.join(sorted(unknown))}; choose from {', '.join(NAMES)}")
    started = time.monotonic()
    setting, note = choose_setting(args.setting, args.link)
    runs, titles = [], {}
    for frontend in ("torch", "jax"):
        if args.frontend in (frontend, "both"):
            frontend_runs, setting, note = run(frontend, args, setting, note)
            runs += frontend_runs
            titles[frontend] = title(frontend, args, setting)
            print(f"  ({time.monotonic() - started:.0f} s so far)")
    summarize(runs, args.target)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(runs, titles, args.target, out / "demo.png")
    wall = time.monotonic() - started
    (out / "demo.json").write_text(json.dumps({
        "setting": setting, "description": titles, "link": args.link if setting != "loopback" else None,
        "note": note, "target_accuracy": args.target, "wall_s": wall, "runs": runs}, indent=1))
    print()
    print(table(runs, args.target))
    print(f"\n{wall:.0f} s in all; wrote {out / 'demo.json'} (table) and {out / 'demo.png'} (loss vs time)")
    return 0
