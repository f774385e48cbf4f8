"""Step time on a cluster of nodes: each algorithm flat and hierarchical against DDP, in one job.

    sudo bagua-x cluster --nodes 2 --nproc-per-node 2 --inter-node 1gbit -- \\
        python -m bagua_x.apps.benchmarks.cluster_step [--algorithms bytegrad qadam] [--json OUT]

Every rank (launched by torchrun inside its node's network namespace) builds
a model of ``torch_zoo.py`` (``--model``, as ``torch_vs_ddp.py`` does; QAdam against
DDP + Adam) once per system: DDP, then each algorithm with
``hierarchical=False`` (``flat``), ``True`` (``hierarchical``) and at its
default ``None`` (``default``: the faster of the two, timed over its first
12 steps, during its warm-up; ModelAverage has no hierarchical variant, so it
runs flat only), and
the model with no communication at all (``compute``: the floor
any algorithm can reach while the ranks share the machine's cores).  The systems run in interleaved rounds, the order reversed every
other round, so all see the same machine load; rank 0 prints the median step
times and their ratios to DDP as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics

os.environ.setdefault("OMP_NUM_THREADS", "1")

from bagua_x.apps.benchmarks import torch_vs_ddp as bench  # noqa: E402  (the model, the optimizer, the timing loop)
from bagua_x.apps.benchmarks.shared import ALGORITHMS, MODELS, make_algorithm  # noqa: E402


FLAT_ONLY = {"model_average"}  # no hierarchical variant (as in Bagua)


def build_system(name: str, seed: int, bucket_cap_mb: float, model_name: str):
    """``(model, optimizer)`` of one system: ``compute`` (no communication: the floor), ``ddp``, ``ddp_adam`` or
    ``<algorithm>/<flat|hierarchical|default>``, optionally ``@<bucket cap in MB>`` (else ``bucket_cap_mb``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bagua_x.torch as bxt
    from bagua_x import algorithms as A

    if name == "compute":
        return bench.build(seed, "ddp", "allreduce", model_name)
    if name.startswith("ddp"):
        model, opt = bench.build(seed, "ddp", "qadam" if name == "ddp_adam" else "allreduce", model_name)
        return DDP(model, bucket_cap_mb=bucket_cap_mb), opt
    name, _, cap = name.partition("@")
    bucket_cap_mb = float(cap) if cap else bucket_cap_mb
    algorithm, mode = name.split("/")
    hierarchical = {"flat": False, "hierarchical": True, "default": None}[mode]
    model, opt = bench.build(seed, "bagua_x", algorithm, model_name)
    if algorithm in FLAT_ONLY:
        return bxt.wrap(model, opt, algorithm=make_algorithm(algorithm), bucket_cap_mb=bucket_cap_mb), opt
    if algorithm == "qadam":  # the algorithm is the optimizer's
        opt = bxt.QAdamOptimizer(model.parameters(), lr=1e-4, warmup_steps=2, hierarchical=hierarchical)
        return bxt.wrap(model, opt, bucket_cap_mb=bucket_cap_mb), opt
    make = {"allreduce": A.GradientAllReduce, "bytegrad": A.ByteGrad, "decentralized": A.Decentralized,
            "low_precision_decentralized": A.LowPrecisionDecentralized}[algorithm]
    return bxt.wrap(model, opt, algorithm=make(hierarchical=hierarchical), bucket_cap_mb=bucket_cap_mb), opt


def main():
    import torch
    import torch.distributed as dist

    from bagua_x.core.topology import StepTrial
    from bagua_x.core.comm import Feature

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=["bytegrad", "qadam"],
                        choices=ALGORITHMS)
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--bucket-caps", type=float, nargs="+", metavar="MB",
                        help="run each bagua_x system at each of these bucket caps (``<system>@<MB>``)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()

    torch.set_num_threads(1)
    # the systems share the compiled kernels in this one process: the shapes of all of them must not push
    # dynamo past its recompile limit (8), past which a kernel runs eager for the shapes that come last
    torch._dynamo.config.recompile_limit = 64
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0:  # the defaults' choice of form, with the times it was made on (DEBUG: each trial step's)
        logging.basicConfig(format="%(message)s")
        logging.getLogger("bagua_x.core.topology").setLevel(logging.DEBUG)
    x, y = bench.zoo.batch(args.model, rank)
    names = ["compute", "ddp"] + (["ddp_adam"] if "qadam" in args.algorithms else [])
    names += [f"{a}/{mode}" for a in args.algorithms
              for mode in (("flat",) if a in FLAT_ONLY else ("flat", "hierarchical", "default"))]
    if args.bucket_caps:
        names = [n for n in names if "/" not in n] + [f"{n}@{cap:g}" for n in names if "/" in n
                                                      for cap in args.bucket_caps]
    systems = {n: build_system(n, rank, args.bucket_cap_mb, args.model) for n in names}
    times = {n: [] for n in names}
    trial = StepTrial().steps + 1  # a default runs its trial of both forms and decides within its warm-up
    for n, (model, opt) in systems.items():
        bench.timed(model, opt, x, y, max(args.warmup, trial) if "/default" in n else args.warmup)
    for round_ in range(args.rounds):
        for n in names if round_ % 2 == 0 else names[::-1]:
            times[n].append(bench.timed(*systems[n], x, y, args.steps))
    if rank == 0:
        ms = {n: statistics.median(v) * 1000 for n, v in times.items()}
        baseline = lambda n: ms["ddp_adam" if n.startswith("qadam") else "ddp"]  # noqa: E731
        result = {"model": args.model, "world": dist.get_world_size(), "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                  "ms": ms,
                  "ratio_to_ddp": {n: ms[n] / baseline(n) for n in names if "/" in n},
                  "default_over_nodes": {n: Feature.HIERARCHICAL in systems[n][0].comm.features
                                         for n in names if "/default" in n}}
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    for model, _ in systems.values():
        if hasattr(model, "shutdown"):
            model.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
