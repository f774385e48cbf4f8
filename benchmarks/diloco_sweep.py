"""DiLoCo swept over H, P and bits against GradientAllReduce, in one job: loss, accuracy, bytes, step time.

    sudo bagua-x cluster --nodes 2 --nproc-per-node 2 --inter-node 100mbit -- \\
        python benchmarks/diloco_sweep.py [--steps 200] [--json OUT] [--plot OUT.png]
        [--h 8 --p 4 --bits 32 --tau 0 1]   # Streaming's overlap: tau = 1 against tau = 0

Every rank trains the demo's MLP (64-256-256-10, on the digits, SGD with
momentum 0.9 as the inner optimizer, or ``--inner adamw``: AdamW, weight
decay 0.01, the DiLoCo paper's; batch 16 per rank) once per setting, all
from the same seed: GradientAllReduce first (the baseline), then
``DiLoCo(sync_every=H, fragments=P, bits=b, fragment_sync_delay=tau,
hierarchical=False)`` for H in ``--h``, P in ``--p`` (P <= H), b in
``--bits`` and tau in ``--tau`` (tau < H // P), each with every outer lr
and momentum pair in ``--outer`` (``0.7/0.9``, DiLoCo's defaults, unless
given), and with ``--sparse``
``SparseLoCo(sync_every=H)`` for each H.  Flat: every rank is one
worker (``--nodes-as-workers``: a node is one worker, ``hierarchical=None``).

Columns: the final train loss (mean over ranks of the last 10 steps) and the
held-out accuracy after the last step (each rank's own model, all ranks' held-
out shares); the bytes each rank sends per step by the algorithm's
``wire_bytes`` (analytic); the bytes that crossed the node link per step,
from node 0's veth counters (``/proc/net/dev``, read by rank 0 between
barriers: measured, under ``bagua-x cluster`` only, so with the barriers'
few kB per run); both as a ratio to GradientAllReduce's; the step time (the
slowest rank's training clock, evaluations off it) as a ratio to
GradientAllReduce's.  Rank 0 prints the table (and ``--json``; ``--plot``: accuracy against link bytes and
against step time, one point per setting, matplotlib).
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua_x.torch as bxt
from bagua_x.algorithms import DiLoCo, GradientAllReduce, SparseLoCo
from bagua_x.apps.data import load_digits_split, rank_batches
from bagua_x.apps.demo_report import final_loss
from bagua_x.apps.demo_torch import mlp


def link_bytes():
    """rx + tx bytes of this node's inter-node veth (``bagua-x cluster`` names it in GLOO_SOCKET_IFNAME), or None."""
    dev = os.environ.get("GLOO_SOCKET_IFNAME")
    for line in open("/proc/net/dev").read().splitlines()[2:]:
        name, fields = line.split(":", 1)
        if dev and name.strip() == dev:
            fields = fields.split()
            return int(fields[0]) + int(fields[8])
    return None


def counted():
    """Node 0's link counter between two barriers, so no rank's traffic straddles the reading."""
    dist.barrier()
    count = link_bytes() if dist.get_rank() == 0 else None
    dist.barrier()
    return count


def train(algorithm, args, data) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    x_tr, y_tr, x_te, y_te = data
    torch.manual_seed(args.seed)
    model = mlp(args.hidden)
    if args.inner == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    wrapped = bxt.wrap(model, opt, algorithm=algorithm)
    losses, clock = [], 0.0
    before = counted()
    for xb, yb in rank_batches(x_tr, y_tr, rank, world, args.batch, args.steps, args.seed):
        start = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(wrapped(torch.from_numpy(xb)), torch.from_numpy(yb))
        loss.backward()
        opt.step()
        clock += time.perf_counter() - start
        losses.append(loss.item())
    after = counted()
    with torch.no_grad():
        x_eval, y_eval = torch.from_numpy(x_te[rank::world]), torch.from_numpy(y_te[rank::world])
        correct = float((model(x_eval).argmax(1) == y_eval).sum())
    wire = sum(algorithm.wire_bytes(b.layout, b.itemsize, world) for b in wrapped.buckets)
    wrapped.shutdown()
    curve, stats = torch.tensor(losses), torch.tensor([correct, float(len(y_eval))])
    slowest = torch.tensor([clock])
    dist.all_reduce(curve)
    dist.all_reduce(stats)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"final_loss": final_loss({"losses": (curve / world).tolist()}), "accuracy": float(stats[0] / stats[1]),
            "sent_per_step": wire, "link_per_step": None if before is None else (after - before) / args.steps,
            "step_ms": 1000 * float(slowest[0]) / args.steps}


DEFAULT_OUTER = (0.7, 0.9)  # DiLoCo's outer_lr and outer_momentum by default


def _outer(text: str) -> tuple[float, float]:
    lr, _, momentum = text.partition("/")
    return float(lr), float(momentum)


