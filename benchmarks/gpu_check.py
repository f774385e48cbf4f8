"""The GPU check: 14 checks of bagua_x on one CUDA GPU (written for one H200), or with ``--gpus N`` 11 checks of
what can only go wrong on several GPUs; one JSON file of results.

    python benchmarks/gpu_check.py                    # on the GPU machine (benchmarks/gpu_check.sh calls this)
    python benchmarks/gpu_check.py --cpu              # the dry run: what needs no CUDA, with CPU stand-ins
    python benchmarks/gpu_check.py --only 2,7 out.json
    python benchmarks/gpu_check.py --gpus 8           # on a machine with 8 GPUs (checks 20-30)
    python benchmarks/gpu_check.py --gpus 8 --cpu     # their dry run: 8 gloo processes on the CPU

Each check runs in fresh processes (tests/launch.py's ``run_workers``, a hard
timeout each, 2 processes where the check needs ranks), so a hung GPU, a
broken process group or a crashed check costs that check only, and JAX never
shares a process with torch.  The whole run is bounded by ``--budget``
seconds (default 300: 5 minutes on an H200); a check that would start after
it is spent fails as not run.

Status per check: ``pass``, ``fail`` (a criterion not met, an exception, a
timeout, a missing piece such as nccl4py) or ``needs GPU`` (the CPU dry run
could not judge it).  Exit status: 0 when every check passed -- in the dry run
when none failed ("needs GPU" is expected there) -- else 1.

``--gpus N`` (:data:`MULTI_CHECKS`, modules ``gpu_check_multi`` and ``gpu_check_multi_jax``): with N GPUs
each of N processes takes one (NCCL); with fewer GPUs the checks one GPU can simulate run with every
process on GPU 0 through gloo, and the others report ``needs N GPUs`` and fail the run; with ``--cpu`` (or
no CUDA) every check runs its dry run on N gloo processes, judging what needs no GPU, and ``needs N GPUs``
does not fail it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from launch import run_workers  # noqa: E402  (tests/launch.py: N processes, torchrun variables, a hard timeout)

PASS, FAIL, NEEDS_GPU, NOT_APPLICABLE = "pass", "fail", "needs GPU", "not applicable"


@dataclasses.dataclass(frozen=True)
class Check:
    """One check: ``target`` ("module:function") is called as ``function(device)`` on ``nproc`` ranks and
    returns ``{"values": ..., "problems": [...], "judged": bool}`` (see :func:`gpu_check_common.result`).

    ``dry_run``: what the CPU stand-in does, or None when nothing of the check runs without CUDA.
    """

    number: int
    name: str
    criterion: str
    target: str
    timeout: float
    dry_run: str | None = None
    nproc: int = 1
    cpu_nproc: int | None = None  # a different number of ranks in the dry run


T = "gpu_check_torch"
CHECKS = [
    Check(0, "gate", "CUDA, NCCL (version), JAX GPU devices and Triton all present",
          "gpu_check_other:gate", 60, "the versions only (nothing to gate on without CUDA)"),
    Check(1, "DDP parity with NCCL, world size 1",
          "wrap vs DDP <= 1e-6; buckets on cuda:0; grads are bucket views; the communication thread on device 0",
          f"{T}:ddp_parity", 60, "gloo on CPU: parity and bucket views"),
    Check(2, "every algorithm, 5 steps on a 20M-parameter MLP",
          "finite loss for each; ByteGrad within one quantisation step of the numpy reference",
          f"{T}:every_algorithm", 150, "gloo on CPU with a small MLP (kernels stay eager)"),
    Check(3, "no host sync (set_sync_debug_mode('error') after warm-up)",
          "GradientAllReduce, ByteGrad, QAdam, PowerSGD (its first compressed step included) and PowerSGD as a "
          "DDP comm hook train 3 steps without a synchronising call",
          f"{T}:no_host_sync", 90, "the same training on CPU, without the sync debug mode (not judged)"),
    Check(4, "backward on a side stream", "with torch.cuda._sleep in an early hook: the result equals the reference",
          f"{T}:side_stream", 60, "the same code on CPU with time.sleep (no streams)"),
    Check(5, "stream waits during backward (profiler)", "at most 1 wait of the compute stream during backward",
          f"{T}:stream_waits", 60, "the profiling on CPU (no streams to count: not judged)"),
    Check(6, "step time against DDP (CUDA events)", "GradientAllReduce step time <= 1.05 x DDP's, world size 1",
          f"{T}:step_time", 60, "the timing with perf_counter on CPU (not judged)"),
    Check(7, "compression kernels at ByteGrad's shapes",
          "11 bytes per element at >= 75 % of a copy's bandwidth measured in the same run, >= 5x eager, "
          "first compile <= 60 s; "
          "within one quantisation step of the numpy reference",
          "gpu_check_other:compression_kernels", 120, "eager numerics against the numpy reference at small shapes"),
    Check(8, "peak memory", "peak allocated <= DDP's (gradient_as_bucket_view=True) + 5 %",
          f"{T}:peak_memory", 60, "the same training on CPU (no allocator statistics: not judged)"),
    Check(9, "bounded wait: wrap(timeout=2), a rank hangs 5 s", "backward raises within 4 s",
          f"{T}:bounded_wait", 45, "2 gloo ranks, one sleeping 5 s in a hook", cpu_nproc=2),
    Check(10, "JAX pmap, shard_map and jit-first under transfer_guard('disallow')", "all run",
          "gpu_check_other:jax_transfer_guard", 90, "the same on JAX's CPU devices"),
    Check(11, "nccl4py: input and communicator on different streams", "exact result",
          "gpu_check_other:nccl_streams", 45),
    Check(12, "2 gloo ranks with CUDA tensors on the one GPU",
          "GradientAllReduce, Decentralized and ModelAverage equal the numpy result",
          f"{T}:gloo_on_one_gpu", 60, "CPU tensors", nproc=2),
    Check(13, "algorithm state across streams under memory churn",
          "state loaded on the compute stream, read after 50 ms on the communication stream while the compute "
          "stream reuses memory: gradients equal the CPU reference plus the state",
          f"{T}:state_lifetime", 60, "the same on CPU (no streams, no allocator: not judged)"),
]


@dataclasses.dataclass(frozen=True)
class MultiCheck:
    """One check of ``--gpus N``: ``target`` is called as ``function(mode)`` on N processes (one with
    ``one_process``), ``mode`` "gpus", "one gpu" or "cpu" (see :mod:`gpu_check_multi`).

    ``one_gpu``: one GPU can simulate it (``alone_on_one_gpu``: there in one process).  ``victim``: the last
    rank exits on purpose, leaving no result.  ``min_n``: the smallest N it applies to (below, "not applicable").
    ``env``: (name, value) pairs for its processes; ``{half}`` in a value is N // 2.
    """

    number: int
    name: str
    criterion: str
    target: str
    timeout: float
    dry_run: str
    one_gpu: bool = False
    one_process: bool = False
    alone_on_one_gpu: bool = False
    victim: bool = False
    env: tuple = ()
    min_n: int = 2


M, J = "gpu_check_multi", "gpu_check_multi_jax"
MULTI_CHECKS = [
    MultiCheck(20, "placement", "every process on its own GPU: buckets and gradients there, no memory of it on "
               "another GPU (allocator; nvidia-smi's process list where it sees the job)",
               f"{M}:placement", 90, "the training and the bucket devices (one CPU: not judged)"),
    MultiCheck(21, "DDP parity at world size N", "different data per rank, bf16 autocast, a head only odd ranks "
               "use (find_unused_parameters): weights within 1e-3 of the distance moved from DDP's",
               f"{M}:ddp_parity", 120, "gloo on the CPU, judged", one_gpu=True),
    MultiCheck(22, "every algorithm at world size N", "each reduce against the numpy reference (1e-5; compressed: "
               "at most 1 % of values one code away); AsyncModelAverage completes >= 3 rounds",
               f"{M}:every_algorithm", 150, "gloo on the CPU, judged", one_gpu=True),
    MultiCheck(23, "two levels: 2 pseudo-nodes of N/2", "node groups right; GradientAllReduce, ByteGrad and "
               "Decentralized over nodes equal the two-level numpy references; a node's ranks bitwise equal",
               f"{M}:two_level", 120, "gloo on the CPU, judged", one_gpu=True, env=(("LOCAL_WORLD_SIZE", "{half}"),),
               min_n=4),
    MultiCheck(24, "ordering stress", "two wrapped models, SyncBatchNorm, an all-gather in the loss, random "
               "0-20 ms pauses before each bucket: no hang, equal to DDP (1e-3 of the distance moved)",
               f"{M}:ordering_stress", 120, "gloo on the CPU with the allreduces of SyncBatchNorm, judged",
               one_gpu=True),
    MultiCheck(25, "overlap, simulated link", "communication as a pause on the communication stream (2 ms a MB): "
               "step <= compute + 0.35 x the pauses", f"{M}:overlap_proxy", 120,
               "time.sleep on the communication thread (CPU cores shared: not judged)", one_gpu=True,
               alone_on_one_gpu=True),
    MultiCheck(26, "overlap, slowed NCCL links", "NCCL_P2P_DISABLE=1, NCCL_MAX_NCHANNELS=1: step <= compute + "
               "0.35 x communication and <= 1.05 x DDP's; ByteGrad <= 0.8 x GradientAllReduce",
               f"{M}:overlap_nccl", 150, "the timings on gloo (not judged)",
               env=(("NCCL_P2P_DISABLE", "1"), ("NCCL_MAX_NCHANNELS", "1"))),
    MultiCheck(27, "no host sync at world size N", "every algorithm and PowerSGD as a DDP comm hook train 3 steps "
               "under set_sync_debug_mode('error')", f"{M}:no_host_sync", 150,
               "the same training on the CPU (not judged)"),
    MultiCheck(28, "a killed rank", "the last rank exits after 3 steps: every other raises a BaguaXError within "
               "wrap's timeout (5 s) + 7 s", f"{M}:killed_rank", 90, "gloo on the CPU, judged", one_gpu=True,
               victim=True),
    MultiCheck(29, "JAX, N processes x 1 GPU", "every algorithm jit-first equals its pmap loop (1e-5) and "
               "trains; GradientAllReduce equals XLA's reduction (1e-5 relative)", f"{J}:jax_processes", 240,
               "N processes of one CPU device, gloo, judged"),
    MultiCheck(30, "JAX, 1 process x N GPUs", "as check 29, one process holding the N devices",
               f"{J}:jax_devices", 180, "N forced CPU devices, judged", one_process=True),
]


def cuda_available() -> bool:
    """CUDA is usable (asked without creating a context in this process: the checks' processes need the GPU)."""
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def run_check(check: Check, device: str, timeout: float, env: dict) -> dict:
    """Run one check in fresh processes; its entry of the JSON file (never raises)."""
    entry = {"number": check.number, "name": check.name, "criterion": check.criterion}
    if device == "cpu" and check.dry_run is None:
        return {**entry, "status": NEEDS_GPU, "values": {}, "dry_run": None, "seconds": 0.0}
    if device == "cpu":
        entry["dry_run"] = check.dry_run
    nproc = check.cpu_nproc if device == "cpu" and check.cpu_nproc else check.nproc
    start = time.perf_counter()
    try:
        if timeout < 5:
            raise TimeoutError("not run: the time budget of the whole run is spent")
        per_rank = run_workers(check.target, nproc=nproc, args=(device,), timeout=timeout, env=env)
        values = per_rank[0]["values"] if nproc == 1 else {f"rank {r}": out["values"] for r, out in
                                                           enumerate(per_rank)}
        problems = [p for out in per_rank for p in out["problems"]]
        judged = all(out["judged"] for out in per_rank)
        status = FAIL if problems else (PASS if judged else NEEDS_GPU)
        entry.update(status=status, values=values)
        if problems:
            entry["problems"] = problems
    except Exception as e:  # noqa: BLE001 - a check's failure is its result; the other checks still run
        entry.update(status=FAIL, values={}, problems=[f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"],
                     traceback=traceback.format_exc()[-4000:])
    entry["seconds"] = round(time.perf_counter() - start, 2)
    return entry


def multi_mode(check: MultiCheck, device: str, n: int, visible: int) -> str | None:
    """How ``check`` runs here: "gpus", "one gpu" or "cpu", or None (it needs N GPUs this machine lacks)."""
    if device == "cpu":
        return "cpu"
    if visible >= n:
        return "gpus"
    return "one gpu" if check.one_gpu else None


def run_multi_check(check: MultiCheck, n: int, mode: str | None, timeout: float, env: dict) -> dict:
    """Run one check of ``--gpus n`` in fresh processes; its entry of the JSON file (never raises)."""
    entry = {"number": check.number, "name": check.name, "criterion": check.criterion, "mode": mode}
    needs = f"needs {n} GPUs"
    if n < check.min_n:
        return {**entry, "status": NOT_APPLICABLE, "values": {"why": f"needs N >= {check.min_n}"}, "seconds": 0.0}
    if mode is None:
        return {**entry, "status": needs, "values": {}, "seconds": 0.0}
    if mode == "cpu":
        entry["dry_run"] = check.dry_run
    env = {**env, **{k: v.format(half=n // 2) for k, v in check.env}, "GPU_CHECK_N": str(n)}
    if mode == "cpu":  # N CPU devices in the one process, else one each
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}" if check.one_process else ""
    start = time.perf_counter()
    try:
        if timeout < 5:
            raise TimeoutError("not run: the time budget of the whole run is spent")
        alone = check.one_process or (mode == "one gpu" and check.alone_on_one_gpu)
        outcomes = run_workers(check.target, nproc=1 if alone else n, args=(mode,), timeout=timeout, env=env,
                               expect_failure=True)
        problems = []
        if check.victim:
            kind, _ = outcomes.pop()
            if kind == "ok":
                problems.append("the last rank returned instead of exiting")
        errors = [f"rank {r}: {value}" for r, (kind, value) in enumerate(outcomes) if kind != "ok"]
        if errors:
            raise RuntimeError("\n".join(errors)[-6000:])
        per_rank = [value for _, value in outcomes]
        values = per_rank[0]["values"] if len(per_rank) == 1 else {f"rank {r}": out["values"] for r, out in
                                                                    enumerate(per_rank)}
        problems += [p for out in per_rank for p in out["problems"]]
        judged = all(out["judged"] for out in per_rank)
        entry.update(status=FAIL if problems else (PASS if judged else needs), values=values)
        if problems:
            entry["problems"] = problems
    except Exception as e:  # noqa: BLE001 - a check's failure is its result; the other checks still run
        lines = [line for line in str(e).splitlines() if line.strip()]
        entry.update(status=FAIL, values={}, problems=[f"{type(e).__name__}: {(lines or [''])[-1][:300]}"],
                     traceback=str(e)[-4000:] or traceback.format_exc()[-4000:])
    entry["seconds"] = round(time.perf_counter() - start, 2)
    return entry


def visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def check_env(device: str, cache: str) -> dict:
    """The checks' environment: their modules importable, JAX not preallocating (torch shares the GPU),
    one fresh compile cache for the run (check 7 measures the first compile in a cache of its own)."""
    path = [str(HERE), str(ROOT), str(ROOT / "tests" / "torch"), str(ROOT / "tests" / "jax")]  # + the workers
    env = {"PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")]),
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(cache, "triton"), "GPU_CHECK_CACHE": cache}
    if device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"  # the dry run stays on the CPU on a GPU machine too
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=None,
                   help="the JSON file (default: $OUT/results.json, else ./gpu_check_out/results.json)")
    p.add_argument("--cpu", action="store_true", help="the CPU dry run (automatic when CUDA is not available)")
    p.add_argument("--only", default=None, help="comma-separated check numbers")
    p.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run (default 300)")
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="the checks of several GPUs (20-30), on N processes; N >= 2")
    args = p.parse_args(argv)
    if args.gpus is not None and args.gpus < 2:
        p.error(f"--gpus {args.gpus}: the checks of several GPUs need N >= 2 (without --gpus: the one-GPU check)")
    out = Path(args.out or os.path.join(os.environ.get("OUT", "gpu_check_out"), "results.json"))
    device = "cpu" if args.cpu or not cuda_available() else "cuda"
    visible = visible_gpus() if device == "cuda" else 0
    only = {int(n) for n in args.only.split(",")} if args.only else None
    checks = [c for c in (MULTI_CHECKS if args.gpus else CHECKS) if only is None or c.number in only]
    print(f"bagua_x GPU check on {device}{' (dry run)' if device == 'cpu' else ''}: {len(checks)} checks"
          f"{f' of {args.gpus} GPUs ({visible} visible)' if args.gpus else ''}, budget {args.budget:.0f} s", flush=True)
    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_cache_") as cache:
        env = check_env(device, cache)
        for check in checks:
            left = args.budget - (time.perf_counter() - start)
            if args.gpus:
                entry = run_multi_check(check, args.gpus, multi_mode(check, device, args.gpus, visible),
                                        min(check.timeout, left), env)
            else:
                entry = run_check(check, device, min(check.timeout, left), env)
            results.append(entry)
            problems = "; ".join(entry.get("problems", []))[:400]
            print(f"[{time.perf_counter() - start:6.1f} s] {check.number:2d} {check.name}: {entry['status']} "
                  f"({entry['seconds']:.1f} s) {problems}", flush=True)
    gate = next((r for r in results if r["number"] == 0), None)
    report = {"mode": "gpu" if device == "cuda" else "cpu dry run",
              "machine": {"python": platform.python_version(), "host": platform.node(),
                          **({"gpus_asked": args.gpus, "gpus_visible": visible} if args.gpus else {}),
                          **(gate["values"] if gate else {})},
              "seconds": round(time.perf_counter() - start, 2), "checks": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    failed = [r["number"] for r in results if r["status"] == FAIL]
    unjudged = [r["number"] for r in results if r["status"].startswith("needs")]
    ok = not failed and (device == "cpu" or not unjudged)
    print(f"{'PASS' if ok else 'FAIL'} in {report['seconds']:.0f} s: failed {failed or 'none'}, "
          f"needs GPU {unjudged or 'none'}; results in {out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
