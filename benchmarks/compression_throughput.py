"""MinMaxUInt8 compression throughput: eager torch, torch.compile and jax.jit, on CPU or GPU.

Times ``compress_rows`` (float32 (R, K) -> uint8 (R, K + 8): bytes, then min and max) and
``decompress_rows`` (back to float32) from ``bagua_x.algorithms.compression``,
the kernels of ByteGrad and low-precision decentralized SGD.  Throughput counts
the bytes a single fused pass must move -- each input read once, each output
written once (5 bytes per element either way) -- so on a GPU the fraction of
the device's memory bandwidth says how close the code comes to one pass over
memory (the H200 moves ~4.8 TB/s by its datasheet).

    python benchmarks/compression_throughput.py                 # ~256 MiB of float32 on GPU, 16 MiB on CPU
    python benchmarks/compression_throughput.py --small         # a few seconds on a laptop CPU
    python benchmarks/compression_throughput.py --json out.json # also write the results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bagua_x.algorithms.compression import compress_rows, decompress_rows  # noqa: E402

# Datasheet memory bandwidth (bytes/s) by device-name substring, most specific first.
PEAK_BANDWIDTH = [
    ("H200", 4.8e12), ("GH200", 4.0e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
    ("B200", 8.0e12), ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12),
    ("L40S", 0.864e12), ("L4", 0.3e12), ("A10G", 0.6e12), ("V100", 0.9e12), ("T4", 0.32e12),
]


def peak_bandwidth(device_name: str):
    for key, bw in PEAK_BANDWIDTH:
        if key.lower() in device_name.lower():
            return bw
    return None


def bench(fn, sync, warmup: int, repeat: int) -> float:
    """Median seconds per call of ``fn`` after ``warmup`` calls; ``sync(result)`` waits for the device."""
    for _ in range(warmup):
        sync(fn())
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def torch_cases(rows, cols, want_gpu, compile_too):
    import torch

    device = "cuda" if want_gpu and torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, cols, device=device, generator=g)
    packed = compress_rows(x)

    def sync(out):
        if device == "cuda":
            torch.cuda.synchronize()

    cases = [("torch eager", device, name, lambda: compress_rows(x), lambda: decompress_rows(packed), sync)]
    if compile_too:
        # array_api_compat's lru_cache'd namespace lookup is traced through; harmless, and noisy
        warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
        try:
            c, d = torch.compile(compress_rows), torch.compile(decompress_rows)
            sync(c(x))
            sync(d(packed))  # compile outside the timing
            cases.append(("torch.compile", device, name, lambda: c(x), lambda: d(packed), sync))
        except Exception as e:  # noqa: BLE001 - no C++ compiler, unsupported platform, ...
            print(f"torch.compile unavailable here: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return cases


def jax_cases(rows, cols, want_gpu):
    import jax
    import jax.numpy as jnp

    gpus = [d for d in jax.devices() if d.platform == "gpu"] if want_gpu else []
    dev = gpus[0] if gpus else jax.devices("cpu")[0]
    name = dev.device_kind
    x = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (rows, cols), jnp.float32), dev)
    c, d = jax.jit(compress_rows), jax.jit(decompress_rows)
    packed = c(x)

    def sync(out):
        jax.block_until_ready(out)

    where = "cuda" if gpus else "cpu"
    return [("jax.jit", where, name, lambda: c(x), lambda: d(packed), sync)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=None, help="rows (buckets are compressed row by row)")
    p.add_argument("--cols", type=int, default=None, help="elements per row")
    p.add_argument("--small", action="store_true", help="1024 x 1024 elements (4 MiB): quick, e.g. on CPU")
    p.add_argument("--frameworks", default="torch,jax", help="comma-separated: torch,jax")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even if a GPU is there")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--peak-gbs", type=float, default=None, help="device memory bandwidth in GB/s (else by name)")
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args(argv)

    want_gpu = not args.cpu
    on_gpu = False
    if want_gpu:
        try:
            import torch

            on_gpu = torch.cuda.is_available()
        except ImportError:
            pass
        if not on_gpu:
            try:
                import jax

                on_gpu = any(d.platform == "gpu" for d in jax.devices())
            except Exception:  # noqa: BLE001
                pass
    if args.small:
        rows, cols = 1024, 1024
    else:
        rows, cols = (65536, 1024) if on_gpu else (4096, 1024)
    rows, cols = args.rows or rows, args.cols or cols
    n = rows * cols
    moved = 5 * n + 8 * rows  # read float32 once + write uint8 once (+ the (R, 2) min/max): same both ways

    cases = []
    fws = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    for fw in fws:
        try:
            if fw == "torch":
                cases += torch_cases(rows, cols, want_gpu, not args.no_compile)
            elif fw == "jax":
                cases += jax_cases(rows, cols, want_gpu)
            else:
                p.error(f"unknown framework {fw!r}")
        except ImportError as e:
            print(f"{fw}: not installed ({e})")

    print(f"MinMaxUInt8 on {rows} x {cols} float32 ({4 * n / 2**20:.0f} MiB), "
          f"{moved / 1e6:.1f} MB moved per pass (single-pass minimum), median of {args.repeat}")
    results = []
    header = f"{'implementation':<15} {'device':<7} {'op':<11} {'ms':>9} {'GB/s':>9} {'of peak':>8}  device name"
    print(header)
    print("-" * len(header))
    for label, where, name, comp, decomp, sync in cases:
        peak = args.peak_gbs * 1e9 if args.peak_gbs else (peak_bandwidth(name) if where == "cuda" else None)
        for op, fn in (("compress", comp), ("decompress", decomp)):
            t = bench(fn, sync, args.warmup, args.repeat)
            gbs = moved / t / 1e9
            frac = f"{moved / t / peak:7.1%}" if peak else "      -"
            print(f"{label:<15} {where:<7} {op:<11} {t * 1e3:9.3f} {gbs:9.2f} {frac:>8}  {name}")
            results.append({"implementation": label, "device": where, "device_name": name, "op": op,
                            "rows": rows, "cols": cols, "seconds": t, "bytes": moved, "gb_per_s": gbs,
                            "fraction_of_peak": (moved / t / peak) if peak else None,
                            "peak_bytes_per_s": peak})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
