"""The demo's results: time to a target held-out accuracy, speedup over allreduce, the table and the figure.

Time to target is the figure Bagua's paper leads with: what a user waits for.
At the first link it is the training clock (slowest rank) at the first
evaluation whose held-out accuracy reaches the target; a run that never gets
there is "not reached", and has no speedup, rather than an error.  At a slower
link it is the clock at that same step, projected where the run stopped
earlier (:mod:`.demo_run`).  Speedups compare runs of one frontend at one link.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Optional


def target_step(run: dict, target: float) -> Optional[int]:
    """The step of the run's first evaluation at or above ``target`` (None: never)."""
    return next((step for step, accuracy in run["evals"] if accuracy >= target), None)


def time_to_target(run: dict, target: float) -> tuple[Optional[float], bool]:
    """(seconds on the clock to the target, whether projected).

    A run at a slower link has a ``reference_step``: its clock there, or, if
    it stopped before, its clock at the end plus the steps left at the mean step
    time of its last ``window`` steps (one whole exchange period)."""
    reference = run.get("reference_step")
    if reference is None:
        step = target_step(run, target)
        return (None if step is None else run["seconds"][step - 1]), False
    seconds, window = run["seconds"], run["window"]
    if len(seconds) >= reference:
        return seconds[reference - 1], False
    per_step = (seconds[-1] - seconds[-1 - window]) / window
    return seconds[-1] + (reference - len(seconds)) * per_step, True


def summarize(runs: list[dict], target: float) -> None:
    """Add ``time_to_target_s``, ``projected`` and ``speedup_vs_allreduce`` (None when either run missed the
    target) to each run; speedups are over allreduce in the same frontend at the same link."""
    for r in runs:
        r["time_to_target_s"], r["projected"] = time_to_target(r, target)
    base = {(r["frontend"], r.get("link")): r["time_to_target_s"] for r in runs if r["algorithm"] == "allreduce"}
    for r in runs:
        b, t = base.get((r["frontend"], r.get("link"))), r["time_to_target_s"]
        r["speedup_vs_allreduce"] = b / t if b and t else None


def _reached(r: dict) -> str:
    if r["time_to_target_s"] is None:
        return "not reached"
    return ("~" if r["projected"] else "") + f"{r['time_to_target_s']:.1f} s"


def _speedup(r: dict) -> str:
    return "-" if r["speedup_vs_allreduce"] is None else f"{r['speedup_vs_allreduce']:.2f}x"


def final_loss(r: dict, last: int = 10) -> float:
    """The train loss over the run's last ``last`` steps: one step's loss is one batch's, too noisy to compare."""
    tail = r["losses"][-last:]
    return sum(tail) / len(tail)


def table(runs: list[dict], target: float) -> str:
    """One row per run; ``~``: projected (the run stopped before the step at which it reaches the target)."""
    head = (f"{'frontend':8s} {'link':8s} {'algorithm':14s} {'steps':>5s} {'step ms':>8s} "
            f"{f'to {target:.0%} acc':>12s} {'speedup':>8s} {'accuracy':>8s} {'final loss':>10s} "
            f"{'sent MB/step/rank':>17s}")
    rows = [head, "-" * len(head)]
    for r in runs:
        rows.append(f"{r['frontend']:8s} {r.get('link') or 'loopback':8s} {r['algorithm']:14s} "
                    f"{len(r['losses']):5d} {r['step_ms']:8.1f} {_reached(r):>12s} {_speedup(r):>8s} "
                    f"{'-' if r['projected'] else format(r['accuracy'], '.3f'):>8s} {final_loss(r):10.4f} {r['bytes_per_step'] / 1e6:17.3f}")
    if any(r["projected"] for r in runs):
        rows.append("~: projected, the run stopped at --cap (the steps left at its last exchange period's step time)")
    return "\n".join(rows)


def plot(runs: list[dict], titles: dict, target: float, path: Path) -> None:
    """Per frontend: time to target at each link (bars, hatched where projected), and loss against the clock at
    the first link (the legend gives time to target and speedup)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    frontends = [f for f in ("torch", "jax") if any(r["frontend"] == f for r in runs)]
    fig, axes = plt.subplots(len(frontends), 2, figsize=(14, 4.8 * len(frontends)), squeeze=False)
    for (bars, curves), frontend in zip(axes, frontends):
        mine = [r for r in runs if r["frontend"] == frontend]
        links = list(dict.fromkeys(r.get("link") for r in mine))
        algorithms = list(dict.fromkeys(r["algorithm"] for r in mine))
        width = 0.8 / len(algorithms)
        for i, algorithm in enumerate(algorithms):
            for j, link in enumerate(links):
                r = next((r for r in mine if r["algorithm"] == algorithm and r.get("link") == link), None)
                if r is None or r["time_to_target_s"] is None:
                    continue
                bars.bar(j + (i - (len(algorithms) - 1) / 2) * width, r["time_to_target_s"], width,
                         color=f"C{i}", hatch="//" if r["projected"] else None, label=algorithm if j == 0 else None)
        bars.set_xticks(range(len(links)), [link or "uncapped" for link in links])
        bars.set_yscale("log")
        bars.set_ylabel(f"time to {target:.0%} held-out accuracy (s)")
        bars.set_title(textwrap.fill(titles[frontend], 75) + "\n(hatched: projected)", fontsize=9)
        bars.grid(alpha=0.3, axis="y")
        bars.legend(fontsize=8)
        for r in (r for r in mine if r.get("link") == links[0]):
            losses, seconds = np.asarray(r["losses"]), np.asarray(r["seconds"])
            k = max(min(len(losses) // 10, 8), 1)  # moving average over k steps, for readability
            smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
            label = f"{r['algorithm']}: {_reached(r)}" + (f", {_speedup(r)}" if r["speedup_vs_allreduce"] else "")
            line, = curves.plot(seconds[k - 1:], smooth, label=label)
            if r["time_to_target_s"] is not None:
                curves.axvline(r["time_to_target_s"], color=line.get_color(), alpha=0.4, linestyle=":")
        curves.set_title(f"{frontend} at {links[0] or 'uncapped loopback'}: train loss (mean over ranks)", fontsize=9)
        curves.set_xlabel("training wall-clock time (s, slowest rank)")
        curves.set_yscale("log")
        curves.grid(alpha=0.3)
        curves.legend(title=f"time to {target:.0%} held-out accuracy, speedup", fontsize=8, title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
