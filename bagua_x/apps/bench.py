"""``bagua-x bench``: run the benchmarks of ``bagua_x.apps.benchmarks`` and print one table of ratios.

Each ratio is measured side by side in one job (bagua_x against DDP, or
against per-leaf ``pmean``), on plain loopback and, with ``--bandwidth``, on a
capped link (a network namespace; root only).  The torch rows run every model
of the zoo (``torch_zoo.py``: an MLP, a transformer, a ResNet) with every
algorithm; ByteGrad on the capped link also reports its limit (compute-only
time + compressed bytes / measured link rate, ``torch_vs_ddp --limit``).
The JAX rows add ByteGrad's stages one by one (``jax_stages``).

With ``--nodes N`` the rows come from a ``bagua-x cluster`` instead (root
only): N network-namespace nodes of ``--nproc-per-node`` ranks joined by
``--inter-node`` links.  Per model, one torch job times every algorithm
against DDP and the compute-only floor (``cluster_step``), and one JAX job
times every algorithm against per-leaf ``pmean``, bagua_x GradientAllReduce
and the compute-only floor (``jax_cluster_step``, the zoo's MLP and
transformer in flax).

The scripts ship in the package and run as ``python -m
bagua_x.apps.benchmarks.<name>``, so an installed wheel runs the bench too.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from .benchmarks.shared import ALGORITHMS, JAX_MODELS, MODELS

SCRIPTS = "bagua_x.apps.benchmarks"


def add_arguments(parser) -> None:
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS, metavar="NAME",
                        help=f"algorithms to compare with DDP (and on a cluster, JAX's with pmean), "
                             f"from {', '.join(ALGORITHMS)}")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS, metavar="NAME",
                        help=f"zoo models, from {', '.join(MODELS)} (JAX on a cluster: {', '.join(JAX_MODELS)})")
    parser.add_argument("--no-jax", action="store_true", help="skip the JAX rows")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch rows")
    parser.add_argument("--bandwidth", default="1gbit", help="also measure on links capped at this rate (root only)")
    parser.add_argument("--no-capped", action="store_true", help="measure on plain loopback only")
    parser.add_argument("--nodes", type=int, metavar="N",
                        help="measure on a bagua-x cluster of N nodes instead of loopback (root only)")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="with --nodes: ranks per node")
    parser.add_argument("--inter-node", default="1gbit", metavar="RATE", help="with --nodes: inter-node link rate")
    parser.add_argument("--quick", action="store_true", help="fewer rounds (noisier)")
    parser.add_argument("--out", default="bagua_x_bench_out", help="where the JSON and the PNG go")


def _run(script: str, args: list[str], prefix: tuple = ()) -> dict:
    """``python -m bagua_x.apps.benchmarks.<script> ARGS --json OUT`` after ``prefix``; the JSON it wrote."""
    with tempfile.TemporaryDirectory(prefix="bagua_x_bench_") as tmp:
        out = os.path.join(tmp, "out.json")
        full = [*prefix, sys.executable, "-m", f"{SCRIPTS}.{script}", *args, "--json", out]
        proc = subprocess.run(full, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(full)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        return json.loads(Path(out).read_text())


def _run_on_link(script: str, args: list[str], link: str | None) -> dict:
    from .launch import capped_namespace

    with capped_namespace(link) if link else contextlib.nullcontext(()) as prefix:
        return _run(script, args, prefix)


def measure(args) -> list[dict]:
    if args.nodes:
        return measure_cluster(args)
    links: list[str | None] = [None]
    if not args.no_capped:
        if os.geteuid() == 0:
            links.append(args.bandwidth)
        else:
            print(f"(not root: skipping the {args.bandwidth} capped-link runs)")
    rows = []
    jobs = [] if args.no_torch else [(link, model, alg) for link in links for model in args.models
                                     for alg in args.algorithms]
    jobs += [] if args.no_jax else [(link, None, "jax") for link in links] + [(None, None, "jax-stages")]
    for link, model, what in tqdm(jobs, desc="bagua-x bench"):
        name = link or "loopback"
        if what == "jax-stages":  # in one process: where JAX ByteGrad's time goes, stage by stage
            r = _run("jax_stages", ["--iters", "5" if args.quick else "10"])
            for stage, ms in r["ms"].items():
                if stage != "pmean":
                    rows.append({"frontend": "jax", "link": "loopback", "model": f"{r['numel'] / 1e6:.1f}M bucket",
                                 "what": f"ByteGrad stage: {stage}", "baseline": "pmean of bucket",
                                 "baseline_ms": r["ms"]["pmean"], "bagua_x_ms": ms, "ratio": ms / r["ms"]["pmean"]})
            continue
        if what == "jax":
            r = _run_on_link("jax_vs_pmean", ["--iters", "10" if args.quick else "20"], link)
            for setting, key in (("1 process x 4 devices", "single_process"),
                                 ("2 processes x 2 devices", "two_processes")):
                for row in r[key]:
                    rows.append({"frontend": "jax", "link": name, "model": row["tree"],
                                 "what": f"GradientAllReduce, {setting}", "baseline": "per-leaf pmean",
                                 "baseline_ms": row["pmean"], "bagua_x_ms": row["bagua_x"],
                                 "ratio": row["bagua_x"] / row["pmean"]})
            continue
        rows += _torch_rows(args, link, model, what)
    return rows


def _torch_rows(args, link: str | None, model: str, what: str) -> list[dict]:
    few = args.quick or link is not None
    cmd = ["--model", model, "--algorithm", what,
           "--rounds", "3" if few else "5", "--steps", "5" if few else "10", "--warmup", "5" if few else "10"]
    if link is not None or what != "allreduce" or model != "mlp":
        cmd.append("--skip-memory")
    if link is not None and what == "bytegrad":
        cmd.append("--limit")
    r = _run_on_link("torch_vs_ddp", cmd, link)
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


def _run_on_cluster(script: str, argv: list[str], args, env: dict) -> dict:
    from . import cluster
    from .launch import free_port

    with tempfile.TemporaryDirectory(prefix="bagua_x_bench_") as tmp:
        out = os.path.join(tmp, "out.json")
        try:
            code = cluster.run([sys.executable, "-m", f"{SCRIPTS}.{script}", *argv, "--json", out], nodes=args.nodes,
                               nproc_per_node=args.nproc_per_node, inter_node=args.inter_node, timeout=3600,
                               master_port=free_port(), env={**os.environ, "OMP_NUM_THREADS": "1", **env})
        except cluster.ClusterUnavailable as e:
            raise SystemExit(f"bagua-x bench --nodes: {e}") from e
        if code != 0:
            raise SystemExit(f"bagua-x bench: {script} on the cluster failed (exit status {code}); see above")
        return json.loads(Path(out).read_text())


def measure_cluster(args) -> list[dict]:
    """The rows of ``--nodes``: per model, the torch job then the JAX job, each timing every system side by side."""
    link = f"{args.nodes}x{args.nproc_per_node} {args.inter_node}"
    steps = ["--rounds", "2" if args.quick else "3", "--steps", "2" if args.quick else "4", "--warmup", "2"]
    jobs = [] if args.no_torch else [("torch", m) for m in args.models]
    jobs += [] if args.no_jax else [("jax", m) for m in args.models if m in JAX_MODELS]
    rows = []
    for frontend, model in tqdm(jobs, desc="bagua-x bench on the cluster"):
        base = {"frontend": frontend, "link": link, "model": model}
        if frontend == "torch":
            r = _run_on_cluster("cluster_step", ["--model", model, "--algorithms", *args.algorithms, *steps], args, {})
            for name, ratio in r["ratio_to_ddp"].items():
                ddp = "ddp_adam" if name.startswith("qadam") else "ddp"
                rows.append({**base, "what": name, "baseline": "DDP + Adam" if ddp == "ddp_adam" else "DDP",
                             "baseline_ms": r["ms"][ddp], "bagua_x_ms": r["ms"][name], "ratio": ratio})
                rows.append(_against(base, name, "compute only", r["ms"]["compute"], r["ms"][name]))
            continue
        r = _run_on_cluster("jax_cluster_step", ["--model", model, "--algorithms", *args.algorithms, "--jit", *steps],
                            args, {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"})
        ms = r["ms"]
        for name in args.algorithms:
            rows.append(_against(base, name, "per-leaf pmean", ms["pmean"], ms[name]))
            if name != "allreduce":
                rows.append(_against(base, name, "bagua_x allreduce", ms["allreduce"], ms[name]))
            rows.append(_against(base, name, "compute only", ms["compute"], ms[name]))
        for name in (n for n in ms if n.startswith("jit:") and n != "jit:xla"):  # the jit-first style
            rows.append(_against(base, name, "XLA's reduction (jit)", ms["jit:xla"], ms[name]))
    return rows


def _against(base: dict, what: str, baseline: str, baseline_ms: float, ms: float) -> dict:
    return {**base, "what": what, "baseline": baseline, "baseline_ms": baseline_ms, "bagua_x_ms": ms,
            "ratio": ms / baseline_ms}


def table(rows: list[dict]) -> str:
    head = (f"{'frontend':8s} {'link':12s} {'model':11s} {'benchmark':44s} {'baseline':>17s} {'base ms':>9s} "
            f"{'bagua_x ms':>10s} {'ratio':>6s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        base = f"{r['baseline_ms']:9.1f}" if r["baseline_ms"] is not None else f"{'':9s}"
        ours = f"{r['bagua_x_ms']:10.1f}" if r["bagua_x_ms"] is not None else f"{'':10s}"
        lines.append(f"{r['frontend']:8s} {r['link']:12s} {r['model']:11s} {r['what']:44s} {r['baseline']:>17s} "
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
    print(f"\nmachine: {os.cpu_count()} CPU cores, gloo; ratios measured side by side in one job\n")
    print(table(rows))
    print(f"\nwrote {out / 'bench.json'}{plotted(rows, out / 'bench.png')}")
    return 0


def plotted(rows: list[dict], path: Path) -> str:
    """The plot written to ``path``, or why not: the table is already printed, so a missing matplotlib (the
    ``demo`` extra) must not turn a whole finished run into a traceback."""
    try:
        plot(rows, path)
    except ModuleNotFoundError as e:
        if e.name != "matplotlib":
            raise
        return "; no plot: matplotlib is not installed (pip install 'bagua-x[demo]')"
    return f" and {path}"
