"""The JAX checks of ``benchmarks/gpu_check.py --gpus N``: N processes of one GPU each, and one process of N GPUs.

No torch in these processes.  ``mode`` as in :mod:`gpu_check_multi`: ``"gpus"`` on GPUs, ``"cpu"`` the dry
run (one CPU device per process, or N forced CPU devices in one process, gloo between processes).  JAX cannot
put N processes on one GPU (NCCL refuses one GPU twice), so there is no ``"one gpu"`` form.
"""

from __future__ import annotations

import os

import numpy as np

from gpu_check_other import result

STEPS, LR = 3, 5e-2


def _xla_reduction_error(params, x, y) -> float:
    """GradientAllReduce's jit-first gradients against XLA's own (plain ``jax.value_and_grad`` of the global
    batch) over every step, relative to the largest gradient."""
    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import bagua_x.jax as bxj
    from bagua_x.algorithms import GradientAllReduce
    from bx_jax_workers import loss_fn, max_difference

    mesh = jax.make_mesh((jax.device_count(),), ("batch",), axis_types=(AxisType.Auto,))
    dp = bxj.wrap(params, algorithm=GradientAllReduce(), mesh=mesh)
    ours = jax.jit(lambda p, st, xb, yb: dp.value_and_grad(loss_fn)(p, xb, yb, state=st))
    xla = jax.jit(jax.value_and_grad(loss_fn))
    p, st, sharding = dp.replicate(params), dp.init(), NamedSharding(mesh, P("batch"))
    nlocal, worst = jax.local_device_count(), 0.0
    mine = slice(nlocal * jax.process_index(), nlocal * (jax.process_index() + 1))
    for s in range(x.shape[0]):
        xb, yb = (jax.make_array_from_process_local_data(sharding, a[s][mine].reshape((-1,) + a.shape[3:]),
                                                         (a.shape[1] * a.shape[2],) + a.shape[3:]) for a in (x, y))
        (_, grads), st = ours(p, st, xb, yb)
        _, want = xla(p, xb, yb)
        scale = max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(jax.device_get(want)))
        worst = max(worst, max_difference(jax.device_get(grads), jax.device_get(want)) / scale)
        p = jax.tree.map(lambda a, g: a - LR * g, p, grads)
    return worst


def _every_algorithm(mode: str, processes: int) -> dict:
    """Every algorithm jit-first over a mesh of all devices against its pmap loop (which the tests hold to the
    numpy references), GradientAllReduce against XLA's reduction; from per-process random params."""
    import jax

    import bagua_x.jax as bxj
    from bx_jax_workers import bagua_jit, bagua_pmap, jit_first_algorithms, make_data, make_params, max_difference

    n, nlocal = jax.device_count(), jax.local_device_count()
    values = {"backend": jax.default_backend(), "processes": jax.process_count(), "devices": n,
              "local_devices": nlocal}
    problems = []
    if mode == "gpus" and jax.default_backend() != "gpu":
        problems.append(f"JAX runs on {jax.default_backend()}, not the GPUs")
    wanted = int(os.environ.get("GPU_CHECK_N", n))  # the N of --gpus N
    if (jax.process_count(), nlocal, n) != (processes, wanted // processes, wanted):
        problems.append(f"{jax.process_count()} processes of {nlocal} devices, not {processes} of "
                        f"{wanted // processes}")
    params = make_params(seed=100 + jax.process_index())  # replicate() must broadcast process 0's
    x, y = make_data(STEPS, n)
    mine = slice(nlocal * jax.process_index(), nlocal * (jax.process_index() + 1))
    mesh = jax.make_mesh((n,), ("batch",))
    for name, algorithm in jit_first_algorithms().items():
        jit_params, losses = bagua_jit(bxj.wrap(params, algorithm=algorithm, mesh=mesh), params, x, y, mesh, LR)
        pmap_params = bagua_pmap(bxj.wrap(params, algorithm=algorithm), params, x[:, mine], y[:, mine], LR, sgd=True)
        diff, moved = max_difference(jit_params, pmap_params), max_difference(pmap_params, make_params(seed=100))
        values[name] = {"jit_vs_pmap": diff, "moved": moved, "losses": losses}
        if not diff <= 1e-5:  # the same collectives and arithmetic: seen 0 on the CPU
            problems.append(f"{name}: jit-first and pmap differ by {diff:.3g}")
        if not moved > 1e-3:
            problems.append(f"{name}: the params did not train (moved {moved:.3g})")
    values["allreduce_vs_xla"] = _xla_reduction_error(make_params(seed=100), x, y)
    if not values["allreduce_vs_xla"] <= 1e-5:  # the mean over the batch summed in another order
        problems.append(f"GradientAllReduce is {values['allreduce_vs_xla']:.3g} (relative) from XLA's reduction")
    return values, problems


def jax_processes(mode):
    """N processes, one device each (GPU LOCAL_RANK), jax.distributed between them."""
    import jax

    import bagua_x.jax as bxj

    bxj.init_distributed()
    try:
        values, problems = _every_algorithm(mode, int(os.environ["WORLD_SIZE"]))
    finally:
        jax.distributed.shutdown()  # a barrier: no process leaves while another still reads from it
    return result(values, problems)


def jax_devices(mode):
    """One process holding all N devices."""
    values, problems = _every_algorithm(mode, 1)
    return result(values, problems)
