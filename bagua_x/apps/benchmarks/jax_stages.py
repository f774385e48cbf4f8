"""Where JAX ByteGrad's time goes: each stage of the exchange timed alone, side by side with a pmean of the bucket.

The stages of :func:`bagua_x.algorithms.bytegrad.compressed_allreduce` on one
bucket, each compiled as its own pmapped function over the previous stage's
output: quantise (MinMaxUInt8 per chunk), all_to_all, dequantise-sum-requantise
(the owner's reduction), all_gather, dequantise.  ``whole`` is the exchange in
one program (XLA fuses across stages, so it is not the sum), ``pmean`` a plain
float32 allreduce of the same bucket.  One process with 4 CPU devices by
default (``--devices``); XLA's in-process collectives, so the collective
stages show their compute and copy cost, not a network's.

    python -m bagua_x.apps.benchmarks.jax_stages [--numel 8400000] [--iters 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time


def measure(numel: int, iters: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bagua_x.algorithms import compression
    from bagua_x.algorithms.bytegrad import compressed_allreduce
    from bagua_x.jax import AxisCommunicator

    n = jax.local_device_count()
    numel -= numel % n
    rng = np.random.default_rng(0)
    flat = jnp.asarray(rng.standard_normal((n, numel)).astype(np.float32) * 0.01)

    def pmapped(fn):
        return jax.pmap(lambda x: fn(x, AxisCommunicator("batch")), axis_name="batch")

    stages = {
        "quantise": pmapped(lambda x, c: compression.compress_rows(jnp.reshape(x, (c.size, -1)))),
        "all_to_all": pmapped(lambda x, c: c.alltoall(x)),
        "dequantise-sum-requantise": pmapped(lambda x, c: compression.reduce_requantize(x, True)[0]),
        "all_gather": pmapped(lambda x, c: c.allgather(x)),
        "dequantise": pmapped(lambda x, c: jnp.reshape(compression.decompress_rows(x), (-1,))),
    }
    inputs, x = {}, flat
    for name, fn in stages.items():  # each stage's input is the previous stage's output
        inputs[name] = x
        x = jax.block_until_ready(fn(x))
    stages["whole"] = pmapped(lambda x, c: compressed_allreduce(x, c))
    stages["pmean"] = pmapped(lambda x, c: jax.lax.pmean(x, "batch"))
    inputs["whole"] = inputs["pmean"] = flat
    times: dict[str, list[float]] = {k: [] for k in stages}
    for name, fn in stages.items():  # compile and warm up
        jax.block_until_ready(fn(inputs[name]))
    for _ in range(iters):  # interleaved, so drift in machine load hits all alike
        for name, fn in stages.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(inputs[name]))
            times[name].append(time.perf_counter() - start)
    return {"devices": n, "numel": numel, "ms": {k: 1e3 * float(np.median(v)) for k, v in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=8_400_000, help="bucket elements (default: 8.4M, 33.6 MB)")
    parser.add_argument("--devices", type=int, default=4, help="CPU devices in this process")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    result = measure(args.numel, args.iters)
    ms = result["ms"]
    print(f"JAX ByteGrad stages: {result['numel']:,} elements on {result['devices']} CPU devices (median ms)")
    for name, t in ms.items():
        print(f"  {name:28s}{t:9.1f}{t / ms['pmean']:8.2f} x pmean")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
