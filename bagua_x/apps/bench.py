"""``bagua-x bench``: run the benchmarks of ``benchmarks/`` and print one table of ratios.

Each ratio is measured side by side in one job (bagua_x against DDP, or
against per-leaf ``pmean``), on plain loopback and, with ``--bandwidth``, on a
capped link (a network namespace; root only).  The torch rows run every model
of the zoo (``benchmarks/zoo.py``: an MLP, a transformer, a ResNet) with every
algorithm; ByteGrad on the capped link also reports its limit (compute-only
time + compressed bytes / measured link rate, ``torch_vs_ddp.py --limit``).
The JAX rows add ByteGrad's stages one by one (``jax_stages.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

TORCH_ALGORITHMS = ["allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "model_average", "qadam"]
MODELS = ["mlp", "transformer", "resnet"]  # benchmarks/zoo.py


def add_arguments(parser) -> None:
    parser.add_argument("--algorithms", nargs="+", default=TORCH_ALGORITHMS, metavar="NAME",
                        help=f"torch algorithms to compare with DDP, from {', '.join(TORCH_ALGORITHMS)}")
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS, metavar="NAME",
                        help=f"zoo models for the torch rows, from {', '.join(MODELS)}")
    parser.add_argument("--no-jax", action="store_true", help="skip the JAX rows")
    parser.add_argument("--bandwidth", default="1gbit", help="also measure on links capped at this rate (root only)")
    parser.add_argument("--no-capped", action="store_true", help="measure on plain loopback only")
    parser.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    parser.add_argument("--out", default="bagua_x_bench_out", help="where the JSON and the PNG go")


def _benchmarks_dir() -> Path:
    here = Path(__file__).resolve().parents[2] / "benchmarks"
    if not (here / "torch_vs_ddp.py").exists():
        raise SystemExit("bagua-x bench runs the scripts in the repository's benchmarks/ folder; "
                         "run it from a source checkout (pip install -e .)")
    return here


def _run(cmd: list[str], link: str | None, bench: Path) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        full = [*cmd, "--json", out.name]
        if link:
            full = [str(bench / "with_bandwidth.sh"), link, *full]
        proc = subprocess.run(full, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(full)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        return json.loads(Path(out.name).read_text())


def measure(args) -> list[dict]:
    bench = _benchmarks_dir()
    links: list[str | None] = [None]
    if not args.no_capped:
        if os.geteuid() == 0:
            links.append(args.bandwidth)
        else:
            print(f"(not root: skipping the {args.bandwidth} capped-link runs)")
    rows = []
    jobs = [(link, model, alg) for link in links for model in args.models for alg in args.algorithms]
    jobs += [] if args.no_jax else [(link, None, "jax") for link in links] + [(None, None, "jax-stages")]
    for link, model, what in tqdm(jobs, desc="bagua-x bench"):
        name = link or "loopback"
        if what == "jax-stages":  # in one process: where JAX ByteGrad's time goes, stage by stage
            r = _run([sys.executable, str(bench / "jax_stages.py"), "--iters", "5" if args.quick else "10"], None,
                     bench)
            for stage, ms in r["ms"].items():
                if stage != "pmean":
                    rows.append({"frontend": "jax", "link": "loopback", "model": f"{r['numel'] / 1e6:.1f}M bucket",
                                 "what": f"ByteGrad stage: {stage}", "baseline": "pmean of bucket",
                                 "baseline_ms": r["ms"]["pmean"], "bagua_x_ms": ms, "ratio": ms / r["ms"]["pmean"]})
            continue
        if what == "jax":
            r = _run([sys.executable, str(bench / "jax_vs_pmean.py"), "--iters", "10" if args.quick else "20"],
                     link, bench)
            for setting, key in (("1 process x 4 devices", "single_process"),
                                 ("2 processes x 2 devices", "two_processes")):
                for row in r[key]:
                    rows.append({"frontend": "jax", "link": name, "model": row["tree"],
                                 "what": f"GradientAllReduce, {setting}", "baseline": "per-leaf pmean",
                                 "baseline_ms": row["pmean"], "bagua_x_ms": row["bagua_x"],
                                 "ratio": row["bagua_x"] / row["pmean"]})
            continue
        rows += _torch_rows(args, bench, link, model, what)
    return rows


def _torch_rows(args, bench: Path, link: str | None, model: str, what: str) -> list[dict]:
    few = args.quick or link is not None
    cmd = [sys.executable, str(bench / "torch_vs_ddp.py"), "--model", model, "--algorithm", what,
           "--rounds", "3" if few else "5", "--steps", "5" if few else "10", "--warmup", "5" if few else "10"]
    if link is not None or what != "allreduce" or model != "mlp":
        cmd.append("--skip-memory")
    if link is not None and what == "bytegrad":
        cmd.append("--limit")
    r = _run(cmd, link, bench)
    base = {"frontend": "torch", "link": link or "loopback", "model": model}
    rows = [{**base, "what": what, "baseline": "DDP" + (" + Adam" if what == "qadam" else ""),
             "baseline_ms": r["ddp_ms"], "bagua_x_ms": r["bagua_x_ms"], "ratio": r["time_ratio"]}]
    if "limit_ms" in r:
        rows.append({**base, "what": f"{what} (limit: compute + wire bytes / link)", "baseline": "limit",
                     "baseline_ms": r["limit_ms"], "bagua_x_ms": r["bagua_x_ms"], "ratio": r["limit_ratio"]})
    if "memory_ratio" in r:
        rows.append({**base, "what": f"{what} (peak memory)", "baseline": "DDP",
                     "baseline_ms": None, "bagua_x_ms": None, "ratio": r["memory_ratio"]})
        rows.append({**base, "what": f"{what} (peak memory)", "baseline": "DDP bucket view",
                     "baseline_ms": None, "bagua_x_ms": None, "ratio": r["memory_ratio_bucket_view"]})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'frontend':8s} {'link':9s} {'model':11s} {'benchmark':44s} {'baseline':>16s} {'base ms':>9s} "
            f"{'bagua_x ms':>10s} {'ratio':>6s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        base = f"{r['baseline_ms']:9.1f}" if r["baseline_ms"] is not None else f"{'':9s}"
        ours = f"{r['bagua_x_ms']:10.1f}" if r["bagua_x_ms"] is not None else f"{'':10s}"
        lines.append(f"{r['frontend']:8s} {r['link']:9s} {r['model']:11s} {r['what']:44s} {r['baseline']:>16s} "
                     f"{base} {ours} {r['ratio']:6.2f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['frontend']} {r['link']} {r['model']}: {r['what']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1.5))
    colors = ["tab:green" if r["ratio"] <= 1 else "tab:red" for r in rows]
    ax.barh(range(len(rows)), [r["ratio"] for r in rows], color=colors)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("bagua_x / baseline (lower is better; time unless marked memory)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    rows = measure(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "bench.png")
    print(f"\nmachine: {os.cpu_count()} CPU cores, gloo; ratios measured side by side in one job\n")
    print(table(rows))
    print(f"\nwrote {out / 'bench.json'} and {out / 'bench.png'}")
    return 0
