"""``bagua-x demo``: each algorithm's time to a target accuracy on links of 1 Gbit/s, 100 Mbit/s and 10 Mbit/s.

What each algorithm is for shows only where communication costs something:
on uncapped loopback every algorithm follows the same curve and compression
only adds work.  So both frontends train a 1.1 M-parameter MLP (4.5 MB of
gradient a step) on 2 nodes x 2 ranks joined by a capped link (``bagua-x
cluster``'s network namespaces) when run as root; failing that, 4 ranks on one
loopback capped at the same rate (root and iproute2); failing that, plain
loopback, once, with a note.

At the first link every algorithm trains for the same clock, and on until it
reaches the target held-out accuracy: its loss curve and its time to target.
At each slower link it takes the same steps (same seeds, same numbers) and only
its step time changes, so it trains up to the step at which it reached the
target, or stops at ``--cap`` seconds once past its first step, form trial and
one whole exchange period, and the rest is projected at that period's step
time (marked ~ in the table; :mod:`.demo_run`).  That keeps the three links and
both frontends within 8 minutes on a 2-core machine; ``bagua-x bench`` has the
full sweeps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from . import cluster
from .algorithms import DEMO, NAMES
from .demo_report import plot, summarize, table, target_step
from .launch import can_cap, capped_namespace, free_port, torchrun

SETTINGS = ("auto", "cluster", "capped", "loopback")


def add_arguments(parser) -> None:
    parser.add_argument("--frontend", choices=["torch", "jax", "both"], default="both")
    parser.add_argument("--algorithms", nargs="+", default=DEMO, metavar="NAME", help=f"from {', '.join(NAMES)}")
    parser.add_argument("--setting", choices=SETTINGS, default="auto",
                        help="the network: 2x2 cluster, one capped loopback, or plain loopback (auto: the first "
                             "that works here)")
    parser.add_argument("--links", nargs="+", default=["1gbit", "100mbit", "10mbit"], metavar="RATE",
                        help="inter-node (or capped) link rates, tc syntax; the first one trains every algorithm "
                             "to the target, the others take the same steps (or project them past --cap)")
    parser.add_argument("--target", type=float, default=0.9, help="held-out accuracy whose time to reach is reported")
    parser.add_argument("--seconds", type=float, default=2.5,
                        help="first link: training clock per algorithm (longer until --target is reached)")
    parser.add_argument("--cap", type=float, default=4.0,
                        help="slower links: the clock per algorithm past which the steps left are projected")
    parser.add_argument("--steps", type=int, default=200, help="at most this many steps per algorithm")
    parser.add_argument("--hidden", type=int, default=1024, help="width of the MLP's 2 hidden layers")
    parser.add_argument("--batch", type=int, default=16, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (QAdam uses its own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bagua_x_demo_out", help="where the table (JSON) and figure (PNG) go")


DESCRIBED = {"cluster": "2 nodes x 2 ranks, {rate} inter-node link (network namespaces)",
             "capped": "4 ranks on one loopback capped at {rate}", "loopback": "4 ranks on uncapped loopback"}
LOOPBACK_NOTE = ("the ranks talk over uncapped loopback, where communication is nearly free, so compression "
                 "cannot pay off here; as root the demo runs on a 2-node cluster with capped links")


def title(frontend: str, args, setting: str, link: Optional[str]) -> str:
    name = "PyTorch" if frontend == "torch" else "JAX"
    return f"{name}: MLP 64-{args.hidden}-{args.hidden}-10, {DESCRIBED[setting].format(rate=link)}"


def choose_setting(requested: str) -> tuple[str, str]:
    """(setting, a note saying why not the cluster, or "")."""
    why = cluster.missing_prerequisite()
    if requested == "cluster" and why:
        raise SystemExit(f"--setting cluster: {why}")
    if requested == "capped" and not can_cap():
        raise SystemExit("--setting capped needs root and iproute2 (ip, tc)")
    setting = requested if requested != "auto" else "cluster" if not why else "capped" if can_cap() else "loopback"
    if setting == "capped" and requested == "auto":
        return setting, f"note: no cluster here ({why}), so each rate caps every link, intra-node ones too"
    return setting, "note: " + LOOPBACK_NOTE if setting == "loopback" else ""


def run(frontend: str, args, setting: str, note: str, link: Optional[str] = None,
        reference: Optional[dict] = None) -> tuple[list, str, str]:
    """The algorithms of ``frontend`` in one job (``demo_torch`` or ``demo_jax``) at ``link``: (process 0's runs,
    the setting used, its note).  ``reference``: at a slower link, the step at which each algorithm reached the
    target at the first one (only those run).

    With ``--setting auto``, a network whose namespaces cannot be made here
    (root without the right to make them, as in some containers) gives way to
    the next one: cluster, then capped, then loopback.
    """
    while True:
        print(f"bagua-x demo on the digits, target {args.target:.0%} held-out accuracy; "
              f"{title(frontend, args, setting, link)}")
        if note:
            print(note)
        sys.stdout.flush()  # before the ranks' output
        try:
            runs = _job(frontend, args, setting, link if setting != "loopback" else None, reference)
            return [{**r, "link": link if setting != "loopback" else None} for r in runs], setting, note
        except (cluster.ClusterUnavailable, subprocess.CalledProcessError) as e:
            if args.setting != "auto" or setting == "loopback":
                raise SystemExit(f"bagua-x demo: {e}") from e
            failed, setting = setting, "capped" if setting == "cluster" and can_cap() else "loopback"
            note = f"note: the {failed} setting could not be made here ({e})" + (
                f"; {LOOPBACK_NOTE}" if setting == "loopback" else "")


def _job(frontend: str, args, setting: str, link: Optional[str], reference: Optional[dict]) -> list[dict]:
    algorithms = args.algorithms if reference is None else [a for a in args.algorithms if a in reference]
    with tempfile.TemporaryDirectory(prefix="bagua_x_demo_") as tmp:
        path = os.path.join(tmp, f"{frontend}.json")
        argv = ["-m", f"bagua_x.apps.demo_{frontend}", "--json", path, "--steps", str(args.steps),
                "--seconds", str(args.seconds), "--target", str(args.target), "--hidden", str(args.hidden),
                "--batch", str(args.batch), "--lr", str(args.lr), "--seed", str(args.seed), *algorithms]
        if reference is not None:
            argv += ["--cap", str(args.cap), "--reference", *(f"{a}={reference[a]}" for a in algorithms)]
        if setting == "cluster":
            code = cluster.run([sys.executable, *argv], nodes=2, nproc_per_node=2, inter_node=link,
                               master_port=free_port())
        elif setting == "capped":
            with capped_namespace(link) as prefix:
                code = torchrun(4, argv, prefix)
        else:
            code = torchrun(4, argv)
        if code != 0:
            raise SystemExit(f"bagua-x demo: the {frontend} runs failed (exit status {code})")
        return json.loads(Path(path).read_text())


def _frontend(frontend: str, args, setting: str, note: str) -> tuple[list, str, str]:
    """Every link of one frontend: the first trains each algorithm to the target, the slower ones take its steps."""
    runs, reference = [], None
    for link in args.links:
        started = time.monotonic()
        link_runs, setting, note = run(frontend, args, setting, note, link, reference)
        print(f"  ({time.monotonic() - started:.0f} s)")
        runs += link_runs
        if setting == "loopback":  # one uncapped network: the rates do not apply
            break
        if reference is None:
            reference = {r["algorithm"]: step for r in link_runs if (step := target_step(r, args.target))}
            if missed := [a for a in args.algorithms if a not in reference]:
                print(f"  not run at the slower links: {', '.join(missed)} (missed the target in {args.steps} steps)")
    return runs, setting, note


def main(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's warnings about namespaces' host names
    unknown = set(args.algorithms) - set(NAMES)
    if unknown:
        raise SystemExit(f"unknown algorithm {', '.join(sorted(unknown))}; choose from {', '.join(NAMES)}")
    started = time.monotonic()
    setting, note = choose_setting(args.setting)
    runs, titles = [], {}
    for frontend in ("torch", "jax"):
        if args.frontend in (frontend, "both"):
            frontend_runs, setting, note = _frontend(frontend, args, setting, note)
            runs += frontend_runs
            titles[frontend] = title(frontend, args, setting, "/".join(args.links))
            print(f"  ({time.monotonic() - started:.0f} s so far)")
    summarize(runs, args.target)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(runs, titles, args.target, out / "demo.png")
    wall = time.monotonic() - started
    (out / "demo.json").write_text(json.dumps({
        "setting": setting, "description": titles, "links": args.links if setting != "loopback" else [None],
        "note": note, "target_accuracy": args.target, "wall_s": wall, "runs": runs}, indent=1))
    print()
    print(table(runs, args.target))
    print(f"\n{wall:.0f} s in all; wrote {out / 'demo.json'} (table) and {out / 'demo.png'} (time to target, loss)")
    return 0
