"""The torch checks of ``benchmarks/gpu_check.py --gpus N``: what can go wrong only with several GPUs.

Each function runs on N processes (tests/launch.py) and takes a ``mode``:

* ``"gpus"``: one GPU per process (GPU LOCAL_RANK), NCCL: the real check;
* ``"one gpu"``: every process on GPU 0 through gloo (NCCL refuses two ranks on one GPU): what one GPU can
  simulate;
* ``"cpu"``: the dry run, gloo on the CPU (``time.sleep`` for GPU sleeps, a collective of the user's own in
  place of SyncBatchNorm, which has no CPU kernel).

A criterion that only GPUs can decide is reported as not judged outside ``"gpus"`` (the driver says
"needs N GPUs").  Each check holds its numbers against an independent reference (torch's DDP or the numpy
references of tests/algorithms) and names a tolerance it can justify, so a plausible bug -- a sum where a
mean was due, a rank left out, a parameter not communicated -- turns it red.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import subprocess
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F

import bagua_x.torch as bxt
from bagua_x import algorithms as A
from bagua_x import testing
from bagua_x.core import BaguaXError
from bagua_x.core.bucket import BucketLayout
from bagua_x.testing.reference import DiLoCoWorkers
from gpu_check_other import numpy_reference, result
from gpu_check_torch import ALGORITHMS, _sync_free, batches, cycles_per_second, max_diff, mlp, optimizer, pause, \
    seconds_per_call, train_step

WIDTHS = [128, 256, 256, 32]  # the parity and ordering models: small, the checks are about numbers, not speed


def setup(mode: str) -> torch.device:
    """This process's device and the process group: GPU LOCAL_RANK with NCCL, GPU 0 or the CPU with gloo."""
    if mode == "cpu":
        dev = torch.device("cpu")
    else:
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]) if mode == "gpus" else 0)
        torch.cuda.set_device(dev)
        cycles_per_second()  # calibrated before any check pauses a stream
    if not dist.is_initialized():
        nccl = mode == "gpus"
        dist.init_process_group("nccl" if nccl else "gloo", device_id=dev if nccl else None)
    return dev


def _seeded(module_fn, dev: torch.device, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return module_fn().to(dev)


def _gather(value):
    """Every rank's ``value`` (a picklable object), in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# -- 20 --------------------------------------------------------------------------------------------------------
def _nvidia_smi_placement() -> dict | None:
    """pid -> the GPU indices nvidia-smi lists it on, or None where nvidia-smi is missing or lists nothing."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = lambda what: subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader"],  # noqa: E731
                                        capture_output=True, text=True, timeout=30).stdout.splitlines()
    index = dict(reversed(line.split(", ")) for line in query("gpu=index,uuid") if ", " in line)
    seen: dict[int, set] = {}
    for line in query("compute-apps=pid,gpu_uuid"):
        pid, _, uuid = line.partition(", ")
        if pid.strip().isdigit() and uuid in index:
            seen.setdefault(int(pid), set()).add(int(index[uuid]))
    return seen or None


