"""``bagua-x demo``: train one small classifier with every algorithm, in both frontends, and compare."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from .algorithms import NAMES
from .launch import free_port, launch


def add_arguments(parser) -> None:
    parser.add_argument("--frontend", choices=["torch", "jax", "both"], default="both")
    parser.add_argument("--algorithms", nargs="+", default=NAMES, metavar="NAME", help=f"from {', '.join(NAMES)}")
    parser.add_argument("--nproc", type=int, default=2, help="local ranks (processes)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (QAdam uses its own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bagua_x_demo_out", help="where the table (JSON) and plot (PNG) go")
    parser.add_argument("--bandwidth", metavar="RATE", help="cap the links between ranks, e.g. 1gbit (root only)")


def run(args) -> list[dict]:
    from . import demo_jax, demo_torch

    frontends = ["torch", "jax"] if args.frontend == "both" else [args.frontend]
    results = []
    for frontend in frontends:
        for name in args.algorithms:
            # JAX's coordinator gets a port checked free here: MASTER_PORT + 1 (init_distributed's
            # default) may be taken by some other connection, and JAX then crashes instead of raising
            worker = demo_torch.train if frontend == "torch" else functools.update_wrapper(
                functools.partial(demo_jax.train, coordinator_port=free_port()), demo_jax.train)
            results.append(launch(worker, args.nproc, name, args.steps, args.batch, args.lr, args.seed))
            r = results[-1]
            print(f"  {frontend:5s} {name:14s} loss {r['losses'][-1]:.4f}  accuracy {r['accuracy']:.3f}", flush=True)
    return results


def table(results: list[dict]) -> str:
    head = f"{'frontend':8s} {'algorithm':14s} {'train loss':>10s} {'accuracy':>9s} {'step ms':>8s} {'computed B/step/rank':>20s}"
    rows = [head, "-" * len(head)]
    for r in results:
        tail = sum(r["losses"][-20:]) / len(r["losses"][-20:])
        rows.append(f"{r['frontend']:8s} {r['algorithm']:14s} {tail:10.4f} {r['accuracy']:9.3f} "
                    f"{r['step_ms']:8.2f} {r['bytes_per_step']:20,.0f}")
    return "\n".join(rows)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    frontends = sorted({r["frontend"] for r in results}, reverse=True)
    fig, axes = plt.subplots(1, len(frontends), figsize=(6 * len(frontends), 4), sharey=True, squeeze=False)
    for ax, frontend in zip(axes[0], frontends):
        for r in results:
            if r["frontend"] == frontend:
                losses = np.asarray(r["losses"])
                k = max(len(losses) // 30, 1)  # moving average for readability
                smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
                ax.plot(np.arange(len(smooth)) + k - 1, smooth, label=r["algorithm"])
        ax.set_title(f"{frontend} frontend")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("train loss (mean over ranks)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    link = os.environ.get("BAGUA_X_LINK", "loopback (uncapped)")
    print(f"bagua-x demo: {args.nproc} ranks on 127.0.0.1, link {link}, {args.steps} steps, digits dataset")
    results = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps({"link": link, "nproc": args.nproc, "runs": results}, indent=1))
    plot(results, out / "demo.png")
    print()
    print(table(results))
    print(f"\nwrote {out / 'demo.json'} (table) and {out / 'demo.png'} (loss curves)")
    return 0
