"""bagua_x.jax gradient allreduce vs one ``lax.pmean`` per leaf, side by side in one run.

Two settings, each on two gradient trees (400 leaves of 64x64, 100 of 256x256):

* one process with 4 CPU devices (XLA in-process collectives);
* 2 processes x 2 CPU devices through ``jax.distributed`` + gloo (launched here
  as subprocesses on 127.0.0.1).

Prints the median time of a pmapped step that only reduces the gradients, and
the ratio bagua_x / per-leaf pmean (below 1 is faster).  In one process the
automatic strategy packs the 16 KiB leaves and keeps the 256 KiB ones per leaf
(there "bagua_x" should be ~1.0 and the "packed" column shows what packing
would cost); across processes it packs each bucket into one collective.

    python -m bagua_x.apps.benchmarks.jax_vs_pmean [--iters 20]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

TREES = [(400, 64), (100, 256)]


def _measure(iters: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bagua_x.jax import wrap

    nlocal = jax.local_device_count()
    rows = []
    for leaves, side in TREES:
        grads = {f"w{i:03d}": jnp.full((side, side), i / leaves, jnp.float32) for i in range(leaves)}
        local = jax.tree.map(lambda g: np.stack([np.asarray(g)] * nlocal), grads)
        pmean = jax.pmap(lambda g: jax.tree.map(lambda x: jax.lax.pmean(x, "batch"), g), axis_name="batch")
        calls = {"pmean": lambda f=pmean, g=local: f(g)}
        for label, pack in (("bagua_x", None), ("packed", True)):
            dp = wrap(grads, pack_buckets=pack)
            f = jax.pmap(lambda g, st, dp=dp: dp.reduce_gradients(g, st)[0], axis_name="batch")
            calls[label] = lambda f=f, g=local, st=dp.init(): f(g, st)
        times = {k: [] for k in calls}
        for call in calls.values():  # compile and warm up
            jax.block_until_ready(call())
            jax.block_until_ready(call())
        for _ in range(iters):  # interleaved, so drift in machine load hits all alike
            for k, call in calls.items():
                start = time.perf_counter()
                jax.block_until_ready(call())
                times[k].append(time.perf_counter() - start)
        med = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
        rows.append({"tree": f"{leaves} x {side}x{side}", **med})
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(iters: int) -> list[dict]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
        procs.append(subprocess.Popen([sys.executable, "-m", __spec__.name, "--worker", "--iters", str(iters)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"benchmark worker failed:\n{err[-3000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def _print(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"  {'tree':<18}{'pmean ms':>10}{'bagua_x ms':>12}{'ratio':>8}{'packed ms':>11}{'ratio':>8}")
    for r in rows:
        print(f"  {r['tree']:<18}{r['pmean']:>10.1f}{r['bagua_x']:>12.1f}{r['bagua_x'] / r['pmean']:>8.2f}"
              f"{r['packed']:>11.1f}{r['packed'] / r['pmean']:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    if args.worker:
        import jax

        from bagua_x.jax import init_distributed

        init_distributed()
        rows = _measure(args.iters)
        if jax.process_index() == 0:
            print(json.dumps(rows))
        return
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    single = _measure(args.iters)
    multi = _two_processes(args.iters)
    _print("one process x 4 CPU devices (bagua_x: automatic strategy)", single)
    _print("2 processes x 2 CPU devices, gloo (bagua_x: automatic strategy = one collective per bucket)", multi)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"single_process": single, "two_processes": multi}, f)


if __name__ == "__main__":
    main()
