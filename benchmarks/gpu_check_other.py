"""The checks of benchmarks/gpu_check.py that are not torch training: the gate (0), the compression kernels (7),
JAX (10) and nccl4py (11), plus what every check shares (:func:`result`, the numpy reference).

This module imports neither torch nor JAX at import time: the JAX check runs in a process without torch.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent.parent / "tests"
H200_BYTES_PER_S = 4.8e12
TARGET_BYTES = 11  # per element, ByteGrad's round trip at the roofline (issue 35): x read once
DESIGN_BYTES = 14  # what today's kernels move: x read twice, written once, the byte written and read
STEP_SLACK = 1.001  # "within one quantisation step", with room for float rounding in the ratio itself


def result(values: dict, problems=(), judged: bool = True) -> dict:
    """A check's outcome: measured ``values``, the criteria not met, and whether the criteria could be
    judged at all (False in the CPU dry run for the GPU-only criteria: reported as "needs GPU")."""
    return {"values": values, "problems": list(problems), "judged": judged}


@functools.cache
def numpy_reference():
    """tests/algorithms/reference.py: every algorithm in numpy from DESIGN.md's formulas, no bagua_x code."""
    spec = importlib.util.spec_from_file_location("bx_reference", TESTS / "algorithms" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _version(module: str):
    try:
        return getattr(importlib.import_module(module), "__version__", "present")
    except Exception as e:  # noqa: BLE001 - missing, or broken on import: both are findings
        return f"MISSING ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"


_JAX_PROBE = "import json, jax; print(json.dumps({'jax': jax.__version__, 'backend': jax.default_backend(), " \
             "'devices': [str(d) for d in jax.devices()]}))"


# -- 0 ---------------------------------------------------------------------------------------------------------
def gate(device):
    """Versions and devices; JAX is asked in a process of its own (it must not share this one with torch)."""
    import torch

    values = {name: _version(name) for name in ("torch", "triton", "jax", "jaxlib", "flax", "optax", "lightning",
                                                "nccl.core", "numpy", "array_api_compat")}
    values["cuda"] = torch.cuda.is_available()
    values["torch.version.cuda"] = torch.version.cuda
    if values["cuda"]:
        props = torch.cuda.get_device_properties(0)
        values.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                      capability=f"{props.major}.{props.minor}", gpus=torch.cuda.device_count())
    try:
        version = torch.cuda.nccl.version() if values["cuda"] else None  # a tuple, an int in old torch
        values["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else version
    except Exception as e:  # noqa: BLE001
        values["nccl"] = None
        values["nccl_error"] = f"{type(e).__name__}: {e}"
    probe = subprocess.run([sys.executable, "-c", _JAX_PROBE], capture_output=True, text=True, timeout=90)
    try:
        values["jax_probe"] = json.loads(probe.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        values["jax_probe"] = {"error": (probe.stderr or probe.stdout)[-600:]}
    problems = []
    if device == "cuda":
        if not values["cuda"]:
            problems.append("CUDA is not available to torch")
        if not values["nccl"]:
            problems.append("torch has no NCCL")
        if values["jax_probe"].get("backend") != "gpu":
            problems.append(f"JAX has no GPU devices: {values['jax_probe']}")
        if str(values["triton"]).startswith("MISSING"):
            problems.append(f"Triton: {values['triton']}")
    return result(values, problems, judged=device == "cuda")


# -- 7 ---------------------------------------------------------------------------------------------------------
def compression_kernels(device):
    """ByteGrad's round trip (compress_rows, then decompress_rows into the bucket) at its real shapes.

    The roofline is a copy measured in the same run (``out.copy_(x)``: 8 bytes per element), not a data
    sheet's figure.  Target: the round trip in the time a kernel at 75 % of that copy bandwidth needs for 11
    bytes per element (the float32 read once (4) and written back (4), the byte written and read back (2), the
    headers and some slack (1)).  Today's kernels read x twice (min/max, then quantise): 14 bytes of traffic
    by design, so they cannot meet it where the second read misses L2; the JSON keeps the design's 14 and the
    bytes per element the measured time allows at copy speed.  Times are the device's (the calls queued ahead
    of the GPU, so kernels run back to back); the host's time per call is reported beside them.  "Eager" is
    the same code with the compiler unregistered; the first call of each shape, in a compile cache of its
    own, is the compile time.  The bytes and values must equal compression.py run on numpy, bit for bit.
    """
    cache = os.environ.get("GPU_CHECK_CACHE")
    if cache:  # before torch is imported: a cache no other check has filled
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "first-compile", "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "first-compile", "triton")
    import time
    import warnings

    import torch

    from bagua_x.algorithms import compression as C
    from bagua_x.algorithms.kernels import unregister_compiler
    from bagua_x.testing import reference as numpy_blocks
    from bagua_x.torch import kernels as torch_kernels
    from compression_throughput import peak_bandwidth
    from gpu_check_torch import device_seconds_per_call

    cuda = device == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    shapes = [(1, 6_553_600), (8, 819_200), (8, 8_388_608)] if cuda else [(1, 65_536), (8, 8_192)]
    peak = (peak_bandwidth(torch.cuda.get_device_name(0)) or H200_BYTES_PER_S) if cuda else None
    values, problems = {"peak_bytes_per_s": peak, "target_bytes_per_element": TARGET_BYTES,
                        "design_bytes_per_element": DESIGN_BYTES}, []
    for rows, cols in shapes:
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols)).to(dev)
        out = torch.empty_like(x)

        def roundtrip():
            return C.decompress_rows(C.compress_rows(x), out=out)

        entry = values[f"{rows}x{cols}"] = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            t0 = time.perf_counter()
            roundtrip()
            if cuda:
                torch.cuda.synchronize()
            entry["first_call_s"] = round(time.perf_counter() - t0, 2)
        entry["fallback_warnings"] = [str(w.message)[:300] for w in caught]
        got, xs = out.cpu().numpy(), x.cpu().numpy()
        entry["error_in_steps"] = max(float(np.abs(got[r] - numpy_blocks.roundtrip(xs[r])).max()) / numpy_blocks.step_size(xs[r])
                                      for r in range(rows))
        if entry["error_in_steps"] > STEP_SLACK:
            problems.append(f"{rows}x{cols}: {entry['error_in_steps']:.2f} quantisation steps from the reference")
        packed = C.compress_rows(x).cpu().numpy()
        received = C.compress_rows(x)  # the owner step's input: one packed row from each of `rows` ranks
        owner = C.reduce_requantize(received, True).cpu().numpy()
        entry["bitwise_as_numpy"] = bool(np.array_equal(packed, C.compress_rows(xs)) and
                                         np.array_equal(got, C.decompress_rows(C.compress_rows(xs))))
        entry["owner_step_bitwise_as_numpy"] = bool(np.array_equal(owner, C.reduce_requantize(packed, True)))
        if cuda and not entry["owner_step_bitwise_as_numpy"]:  # on the CPU: torch's division, as above
            problems.append(f"{rows}x{cols}: ByteGrad's owner step is not bit for bit compression.py on numpy")
        if cuda and not entry["bitwise_as_numpy"]:  # torch's CPU division is not always correctly rounded
            problems.append(f"{rows}x{cols}: not bit for bit compression.py on numpy")
        if not cuda:
            continue
        compiled, host = device_seconds_per_call(roundtrip, dev, 20)
        unregister_compiler(torch_kernels.NAMESPACE)
        try:
            eager, eager_host = device_seconds_per_call(roundtrip, dev, 5)
        finally:
            torch_kernels.install()
        owner_s, owner_host = device_seconds_per_call(lambda: C.reduce_requantize(received, True), dev, 20)
        copy, _ = device_seconds_per_call(lambda: out.copy_(x), dev, 20)
        n = rows * cols
        copy_bandwidth = 8 * n / copy
        of_copy = TARGET_BYTES * n / compiled / copy_bandwidth  # >= 0.75: within the target's time
        entry.update(compiled_ms=1e3 * compiled, eager_ms=1e3 * eager, speedup=eager / compiled,
                     copy_ms=1e3 * copy, copy_bytes_per_s=copy_bandwidth, target_of_copy_bandwidth=of_copy,
                     bytes_per_element_at_copy_speed=copy_bandwidth * compiled / n,
                     fraction_of_peak_9_bytes=9 * n / compiled / peak,
                     # the owner step reads the rows' bytes, writes and reads the float32 sum, writes one row
                     owner_step_ms=1e3 * owner_s, owner_step_host_ms=1e3 * owner_host,
                     owner_step_bytes_per_element_at_copy_speed=copy_bandwidth * owner_s / n,
                     host_ms_per_call=1e3 * host, eager_host_ms_per_call=1e3 * eager_host)
        if entry["fallback_warnings"]:
            problems.append(f"{rows}x{cols}: kernels fell back to eager: {entry['fallback_warnings'][0]}")
        if of_copy < 0.75:
            problems.append(f"{rows}x{cols}: {TARGET_BYTES} bytes per element at {of_copy:.1%} of the copy "
                            f"bandwidth measured here ({copy_bandwidth / 1e12:.2f} TB/s; < 75 %)")
        if eager / compiled < 5:
            problems.append(f"{rows}x{cols}: {eager / compiled:.1f}x eager (< 5x)")
        if entry["first_call_s"] > 60:
            problems.append(f"{rows}x{cols}: first call (compile) took {entry['first_call_s']:.0f} s (> 60 s)")
    return result(values, problems)


