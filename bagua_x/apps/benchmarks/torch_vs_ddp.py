"""bagua_x.torch.wrap vs torch DDP: step time and peak memory, measured side by side.

    python -m bagua_x.apps.benchmarks.torch_vs_ddp                       # GradientAllReduce vs DDP
    python -m bagua_x.apps.benchmarks.torch_vs_ddp --algorithm bytegrad  # any bagua_x algorithm vs DDP
    python -m bagua_x.apps.benchmarks.torch_vs_ddp --model transformer   # a model of the zoo (torch_zoo.py)

Models: torch_zoo.py (default the MLP, 12 x Linear(1024, 1024), batch 64
per rank), SGD with momentum, 2 gloo ranks on this machine, OMP_NUM_THREADS=1.

Time: one job runs DDP and bagua_x in interleaved rounds, so both see the same
machine load, alternating which goes first (DDP then bagua_x, then bagua_x then
DDP, ...) so that neither always follows the other; the ratio is the median
over rounds of each round's bagua_x/DDP step-time ratio (the two were timed
back to back, so load that drifts between rounds cancels), on rank 0 after
warm-up.  The milliseconds shown are the median per-round step times.

Memory: torch has no allocator statistics on CPU, and a process's peak RSS
(``ru_maxrss``) cannot be split between two systems living in one process.
So each system also runs alone in a fresh 2-rank job, and each rank reports
its peak RSS minus its RSS just before wrapping (model, optimizer and data
already built): the memory the training loop and the data-parallel machinery
add (gradients, momentum, buckets, activations, communication buffers).
These jobs run with ``MALLOC_MMAP_THRESHOLD_=131072``: glibc then serves every
large block with mmap and returns it to the OS when freed, so RSS follows live
tensor memory instead of the allocator's high-water mark.  The ratio is of the
larger rank's values, against DDP both as most users run it
(``gradient_as_bucket_view=False``: buckets and gradients are separate) and in
its zero-copy mode (``gradient_as_bucket_view=True``, what a memory-minded user
sets).  ``--ddp-bucket-view`` makes the timed DDP use the zero-copy mode too.

Limit (``--limit``, for compressing algorithms on a capped link): the rounds
also time the bare model (no data parallelism: compute only), and after them
a gloo allreduce of 16 MB measures the link rate (bytes each rank sends per
second, ring allreduce).  The limit of a step is compute-only time + the bytes
each rank sends per step (``algorithm.wire_bytes`` over the buckets) / that
rate: computing and sending the compressed bytes at the link's rate, one after
the other, with nothing else in the way.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import resource
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from bagua_x.apps.benchmarks import torch_zoo as zoo  # noqa: E402
from bagua_x.apps.benchmarks.shared import ALGORITHMS, MODELS, make_algorithm  # noqa: E402

def build(seed: int, system: str = "ddp", algorithm: str = "allreduce", model_name: str = "mlp"):
    """The model and its optimizer; QAdam is compared with DDP + Adam (what it replaces)."""
    import torch

    import bagua_x.torch as bxt

    torch.manual_seed(seed)
    model = zoo.build(model_name)
    if algorithm == "qadam":
        if system == "ddp":
            return model, torch.optim.Adam(model.parameters(), lr=1e-4)
        return model, bxt.QAdamOptimizer(model.parameters(), lr=1e-4, warmup_steps=2)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def wrap_system(system: str, model, opt, args):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bagua_x.torch as bxt

    if system == "ddp":
        return DDP(model, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.ddp_bucket_view)
    if system == "compute":
        return model
    if system == "ddp_bucket_view":
        return DDP(model, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=True)
    algorithm = None if args.algorithm == "qadam" else make_algorithm(args.algorithm)  # QAdam: the optimizer's
    return bxt.wrap(model, opt, algorithm=algorithm, bucket_cap_mb=args.bucket_cap_mb)


def step(model, opt, x, y):
    import torch.nn.functional as F

    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def timed(model, opt, x, y, steps: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step(model, opt, x, y)
    dist.barrier()
    return (time.perf_counter() - start) / steps


def _init(rank: int, nproc: int, port: int, model_name: str):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc)
    return zoo.batch(model_name, rank)


def time_job(rank: int, nproc: int, port: int, args, results):
    import torch.distributed as dist

    x, y = _init(rank, nproc, port, args.model)
    systems = {}
    for system in ("ddp", "bagua_x", *(("compute",) if args.limit else ())):
        model, opt = build(seed=rank, system="bagua_x" if system == "bagua_x" else "ddp", algorithm=args.algorithm,
                           model_name=args.model)
        systems[system] = (wrap_system(system, model, opt, args), opt)
    for model, opt in systems.values():  # warm-up: compiled kernels, allocator, first-step state, gloo connections
        timed(model, opt, x, y, args.warmup)
    times = {s: [] for s in systems}
    for round_ in range(args.rounds):
        order = list(systems.items())
        for system, (model, opt) in order if round_ % 2 == 0 else order[::-1]:
            times[system].append(timed(model, opt, x, y, args.steps))
    if args.limit:
        wrapped = systems["bagua_x"][0]
        wire = sum(wrapped.algorithm.wire_bytes(b.layout, b.itemsize, nproc) for b in wrapped.buckets)
        times.update(wire_bytes=wire, link_bytes_per_s=link_rate(nproc))
    results.put((rank, times))
    dist.barrier()
    dist.destroy_process_group()


def link_rate(nproc: int, nbytes: int = 16 * 2**20, reps: int = 3) -> float:
    """Bytes each rank sends per second in a gloo ring allreduce of ``nbytes`` (after one warm-up)."""
    import torch
    import torch.distributed as dist

    from bagua_x.algorithms.base import ring_allreduce_bytes

    t = torch.zeros(nbytes // 4)
    dist.all_reduce(t)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(t)
    dist.barrier()
    return ring_allreduce_bytes(t.numel(), 4, nproc) * reps / (time.perf_counter() - start)


def memory_job(rank: int, nproc: int, port: int, args, results, system: str):
    import torch.distributed as dist

    x, y = _init(rank, nproc, port, args.model)
    model, opt = build(seed=rank, system=system, algorithm=args.algorithm, model_name=args.model)
    before = _rss_mb()
    wrapped = wrap_system(system, model, opt, args)
    timed(wrapped, opt, x, y, args.warmup + args.steps)
    results.put((rank, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before))
    dist.barrier()
    dist.destroy_process_group()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def launch(fn, args, *extra):
    import socket

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=fn, args=(r, args.nproc, port, args, results, *extra)) for r in range(args.nproc)]
    for p in procs:
        p.start()
    out = {}
    while len(out) < len(procs):
        try:
            rank, value = results.get(timeout=5)
            out[rank] = value
        except queue.Empty:  # a rank that died never reports: stop the others instead of waiting forever
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                sys.exit(f"a rank of {fn.__name__} failed (exit codes {[p.exitcode for p in procs]}); see above")
    for p in procs:
        p.join()
        if p.exitcode:
            sys.exit(f"a rank of {fn.__name__} failed with exit code {p.exitcode}")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="allreduce")
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before the rounds")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--ddp-bucket-view", action="store_true", help="DDP with gradient_as_bucket_view=True")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--limit", action="store_true", help="also time compute only and the link: the step's limit")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    result = {"algorithm": args.algorithm, "model": args.model, "nproc": args.nproc}

    times = launch(time_job, args)[0]
    wire, rate = times.pop("wire_bytes", None), times.pop("link_bytes_per_s", None)
    med = {s: statistics.median(v) * 1000 for s, v in times.items()}
    print(f"model={args.model} algorithm={args.algorithm} nproc={args.nproc} "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} rounds={args.rounds}x{args.steps} steps")
    for s, v in times.items():
        print(f"  {s:8s} step time: median {med[s]:7.1f} ms   rounds: {' '.join(f'{t * 1000:.1f}' for t in v)}")
    ratio = statistics.median(b / d for b, d in zip(times["bagua_x"], times["ddp"]))
    print(f"  time ratio bagua_x/DDP (median of per-round ratios): {ratio:.3f}")
    result.update(ddp_ms=med["ddp"], bagua_x_ms=med["bagua_x"], time_ratio=ratio)
    if args.limit:
        limit = med["compute"] + wire / rate * 1000
        limit_ratio = statistics.median(b / (c + wire / rate) for b, c in zip(times["bagua_x"], times["compute"]))
        print(f"  limit: compute only {med['compute']:.1f} ms + {wire / 2**20:.2f} MiB sent per rank / "
              f"{rate * 8 / 1e6:.0f} Mbit/s measured = {limit:.1f} ms; bagua_x/limit: {limit_ratio:.3f}")
        result.update(compute_ms=med["compute"], wire_bytes=wire, link_bytes_per_s=rate, limit_ms=limit,
                      limit_ratio=limit_ratio)
    if not args.skip_memory:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # inherited by the spawned ranks
        mem = {s: max(launch(memory_job, args, s).values()) for s in ("ddp", "ddp_bucket_view", "bagua_x")}
        for s, v in mem.items():
            print(f"  {s:15s} peak RSS added by training: {v:7.1f} MB")
        print(f"  memory ratio bagua_x/DDP: {mem['bagua_x'] / mem['ddp']:.3f} "
              f"(DDP with gradient_as_bucket_view=True: {mem['bagua_x'] / mem['ddp_bucket_view']:.3f})")
        result.update(ddp_mb=mem["ddp"], ddp_bucket_view_mb=mem["ddp_bucket_view"], bagua_x_mb=mem["bagua_x"],
                      memory_ratio=mem["bagua_x"] / mem["ddp"],
                      memory_ratio_bucket_view=mem["bagua_x"] / mem["ddp_bucket_view"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
