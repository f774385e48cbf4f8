"""The demo's results: time to a target held-out accuracy, speedup over allreduce, the table and the figure.

Time to target is the figure Bagua's paper leads with: what a user waits for.
It is the training clock (slowest rank) at the first evaluation whose held-out
accuracy reaches the target; a run that never gets there is "not reached", and
has no speedup, rather than an error.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Optional


def time_to_target(run: dict, target: float) -> Optional[float]:
    for step, accuracy in run["evals"]:
        if accuracy >= target:
            return run["seconds"][step - 1]
    return None


def summarize(runs: list[dict], target: float) -> None:
    """Add ``time_to_target_s`` and ``speedup_vs_allreduce`` (None when either run missed the target) to each run."""
    for r in runs:
        r["time_to_target_s"] = time_to_target(r, target)
    base = {r["frontend"]: r["time_to_target_s"] for r in runs if r["algorithm"] == "allreduce"}
    for r in runs:
        b, t = base.get(r["frontend"]), r["time_to_target_s"]
        r["speedup_vs_allreduce"] = b / t if b and t else None


def _reached(r: dict) -> str:
    return "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f} s"


def _speedup(r: dict) -> str:
    return "-" if r["speedup_vs_allreduce"] is None else f"{r['speedup_vs_allreduce']:.2f}x"


def final_loss(r: dict, last: int = 10) -> float:
    """The train loss over the run's last ``last`` steps: one step's loss is one batch's, too noisy to compare."""
    tail = r["losses"][-last:]
    return sum(tail) / len(tail)


def table(runs: list[dict], target: float) -> str:
    head = (f"{'frontend':8s} {'algorithm':14s} {'steps':>5s} {'step ms':>8s} {f'to {target:.0%} acc':>12s} "
            f"{'speedup':>8s} {'accuracy':>8s} {'final loss':>10s} {'sent MB/step/rank':>17s}")
    rows = [head, "-" * len(head)]
    for r in runs:
        rows.append(f"{r['frontend']:8s} {r['algorithm']:14s} {len(r['losses']):5d} {r['step_ms']:8.1f} "
                    f"{_reached(r):>12s} {_speedup(r):>8s} {r['accuracy']:8.3f} {final_loss(r):10.4f} "
                    f"{r['bytes_per_step'] / 1e6:17.3f}")
    return "\n".join(rows)


def plot(runs: list[dict], titles: dict, target: float, path: Path) -> None:
    """Loss against the training clock, one panel per frontend; the legend gives time to target and speedup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    frontends = [f for f in ("torch", "jax") if any(r["frontend"] == f for r in runs)]
    fig, axes = plt.subplots(1, len(frontends), figsize=(7 * len(frontends), 4.8), squeeze=False)
    for ax, frontend in zip(axes[0], frontends):
        for r in (r for r in runs if r["frontend"] == frontend):
            losses, seconds = np.asarray(r["losses"]), np.asarray(r["seconds"])
            k = max(min(len(losses) // 10, 8), 1)  # moving average over k steps, for readability
            smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
            label = f"{r['algorithm']}: {_reached(r)}" + (f", {_speedup(r)}" if r["speedup_vs_allreduce"] else "")
            line, = ax.plot(seconds[k - 1:], smooth, label=label)
            if r["time_to_target_s"] is not None:
                ax.axvline(r["time_to_target_s"], color=line.get_color(), alpha=0.4, linestyle=":")
        ax.set_title(textwrap.fill(titles[frontend], 75), fontsize=9)
        ax.set_xlabel("training wall-clock time (s, slowest rank)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(title=f"time to {target:.0%} held-out accuracy, speedup", fontsize=8, title_fontsize=8)
    axes[0][0].set_ylabel("train loss (mean over ranks)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