# -- 10 --------------------------------------------------------------------------------------------------------
def jax_transfer_guard(device):
    """Gradient algorithms under pmap, shard_map and jit-first on every local device (one GPU), the steps under
    ``jax.transfer_guard("disallow")``: every transfer explicit, set-up and one warm-up step outside."""
    import jax
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import bagua_x.jax as bxj
    from bagua_x.algorithms import ByteGrad, GradientAllReduce
    from bx_jax_workers import loss_fn, make_data, make_params

    devices = jax.local_devices()
    values, problems = {"backend": jax.default_backend(), "devices": [str(d) for d in devices]}, []
    if device == "cuda" and jax.default_backend() != "gpu":
        problems.append(f"JAX runs on {jax.default_backend()}, not the GPU")
    params = make_params(0)
    x, y = make_data(3, len(devices))
    mesh = Mesh(np.array(devices), ("batch",))
    data = NamedSharding(mesh, P("batch"))  # the batch axis over the devices: pmap's layout and shard_map's
    for algorithm in (GradientAllReduce(), ByteGrad()):
        dp = bxj.wrap(params, algorithm=algorithm)
        tx = optax.chain(dp.gradient_transformation(), optax.adam(1e-2))

        def step(p, o, xb, yb, own=lambda q: q):
            u, o = tx.update(jax.grad(loss_fn)(own(p), xb, yb), o, p)
            return optax.apply_updates(p, u), o

        def block_step(p, o, xb, yb):  # shard_map hands each device a (1, ...) block of the batch axis
            # each device's own gradient: with respect to P() params jax.grad would sum it over the devices
            return step(p, o, xb[0], yb[0], own=lambda q: jax.lax.pcast(q, "batch", to="varying"))

        jit_dp, plain = bxj.wrap(params, algorithm=algorithm, mesh=mesh), optax.adam(1e-2)
        state = jit_dp.init()  # empty for these two algorithms: closed over

        def jit_step(p, o, xb, yb):  # jit-first: the global batch, bagua_x's own shard_map
            flat = lambda a: a.reshape((-1,) + a.shape[2:])  # noqa: E731
            (_, g), _ = jit_dp.value_and_grad(loss_fn)(p, flat(xb), flat(yb), state=state)
            u, o = plain.update(g, o, p)
            return optax.apply_updates(p, u), o

        modes = {
            "pmap": (jax.pmap(step, axis_name="batch"), dp.replicate(params), dp.replicate(tx.init(params))),
            "shard_map": (jax.jit(jax.shard_map(block_step, mesh=mesh, in_specs=(P(), P(), P("batch"), P("batch")),
                                                out_specs=(P(), P()))),
                          dp.replicate(params, mesh), dp.replicate(tx.init(params), mesh)),
            "jit": (jax.jit(jit_step), jit_dp.replicate(params), jit_dp.replicate(plain.init(params))),
        }
        for mode, (f, p, o) in modes.items():
            batches = [(jax.device_put(x[s], data), jax.device_put(y[s], data)) for s in range(len(x))]
            key = f"{type(algorithm).__name__} {mode}"
            try:
                p, o = jax.block_until_ready(f(p, o, *batches[0]))
                with jax.transfer_guard("disallow"):
                    for xb, yb in batches[1:]:
                        p, o = jax.block_until_ready(f(p, o, xb, yb))
                leaves = jax.device_get(jax.tree.leaves(p))
                values[key] = "ran" if all(np.isfinite(a).all() for a in leaves) else "non-finite params"
                if values[key] != "ran":
                    problems.append(f"{key}: {values[key]}")
            except Exception as e:  # noqa: BLE001 - a guarded transfer, or anything else: the finding
                values[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                problems.append(f"{key}: {values[key]}")
    return result(values, problems)


# -- 11 --------------------------------------------------------------------------------------------------------
def nccl_streams(device):
    """The input made on one stream (behind a 100 ms GPU sleep), the communicator on another: the collectives
    must wait for the input (DLPack's stream handshake), then give exact results."""
    import torch

    try:
        importlib.import_module("nccl.core")
    except ImportError as e:
        return result({"nccl4py": f"MISSING ({e})"},
                      ["missing piece: nccl4py is not installed (pip install 'bagua-x[nccl]')"])
    from bagua_x.core import ReduceOp
    from bagua_x.nccl import NcclCommunicator
    from gpu_check_torch import pause

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    producer, comm_stream = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    comm = NcclCommunicator(0, 1, device=0, stream=comm_stream)
    n = 1 << 22
    expected = (np.arange(n) % 7).astype(np.float32)
    try:
        with torch.cuda.stream(producer):
            pause(dev, 0.1)  # the input is not there for 100 ms: a communicator that does not wait reads garbage
            x = torch.arange(n, device=dev, dtype=torch.float32).remainder_(7)
            outs = {"sum": comm.allreduce(x), "avg": comm.allreduce(x, ReduceOp.AVG),
                    "allgather": comm.allgather(x), "broadcast": comm.broadcast(x, root=0)}
        torch.cuda.synchronize()
        errors = {k: float(np.abs(v.cpu().numpy().reshape(-1) - expected).max()) for k, v in outs.items()}
        errors["input"] = float(np.abs(x.cpu().numpy() - expected).max())
    finally:
        comm.close()
    problems = [f"{k}: differs by {v}" for k, v in errors.items() if v != 0.0]
    return result({"max_error": errors, "nccl4py": _version("nccl.core")}, problems)