def placement(mode):
    """Each process trains on its own GPU: bucket buffers and gradients there, no memory of this process on
    any other GPU (the allocator's count; nvidia-smi's process list where it sees the job's processes)."""
    dev = setup(mode)
    rank = dist.get_rank()
    model = mlp(dev, WIDTHS)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    wrapped = bxt.wrap(model, opt)
    for x, y in batches(dev, 3, WIDTHS, seed=1 + rank):
        train_step(wrapped, opt, x, y)
    where = sorted({str(b.buffer.device) for b in wrapped.buckets} | {str(p.grad.device) for p in model.parameters()})
    values = {"device": str(dev), "buckets_and_grads_on": where, "pid": os.getpid()}
    problems = [] if where == [str(dev)] else [f"rank {rank}: buckets or gradients on {where}, not {dev}"]
    if mode == "gpus":
        if torch.cuda.device_count() < dist.get_world_size():
            problems.append(f"{dist.get_world_size()} processes but {torch.cuda.device_count()} visible GPUs")
        others = {d: torch.cuda.memory_reserved(d) for d in range(torch.cuda.device_count()) if d != dev.index}
        values["bytes_on_other_gpus"] = others
        problems += [f"rank {rank}: {n} bytes reserved on GPU {d}" for d, n in others.items() if n]
        pids = _gather(os.getpid())
        if rank == 0:
            seen = _nvidia_smi_placement()
            values["nvidia_smi"] = {pid: sorted(seen.get(pid, ())) for pid in pids} if seen else "no processes listed"
            for r, pid in enumerate(pids):  # one machine: rank r's GPU is GPU r
                if seen and pid in seen and seen[pid] != {r}:
                    problems.append(f"rank {r} (pid {pid}) holds a context on GPUs {sorted(seen[pid])}")
        dist.barrier()  # every process alive while rank 0 asks nvidia-smi
    wrapped.shutdown()
    return result(values, problems, judged=mode == "gpus")


# -- 21 --------------------------------------------------------------------------------------------------------
class Branchy(torch.nn.Module):
    """An MLP and a head that only odd ranks use: DDP's ``find_unused_parameters`` case."""

    def __init__(self):
        super().__init__()
        self.body = mlp(torch.device("cpu"), WIDTHS)
        self.head = torch.nn.Linear(WIDTHS[-1], WIDTHS[-1])

    def forward(self, x):
        h = self.body(x)
        return self.head(h) if dist.get_rank() % 2 else h


