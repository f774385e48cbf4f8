"""Whether XLA:CPU runs a collective beside independent compute in one program, over the cluster's link.

    sudo bagua-x cluster --nodes 2 --nproc-per-node 2 --inter-node 10mbit -- python benchmarks/jax_overlap.py
    sudo bagua-x cluster --nodes 2 --nproc-per-node 1 --inter-node 10mbit -- python benchmarks/jax_overlap.py

Streaming DiLoCo in JAX sends a fragment at the step after its launch, reading
the state alone, so that XLA may run the all-gather beside that step's compute
(``DiLoCo.reduce``).  This measures whether it does.  One process per rank, one
CPU device each; every program is timed 5 times, all ranks starting together,
and rank 0 prints the medians:

* ``gather``: the all-gather of one SparseLoCo payload (``--numel`` elements at
  TopK's defaults; the default is a quarter of the zoo transformer, one
  fragment of ``fragments=4``);
* ``compute``: a chain of ``--matmuls`` independent matmuls (a step's worth);
* ``gather + compute``: both in one program, neither reading the other;
* ``encode``, ``encode + gather + mean``, and that beside ``compute``: the
  whole sparse exchange, whose encoding and decoding are compute too.

``hidden`` is (gather + compute - both) / gather: 1 when the gather costs
nothing beside the compute, 0 when the two run one after the other.
"""

import argparse
import os
import time

import numpy as np


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=2_900_000)
    parser.add_argument("--matmuls", type=int, default=6)
    parser.add_argument("--size", type=int, default=1400, help="the matmuls' square size")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import bagua_x.jax as bxj

    bxj.init_distributed()
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    from bagua_x.algorithms.sparse import TopK

    rank, topk, n = jax.process_index(), TopK(), args.numel
    x = jnp.asarray(np.random.default_rng(rank).standard_normal((1, n)).astype(np.float32))
    w = jnp.asarray(np.random.default_rng(0).standard_normal((1, args.size, args.size)).astype(np.float32))
    payload = jnp.zeros((1, topk.payload_bytes(n)), jnp.uint8)

    def gather(p):
        return jax.lax.all_gather(p, "ranks")

    def compute(m):
        for _ in range(args.matmuls):
            m = jnp.tanh(m @ m * (1.0 / args.size))
        return m

    def exchange(v):
        sent, _ = topk.encode(v)
        return topk.mean(gather(sent), n)

    programs = {
        "gather": (gather, (payload,)),
        "compute": (compute, (w,)),
        "gather + compute": (lambda p, m: (gather(p), compute(m)), (payload, w)),
        "encode": (lambda v: topk.encode(v), (x,)),
        "encode + gather + mean": (exchange, (x,)),
        "that + compute": (lambda v, m: (exchange(v), compute(m)), (x, w)),
    }
    ms = {}
    for name, (fn, inputs) in programs.items():
        program = jax.pmap(fn, axis_name="ranks")
        for _ in range(2):  # compiled, then once more
            jax.block_until_ready(program(*inputs))
        times = []
        for i in range(5):
            multihost_utils.sync_global_devices(f"{name} {i}")
            start = time.perf_counter()
            jax.block_until_ready(program(*inputs))
            times.append(time.perf_counter() - start)
        ms[name] = 1000 * float(np.median(times))
        if rank == 0:
            print(f"{name:24s} {ms[name]:8.0f} ms", flush=True)
    if rank == 0:
        hidden = (ms["gather"] + ms["compute"] - ms["gather + compute"]) / ms["gather"]
        whole = ms["encode + gather + mean"]
        print(f"{jax.process_count()} processes, payload {topk.payload_bytes(n)} bytes, link "
              f"{os.environ.get('BAGUA_X_LINK', 'loopback')}: the gather hidden {hidden:.0%}; the whole exchange "
              f"hidden {(whole + ms['compute'] - ms['that + compute']) / whole:.0%}", flush=True)


if __name__ == "__main__":
    main()
