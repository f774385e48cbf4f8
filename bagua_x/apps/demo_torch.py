"""The demo's PyTorch runs: every rank of a torchrun job trains the MLP once per algorithm.

    python -m torch.distributed.run --nproc_per_node 4 -m bagua_x.apps.demo_torch --json out.json allreduce bytegrad

One job runs all the algorithms in turn, so the processes start (and gloo
connects) once, not once per algorithm: on a 2-core machine that start costs
more than a short training run.  When each run stops is :mod:`.demo_run`'s
plan.  The clock counts training steps only: the first step (it connects and
compiles kernels, once) and the held-out evaluations are off it, and each
evaluation ends in a collective, so a rank that evaluates faster does not
charge its wait to the next step.
"""

from __future__ import annotations

import json
import time


def mlp(hidden: int):
    """64 -> hidden -> hidden -> 10: with the default hidden 1024, 1.1 M parameters, 4.5 MB of gradient a step."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def train(algo_name: str, args, data) -> dict:
    """One algorithm's run; every rank returns the same dict (curves averaged, clock the slowest rank's)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from tqdm import tqdm

    import bagua_x.torch as bxt
    from bagua_x.algorithms import QAdam

    from ..core.topology import StepTrial
    from .algorithms import make
    from .data import rank_batches
    from .demo_run import plan_for

    rank, world = dist.get_rank(), dist.get_world_size()
    x_tr, y_tr, x_te, y_te = data
    x_eval, y_eval = torch.from_numpy(x_te[rank::world]), torch.from_numpy(y_te[rank::world])
    torch.manual_seed(args.seed + rank)  # ranks start apart: wrap() broadcasts rank 0's weights
    model = mlp(args.hidden)
    algorithm = make(algo_name, args.steps)
    if isinstance(algorithm, QAdam):
        optimizer = bxt.QAdamOptimizer(model.parameters(), lr=algorithm.lr, warmup_steps=algorithm.warmup_steps,
                                       betas=algorithm.betas, eps=algorithm.eps, weight_decay=algorithm.weight_decay)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    wrapped = bxt.wrap(model, optimizer, algorithm=algorithm)
    plan = plan_for(algorithm, args, args.reference.get(algo_name), StepTrial().steps if algorithm.timed_form else 0)

    def evaluate(clock: float) -> tuple[float, float]:
        """Held-out accuracy (each rank's own model on its share of the held-out set) and the slowest clock."""
        with torch.no_grad():
            correct = float((model(x_eval).argmax(1) == y_eval).sum())
        counts, slowest = torch.tensor([correct, float(len(y_eval))]), torch.tensor([clock])
        dist.all_reduce(counts)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # also a barrier: the clock restarts together
        return float(counts[0] / counts[1]), float(slowest[0])

    losses, seconds, evals, clock, reached = [], [], [], 0.0, False
    dist.barrier()
    batches = rank_batches(x_tr, y_tr, rank, world, args.batch, args.steps, args.seed)
    for step, (xb, yb) in enumerate(tqdm(batches, total=args.steps, desc=f"torch/{algo_name}",
                                         disable=rank != 0, leave=False), 1):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(wrapped(torch.from_numpy(xb)), torch.from_numpy(yb))
        loss.backward()
        optimizer.step()
        if step == 1:  # connects the buckets and compiles kernels (torch.compile): one-off, kept off the clock
            first_step = time.perf_counter() - start
        else:
            clock += time.perf_counter() - start
        losses.append(loss.item())
        seconds.append(clock)
        if plan.evaluates(step):
            accuracy, slowest = evaluate(clock)
            evals.append([step, accuracy])
            reached = reached or accuracy >= args.target
            if plan.done(step, slowest, reached):
                break
    wrapped.shutdown()

    curve, clocks = torch.tensor(losses), torch.tensor(seconds)
    dist.all_reduce(curve)
    dist.all_reduce(clocks, op=dist.ReduceOp.MAX)
    return {
        "frontend": "torch", "algorithm": algo_name, "losses": (curve / world).tolist(), "seconds": clocks.tolist(),
        "evals": evals, "accuracy": evals[-1][1], "step_ms": 1000 * float(clocks[-1]) / max(len(losses) - 1, 1),
        "first_step_s": first_step,
        "bytes_per_step": sum(algorithm.wire_bytes(b.layout, b.itemsize, world) for b in wrapped.buckets),
        "parameters": sum(p.numel() for p in model.parameters()), **plan.record(),
    }


def main(argv=None) -> None:
    from .demo_run import job_arguments

    args = job_arguments(__doc__.split("\n\n")[0], argv)

    import torch
    import torch.distributed as dist

    from .data import load_digits_split

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    data = load_digits_split(args.seed)
    runs = []
    for name in args.algorithms:
        runs.append(train(name, args, data))
        if dist.get_rank() == 0:
            r = runs[-1]
            print(f"  torch {name:14s} {len(r['losses']):4d} steps in {r['seconds'][-1]:5.1f} s, "
                  f"held-out accuracy {r['accuracy']:.3f}", flush=True)
    if dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump(runs, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