def ddp_parity(mode):
    """DDP and wrap from the same weights on different data per rank, the forward under bf16 autocast, a head
    only odd ranks use (``find_unused_parameters=True``), 5 SGD steps with momentum: the weights agree to the
    reordering of a float32 sum (bound: 1e-3 of the distance the weights moved; a sum for a mean, or the head's
    gradient not averaged, moves them apart by the order of that distance)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = setup(mode)
    rank = dist.get_rank()
    data = batches(dev, 5, WIDTHS, seed=1 + rank)
    finals, start = {}, None
    for name in ("ddp", "bagua_x"):
        model = _seeded(Branchy, dev)
        start = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if name == "ddp":
            wrapped = DDP(model, device_ids=[dev.index] if mode == "gpus" else None, find_unused_parameters=True)
        else:
            wrapped = bxt.wrap(model, opt, find_unused_parameters=True, timeout=60)
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                out = wrapped(x)
            F.mse_loss(out.float(), y).backward()
            opt.step()
        finals[name] = [p.detach().clone() for p in model.parameters()]
        if name == "bagua_x":
            wrapped.shutdown()
    moved, diff = max_diff(finals["ddp"], start), max_diff(finals["bagua_x"], finals["ddp"])
    head_moved = max_diff(finals["ddp"][-2:], start[-2:])
    values = {"max_diff": diff, "moved": moved, "head_moved": head_moved, "world_size": dist.get_world_size()}
    problems = []
    if head_moved == 0:
        problems.append("the head did not train: the unused-parameter case was not exercised")
    if not diff <= 1e-3 * moved:
        problems.append(f"rank {rank}: wrap and DDP differ by {diff:.3g} after moving {moved:.3g} (> 1e-3 of it)")
    return result(values, problems)


# -- 22 --------------------------------------------------------------------------------------------------------
NUMEL = 4096
POWERSGD_SHAPES = [(64, 48), (48,), (16, 12, 4)]


def _reduce_steps(algorithm, dev, rank: int, steps: int, chained: bool, layout: BucketLayout):
    """``algorithm.reduce`` on this rank's data for ``steps`` steps: every rank's inputs and outputs (numpy).

    Chained (a weight algorithm): each input is the last output plus a small local change, from weights equal
    on every rank (as after wrap's broadcast); else fresh data per rank and step."""
    comm = bxt.TorchCommunicator()
    rng = np.random.default_rng(1000 + rank)
    x = torch.from_numpy(_initial(layout.numel)).to(dev)
    state = algorithm.init(x, layout, dist.get_world_size())
    ins, outs = [], []
    for _ in range(steps):
        change = torch.from_numpy(rng.standard_normal(layout.numel).astype(np.float32)).to(dev)
        x = x + 0.1 * change if chained else change
        ins.append(x.cpu().numpy().copy())
        x, state = algorithm.reduce(x, layout, state, comm)
        outs.append(x.cpu().numpy().copy())
    return _gather(ins), outs


def _initial(numel: int) -> np.ndarray:
    """The weights every rank starts from in :func:`_reduce_steps`."""
    return np.random.default_rng(7).standard_normal(numel).astype(np.float32)


def _quantisation_step(xs) -> float:
    return float(max(np.ptp(x) for x in xs)) / 255


def _judge(name: str, rank: int, outs, want, step: float) -> tuple[dict, list]:
    """Outputs against the reference's: all within 1e-5 (float32 reordering), or for a compressing algorithm
    (``step`` its quantisation step) at most 1 % of the values one code away, by at most a step: GPU kernels
    may round a value on the boundary of two codes the other way.  An uncompressed or unaveraged result is
    off almost everywhere."""
    errors = np.stack([np.abs(o - np.asarray(w, np.float32)) for o, w in zip(outs, want)])
    off = float(np.mean(errors > 1e-5))
    values = {"max_error": float(errors.max()), "share_off": off, "quantisation_step": step}
    if errors.max() > 1e-5 + step or off > (0.01 if step else 0.0):
        return values, [f"{name}: rank {rank} is up to {errors.max():.3g} from the numpy reference, {off:.1%} of "
                        "the values by more than 1e-5"]
    return values, []


def every_algorithm(mode):
    """Every algorithm's ``reduce`` through bagua_x's communicator on the ranks' own data (GPU tensors, NCCL),
    4 steps each, against the numpy references of tests/algorithms (no bagua_x code): within float32
    reordering (1e-5); the compressing ones may have at most 1 % of their values one code away (at most a
    quantisation step: GPU kernels round in another order) and ByteGrad must differ from the exact mean;
    AsyncModelAverage through wrap completes at least 3 rounds."""
    dev = setup(mode)
    ref, rank, world = numpy_reference(), dist.get_rank(), dist.get_world_size()
    flat = BucketLayout(["x"], [(NUMEL,)], "float32")
    cases = {
        "GradientAllReduce": (A.GradientAllReduce(), False, lambda xs, s, st: testing.reference.allreduce(xs)),
        "ByteGrad": (A.ByteGrad(), False, lambda xs, s, st: ref.bytegrad(xs)),
        "Decentralized": (A.Decentralized(), False, lambda xs, s, st: ref.decentralized(xs, "all", s, 1)),
        "Decentralized shift_one": (A.Decentralized(peer_selection_mode="shift_one"), False,
                                    lambda xs, s, st: ref.decentralized(xs, "shift_one", s, 1)),
        "LowPrecisionDecentralized": (A.LowPrecisionDecentralized(), True, None),
        "ModelAverage": (A.ModelAverage(period=2), True, lambda xs, s, st: ref.model_average(xs, s, 2)),
        "DiLoCo": (A.DiLoCo(sync_every=2), True, None),
        "SparseLoCo": (A.SparseLoCo(sync_every=2, fraction=0.1, chunk=64), True, None),
        "PowerSGD": (A.PowerSGD(matrix_approximation_rank=2, start_powerSGD_iter=1), False, None),
    }
    compressing = {"ByteGrad", "LowPrecisionDecentralized", "SparseLoCo"}
    values, problems, steps = {}, [], 4
    for name, (algorithm, chained, expected_at) in cases.items():
        layout = BucketLayout(["a", "b", "c"], POWERSGD_SHAPES, "float32") if name == "PowerSGD" else flat
        ins, outs = _reduce_steps(algorithm, dev, rank, steps, chained, layout)
        by_step = [[ins[r][s] for r in range(world)] for s in range(steps)]
        if name == "LowPrecisionDecentralized":
            states = ref.low_precision_init([_initial(NUMEL)] * world)
            want = []
            for s, xs in enumerate(by_step):
                expected, states = ref.low_precision_decentralized(xs, states, s, 1)
                want.append(expected)
        elif name in ("DiLoCo", "SparseLoCo"):
            workers = DiLoCoWorkers.like(algorithm, _initial(NUMEL), world)
            want = [workers.after_step(xs) for xs in by_step]
        elif name == "PowerSGD":
            want = ref.powersgd(by_step, POWERSGD_SHAPES, rank=2, start=1)
        else:
            want = [expected_at(xs, s, None) for s, xs in enumerate(by_step)]
        assert len(want) == len(outs) == steps
        values[name], problem = _judge(name, rank, outs, [w[rank] for w in want],
                                       _quantisation_step(ins[rank]) if name in compressing else 0.0)
        problems += problem
        if name == "ByteGrad":
            exact = testing.reference.allreduce(by_step[-1])[rank]
            if float(np.abs(outs[-1] - exact).max()) < 1e-4:
                problems.append("ByteGrad: equal to the exact mean: not compressed")
    values["AsyncModelAverage"], problem = _async_rounds(dev, rank)
    problems += problem
    return result(values, problems)


def _async_rounds(dev, rank: int):
    """AsyncModelAverage through wrap, per-rank data, until 3 rounds (at most 20 s): rounds and spread."""
    model = mlp(dev, WIDTHS)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped = bxt.wrap(model, opt, algorithm=A.AsyncModelAverage(sync_interval_ms=20, warmup_steps=1), timeout=60)
    data = batches(dev, 4, WIDTHS, seed=1 + rank)
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < 20:
        x, y = data[steps % len(data)]
        train_step(wrapped, opt, x, y)
        steps += 1
        time.sleep(0.01)
        if steps >= 20 and min(_gather(wrapped._engine.rounds)) >= 3:
            break
    rounds = wrapped._engine.rounds
    wrapped.abort()
    wrapped.shutdown()
    problems = [] if rounds >= 3 else [f"AsyncModelAverage: rank {rank} completed {rounds} rounds in 20 s (< 3)"]
    return {"rounds": rounds, "steps": steps}, problems


# -- 23 --------------------------------------------------------------------------------------------------------
def two_level(mode):
    """The N ranks as 2 pseudo-nodes of N/2 (LOCAL_WORLD_SIZE): the node groups hold the right ranks, and
    GradientAllReduce, ByteGrad and Decentralized over nodes equal the numpy two-level references (full
    precision inside a node, the flat algorithm between nodes), as :func:`_judge` says; every rank of a node
    ends bitwise equal."""
    dev = setup(mode)
    ref, rank, world = numpy_reference(), dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    if world < 4 or world % local:
        return result({"world_size": world}, [f"two levels need 2 nodes of >= 2 ranks: N = {world} is not"])
    comm = bxt.TorchCommunicator()
    comm.enable_hierarchical(True)
    values = {"within": [comm.within.rank, comm.within.size], "across": [comm.across.rank, comm.across.size]}
    problems = []
    if values["within"] != [rank % local, local] or values["across"] != [rank // local, world // local]:
        problems.append(f"rank {rank}: node groups {values} for nodes of {local}")
    layout = BucketLayout(["x"], [(NUMEL,)], "float32")
    cases = {"GradientAllReduce": (A.GradientAllReduce(hierarchical=True), testing.reference.allreduce),
             "ByteGrad": (A.ByteGrad(hierarchical=True), lambda xs, s: ref.bytegrad_hierarchical(xs, local)),
             "Decentralized": (A.Decentralized(hierarchical=True, peer_selection_mode="shift_one"),
                               lambda xs, s: ref.decentralized_hierarchical(xs, local, "shift_one", s, 1))}
    for name, (algorithm, reference) in cases.items():
        rng = np.random.default_rng(2000 + rank)
        x = torch.zeros(NUMEL, device=dev)
        state = algorithm.init(x, layout, world)
        want, outs, step = [], [], 0.0
        for s in range(3):
            mine = rng.standard_normal(NUMEL).astype(np.float32)
            out, state = algorithm.reduce(torch.from_numpy(mine).to(dev), layout, state, comm)
            outs.append(out.cpu().numpy())
            xs = _gather(mine)
            want.append((reference(xs) if name == "GradientAllReduce" else reference(xs, s))[rank])
            step = max(step, _quantisation_step(xs) if name == "ByteGrad" else 0.0)
        values[name], problem = _judge(name, rank, outs, want, step)
        problems += problem
        nodes = _gather(outs)
        same_in_node = all(np.array_equal(a, b) for a, b in zip(outs, nodes[rank - rank % local]))
        values[name]["equal_in_node"] = same_in_node
        if not same_in_node:
            problems.append(f"{name}: rank {rank} differs from its node's first rank")
    return result(values, problems)


# -- 24 --------------------------------------------------------------------------------------------------------
_JITTER = random.Random()


class Jittery(A.GradientAllReduce):
    """GradientAllReduce after a random pause of 0-20 ms on the communication stream, drawn per rank and call:
    the ranks reach each bucket's collective in different orders of time."""

    def reduce(self, flat, layout, state, comm):
        pause(flat.device, _JITTER.uniform(0.0, 0.02))
        return super().reduce(flat, layout, state, comm)


class GlobalCentre(torch.nn.Module):
    """SyncBatchNorm's communication without its kernels (none on the CPU): the features centred by the mean over
    every rank's batch, an allreduce in forward and another in backward on the default group."""

    def forward(self, h):
        return h - dist_nn.all_reduce(h.mean(0)) / dist.get_world_size()


def _stress_models(dev, mode: str):
    norm = torch.nn.SyncBatchNorm(WIDTHS[1]) if mode == "gpus" else GlobalCentre()  # gloo: no SyncBatchNorm
    first = lambda: torch.nn.Sequential(torch.nn.Linear(WIDTHS[0], WIDTHS[1]), norm, torch.nn.ReLU(),  # noqa: E731
                                        torch.nn.Linear(WIDTHS[1], WIDTHS[-1]))
    return _seeded(first, dev, 0), mlp(dev, WIDTHS, seed=1)


def ordering_stress(mode):
    """Two wrapped models, SyncBatchNorm (on the CPU: its allreduces), an all-gather with autograd in the loss,
    and each rank pausing 0-20 ms at random before every bucket: no hang (timeout 60 s), and after 6 steps both
    models equal the same training under DDP to float32 reordering (1e-3 of the distance moved)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = setup(mode)
    rank = dist.get_rank()
    _JITTER.seed(rank)
    data = batches(dev, 6, WIDTHS, seed=1 + rank)
    finals, start = {}, None
    for name in ("ddp", "bagua_x"):
        first, second = _stress_models(dev, mode)
        start = [p.detach().clone() for m in (first, second) for p in m.parameters()]
        opt = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.05, momentum=0.9)
        if name == "ddp":
            ids = [dev.index] if mode == "gpus" else None
            wrapped = [DDP(first, device_ids=ids), DDP(second, device_ids=ids)]
        else:
            wrapped = [bxt.wrap(m, algorithm=Jittery(), timeout=60) for m in (first, second)]
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            a, b = wrapped[0](x), wrapped[1](x)
            everyone = torch.cat(dist_nn.all_gather(b))  # every rank's output: a collective in backward too
            loss = F.mse_loss(a, y) + F.mse_loss(b, y) + 0.1 * everyone.pow(2).mean()
            loss.backward()
            opt.step()
        finals[name] = [p.detach().clone() for m in (first, second) for p in m.parameters()]
        if name == "bagua_x":
            for w in wrapped:
                w.shutdown()
    moved, diff = max_diff(finals["ddp"], start), max_diff(finals["bagua_x"], finals["ddp"])
    problems = [] if diff <= 1e-3 * moved else [f"rank {rank}: {diff:.3g} from DDP after moving {moved:.3g}"]
    return result({"max_diff": diff, "moved": moved, "sync_batch_norm": mode == "gpus"}, problems)


# -- 25, 26 ----------------------------------------------------------------------------------------------------
PROXY_S_PER_MB = 0.002  # the proxy's communication time: 2 ms a megabyte (500 MB/s, a slow NIC's order)


class Proxy(A.GradientAllReduce):
    """No communication: a pause on the communication stream as long as a bucket's exchange over a 500 MB/s
    link would take (the one-GPU stand-in for a slow link)."""

    def reduce(self, flat, layout, state, comm):
        pause(flat.device, flat.numel() * flat.element_size() / 1e6 * PROXY_S_PER_MB)
        return flat, state


def _step_seconds(wrapped, opt, data, dev) -> float:
    """Seconds per training step over ``data``'s batches in turn (CUDA events; perf_counter on the CPU)."""
    turn = itertools.cycle(data)
    return seconds_per_call(lambda: train_step(wrapped, opt, *next(turn)), dev, repeat=10, warmup=3)


def overlap_proxy(mode):
    """The communication of a backward hidden behind its compute, with the communication simulated (a pause
    on the communication stream, 2 ms a MB): the step takes at most compute + 0.35 x the pauses.  On one GPU
    the driver runs it in one process: processes sharing a GPU take turns on it, a pause of one stalls all."""
    dev = setup(mode)
    widths = [2048, 4096, 2560, 1024] if dev.type == "cuda" else WIDTHS
    data = batches(dev, 4, widths)
    model = mlp(dev, widths)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    compute = _step_seconds(model, opt, data, dev)
    wrapped = bxt.wrap(model, opt, algorithm=Proxy(), timeout=60)
    step = _step_seconds(wrapped, opt, data, dev)
    comm = sum(b.buffer.numel() * b.buffer.element_size() for b in wrapped.buckets) / 1e6 * PROXY_S_PER_MB
    wrapped.shutdown()
    bound, judged = compute + 0.35 * comm, mode != "cpu"
    values = {"compute_s": compute, "communication_s": comm, "step_s": step, "bound_s": bound}
    problems = [] if step <= bound or not judged else [f"step {step * 1e3:.1f} ms > compute {compute * 1e3:.1f} "
                                                       f"+ 0.35 x communication {comm * 1e3:.1f} ms"]
    return result(values, problems, judged=judged)


def overlap_nccl(mode):
    """Slowed NCCL links (the check sets NCCL_P2P_DISABLE=1, NCCL_MAX_NCHANNELS=1) and a 21.5M-parameter MLP:
    wrap's step <= compute + 0.35 x communication (each bucket allreduced alone) and <= 1.05 x DDP's, and
    ByteGrad's <= 0.8 x GradientAllReduce's."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = setup(mode)
    widths = [2048, 4096, 2560, 1024] if mode == "gpus" else WIDTHS
    data = batches(dev, 4, widths)
    model = mlp(dev, widths)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    values = {"compute_s": _step_seconds(model, opt, data, dev)}
    wrapped = bxt.wrap(model, opt, timeout=60)
    values["step_s"] = _step_seconds(wrapped, opt, data, dev)
    buffers = [b.buffer for b in wrapped.buckets]
    values["communication_s"] = seconds_per_call(lambda: [dist.all_reduce(b) for b in buffers], dev, repeat=10)
    wrapped.shutdown()
    bytegrad_model = mlp(dev, widths)
    bytegrad_opt = torch.optim.SGD(bytegrad_model.parameters(), lr=1e-4)
    bytegrad = bxt.wrap(bytegrad_model, bytegrad_opt, algorithm=A.ByteGrad(), timeout=60)
    values["bytegrad_step_s"] = _step_seconds(bytegrad, bytegrad_opt, data, dev)
    bytegrad.shutdown()
    ddp_model = mlp(dev, widths)
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=1e-4)
    values["ddp_step_s"] = _step_seconds(DDP(ddp_model, device_ids=[dev.index] if mode == "gpus" else None),
                                         ddp_opt, data, dev)
    v = values
    problems = []
    if mode != "gpus":
        return result(values, problems, judged=False)
    if v["step_s"] > v["compute_s"] + 0.35 * v["communication_s"]:
        problems.append(f"step {v['step_s']:.4f} s > compute {v['compute_s']:.4f} + 0.35 x {v['communication_s']:.4f}")
    if v["step_s"] > 1.05 * v["ddp_step_s"]:
        problems.append(f"step {v['step_s']:.4f} s > 1.05 x DDP's {v['ddp_step_s']:.4f}")
    if v["bytegrad_step_s"] > 0.8 * v["step_s"]:
        problems.append(f"ByteGrad {v['bytegrad_step_s']:.4f} s > 0.8 x GradientAllReduce's {v['step_s']:.4f}")
    return result(values, problems)


# -- 27 --------------------------------------------------------------------------------------------------------
def no_host_sync(mode):
    """Every algorithm of the one-GPU check and PowerSGD as a DDP comm hook, 7 steps at world size N, the last 3
    under ``set_sync_debug_mode("error")``: no synchronising call (gloo on one GPU syncs by design: GPUs only)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = setup(mode)
    rank = dist.get_rank()
    data = batches(dev, 7, WIDTHS, seed=1 + rank)
    values, problems = {}, []
    for name in [*ALGORITHMS, "PowerSGD as a DDP comm hook"]:
        model = mlp(dev, WIDTHS)
        opt = optimizer(name, model)
        if name.endswith("comm hook"):
            wrapped = DDP(model, device_ids=[dev.index] if mode == "gpus" else None)
            state = bxt.CommHookState(A.PowerSGD(matrix_approximation_rank=2, start_powerSGD_iter=5), timeout=30)
            wrapped.register_comm_hook(state, bxt.comm_hook)
            close = state.close
        else:
            wrapped = bxt.wrap(model, opt, algorithm=ALGORITHMS[name], timeout=30)
            close = wrapped.shutdown
        error = _sync_free(lambda x, y: train_step(wrapped, opt, x, y), data)
        values[name] = {"error": error}
        if error:
            problems.append(f"{name}: {error}")
        if name == "AsyncModelAverage":
            wrapped.abort()
        close()
    return result(values, problems, judged=mode == "gpus")


# -- 28 --------------------------------------------------------------------------------------------------------
KILL_TIMEOUT = 5.0


def killed_rank(mode):
    """The last rank exits abruptly after 3 steps (the check's driver expects it to leave no result); every
    other rank must raise a BaguaXError within wrap's timeout + 7 s, naming the bucket."""
    dev = setup(mode)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = mlp(dev, WIDTHS)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    wrapped = bxt.wrap(model, opt, timeout=KILL_TIMEOUT)
    data = batches(dev, 2, WIDTHS, seed=1 + rank)
    for x, y in data * 2:
        train_step(wrapped, opt, x, y)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    if rank == world - 1:
        os._exit(3)
    start, error = time.perf_counter(), None
    try:
        while time.perf_counter() - start < KILL_TIMEOUT + 20:
            train_step(wrapped, opt, *data[0])
    except Exception as e:  # noqa: BLE001 - judged below
        error = e
    seconds = time.perf_counter() - start
    values = {"raised": type(error).__name__ if error else None, "seconds": round(seconds, 2),
              "message": str(error).splitlines()[0][:300] if error else None}
    problems = []
    if not isinstance(error, BaguaXError):
        problems.append(f"rank {rank}: expected a BaguaXError, got {values['raised']} after {seconds:.1f} s")
    elif seconds > KILL_TIMEOUT + 7:
        problems.append(f"rank {rank}: reported after {seconds:.1f} s (> timeout {KILL_TIMEOUT:.0f} + 7 s)")
    return result(values, problems)