def settings(args):
    yield "GradientAllReduce", GradientAllReduce()
    form = None if args.nodes_as_workers else False
    for h in args.h:
        for p in (p for p in args.p if p <= h):
            for bits in args.bits:
                for tau in (tau for tau in args.tau if tau < h // p):
                    for lr, momentum in args.outer:
                        name = (f"DiLoCo H={h} P={p} bits={bits}" + (f" tau={tau}" if tau else "")
                                + ("" if (lr, momentum) == DEFAULT_OUTER else f" outer {lr:g}/{momentum:g}"))
                        yield name, DiLoCo(sync_every=h, fragments=p, bits=bits, fragment_sync_delay=tau,
                                           outer_lr=lr, outer_momentum=momentum, hierarchical=form)
    if args.sparse:  # the sparse form at its defaults (2 %, 2 bits, outer lr 1, no outer momentum), per H
        for h in args.h:
            yield f"SparseLoCo H={h} P=1 bits=2", SparseLoCo(sync_every=h, hierarchical=form)


def table(rows) -> str:
    base = rows[0]
    head = (f"{'setting':34s} {'final loss':>10s} {'accuracy':>8s} {'sent KB/step/rank':>17s} "
            f"{'link KB/step':>12s} {'bytes vs allreduce':>18s} {'step ms':>8s} {'step time vs allreduce':>22s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        measured = r["link_per_step"] is not None
        ratio = r["link_per_step"] / base["link_per_step"] if measured else r["sent_per_step"] / base["sent_per_step"]
        lines.append(f"{r['setting']:34s} {r['final_loss']:10.4f} {r['accuracy']:8.3f} {r['sent_per_step'] / 1e3:17.1f} "
                     f"{r['link_per_step'] / 1e3 if measured else float('nan'):12.1f} "
                     f"{ratio:17.4f}{'' if measured else '*'} {r['step_ms']:8.1f} {r['step_ms'] / base['step_ms']:22.3f}")
    if base["link_per_step"] is None:
        lines.append("* analytic (no node link here: run under bagua-x cluster to measure)")
    return "\n".join(lines)


def plot(rows, path: str) -> None:
    """Held-out accuracy against bytes across the link and against step time, both relative to allreduce's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = rows[0]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    colors = {32: "tab:blue", 8: "tab:orange", 4: "tab:green"}
    markers = {1: "o", 10: "s", 50: "^"}
    for r in rows:
        measured = r["link_per_step"] is not None and base["link_per_step"] is not None
        x_bytes = (r["link_per_step"] / base["link_per_step"] if measured
                   else r["sent_per_step"] / base["sent_per_step"])
        x_time = r["step_ms"] / base["step_ms"]
        if r is base:
            style = {"color": "black", "marker": "*", "s": 160}
        else:
            fields = dict(f.split("=") for f in r["setting"].split()[1:])
            style = {"color": colors.get(int(fields["bits"]), "gray"), "marker": markers.get(int(fields["H"]), "D"),
                     "s": 40 if fields["P"] == "1" else 90, "alpha": 0.8}
        for ax, x in zip(axes, (x_bytes, x_time)):
            ax.scatter(x, r["accuracy"], **style)
    for ax, label in zip(axes, ("bytes across the node link, x allreduce's", "step time, x allreduce's")):
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("held-out accuracy")
    low = min(r["accuracy"] for r in rows if r["accuracy"] > 0.5)
    bottom = max(0.5, low - 0.03)
    axes[0].set_ylim(bottom, 1.0)
    below = [r["setting"].removeprefix("DiLoCo ") for r in rows if r["accuracy"] < bottom]
    if below:
        axes[0].text(0.02, 0.02, "below the axis (diverged): " + ", ".join(below), transform=axes[0].transAxes,
                     fontsize=7)
    handles = [plt.Line2D([], [], color="black", marker="*", linestyle="", markersize=12, label="GradientAllReduce")]
    handles += [plt.Line2D([], [], color=c, marker="o", linestyle="", label=f"{b} bits") for b, c in colors.items()]
    handles += [plt.Line2D([], [], color="gray", marker=m, linestyle="", label=f"H={h}") for h, m in markers.items()]
    handles += [plt.Line2D([], [], color="gray", marker="o", linestyle="", markersize=10, label="P=4 (large)")]
    axes[1].legend(handles=handles, loc="lower right", fontsize=8)
    fig.suptitle(f"DiLoCo swept: {len(rows) - 1} settings, link {os.environ.get('BAGUA_X_LINK', 'loopback')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--h", type=int, nargs="+", default=[1, 10, 50])
    parser.add_argument("--p", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--bits", type=int, nargs="+", default=[32, 8, 4])
    parser.add_argument("--tau", type=int, nargs="+", default=[0])
    parser.add_argument("--nodes-as-workers", action="store_true")
    parser.add_argument("--sparse", action="store_true", help="add SparseLoCo(sync_every=H) for each H")
    parser.add_argument("--outer", nargs="+", type=_outer, default=[DEFAULT_OUTER], metavar="LR/MOMENTUM",
                        help="DiLoCo's outer lr and (Nesterov) momentum, each pair a setting (default 0.7/0.9)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--inner", choices=["sgd", "adamw"], default="sgd", help="the inner optimizer")
    parser.add_argument("--lr", type=float, default=None, help="the inner lr (default: SGD 0.05, AdamW 1e-3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    parser.add_argument("--plot", help="a PNG of accuracy against link bytes and step time")
    args = parser.parse_args()
    if args.lr is None:
        args.lr = 1e-3 if args.inner == "adamw" else 0.05
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    data = load_digits_split(args.seed)
    rows = []
    for name, algorithm in settings(args):
        rows.append({"setting": name, **train(algorithm, args, data)})
    if dist.get_rank() == 0:
        print(f"DiLoCo sweep: {dist.get_world_size()} ranks, link {os.environ.get('BAGUA_X_LINK', 'loopback')}, "
              f"{args.steps} steps, MLP 64-{args.hidden}-{args.hidden}-10, inner {args.inner} lr {args.lr:g}\n"
              + table(rows), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        if args.plot:
            plot(rows, args.plot)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
