"""JAX steps with the branch decided on the host (through ``dp.step``) against the traced ``lax.switch``.

    python benchmarks/jax_host_branches.py [--devices 4] [--width 1024] [--steps 24]

One process, ``--devices`` CPU devices under ``jax.pmap``, an MLP of 4 square layers (``--width``: 1024
is 4.2 M parameters).  For each algorithm that branches on its step counter, the same training runs two
ways in interleaved rounds of one step each: a plain loop (every step's program holds every branch behind a
``lax.switch``) and ``dp.step`` (one program per branch key, each with its branch alone).  Printed per
algorithm: the programs compiled each way, the median step in ms of each, and their ratio (dp.step over
plain), measured in the same run.  On GPU a conditional also reads its predicate back to the host and its
collectives cannot overlap with the rest; this CPU run shows only what the fusion around the switch costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from bagua_x.algorithms import DiLoCo, LowPrecisionDecentralized, ModelAverage, PowerSGD, QAdam, Target
    from bagua_x.jax import wrap

    n, width = jax.device_count(), args.width
    rng = np.random.default_rng(0)
    params = {f"l{i}": {"w": rng.standard_normal((width, width)).astype(np.float32) / np.sqrt(width),
                        "b": np.zeros(width, np.float32)} for i in range(4)}
    x = rng.standard_normal((n, 32, width)).astype(np.float32)

    def loss_fn(p, xb):
        h = xb
        for i in range(4):
            h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        return jnp.mean((h - xb) ** 2)

    algorithms = [ModelAverage(period=4), LowPrecisionDecentralized(communication_interval=2), QAdam(warmup_steps=2),
                  PowerSGD(start_powerSGD_iter=2), DiLoCo(sync_every=4), DiLoCo(sync_every=8, fragments=4)]
    print(f"{n} CPU devices, {sum(a.size for t in params.values() for a in t.values()) / 1e6:.1f} M parameters, "
          f"{args.steps} timed steps each way\n")
    print(f"{'algorithm':58} {'programs':>9} {'plain ms':>9} {'dp.step ms':>11} {'ratio':>6}")
    for algorithm in algorithms:
        dp = wrap(params, algorithm=algorithm)
        tx = dp.optimizer() if algorithm.target is Target.MOMENTUM else optax.sgd(1e-3)
        traces = {"plain": 0, "dp.step": 0}

        def make(which):
            def step(p, o, st, xb):
                traces[which] += 1
                g = jax.grad(loss_fn)(p, xb)
                if algorithm.target is Target.GRAD or algorithm.averages_gradients_in_node:
                    g, st = dp.reduce_gradients(g, st)
                u, o = tx.update(g, o, p)
                p = optax.apply_updates(p, u)
                if algorithm.target is Target.WEIGHT:
                    p, st = dp.sync_params(p, st)
                return p, o, st
            return jax.pmap(step, axis_name="batch")

        plain_fn, stepped = make("plain"), dp.step(make("dp.step"))
        start = (dp.replicate(params), dp.replicate(tx.init(params)), dp.init())
        carries = {"plain": start, "dp.step": start}
        times = {"plain": [], "dp.step": []}
        for s in range(8 + args.steps):  # 8 untimed: every program compiled
            for which, fn in (("plain", lambda *c: jax.block_until_ready(plain_fn(*c))), ("dp.step", stepped)):
                begin = time.perf_counter()
                carries[which] = fn(*carries[which], x)
                if s >= 8:
                    times[which].append(time.perf_counter() - begin)
        plain, driven = (statistics.median(times[w]) * 1e3 for w in ("plain", "dp.step"))
        print(f"{repr(algorithm)[:58]:58} {traces['plain']:>4} / {traces['dp.step']:<2} {plain:>9.1f} "
              f"{driven:>11.1f} {driven / plain:>6.2f}")


if __name__ == "__main__":
    main()
