"""One demo run with the PyTorch frontend (executed on every rank by the launcher)."""

from __future__ import annotations

import time


def train(algo_name: str, steps: int, batch: int, lr: float, seed: int) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from tqdm import tqdm

    import bagua_x.torch as bxt
    from bagua_x.algorithms import QAdam

    from .algorithms import make
    from .data import load_digits_split, rank_batches

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x_tr, y_tr, x_te, y_te = load_digits_split(seed)
    torch.manual_seed(seed + rank)  # ranks start apart: wrap() broadcasts rank 0's weights
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    algorithm = make(algo_name, steps)
    if isinstance(algorithm, QAdam):
        optimizer = bxt.QAdamOptimizer(model.parameters(), lr=algorithm.lr, warmup_steps=algorithm.warmup_steps)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    wrapped = bxt.wrap(model, optimizer, algorithm=algorithm)

    losses, times = [], []
    batches = rank_batches(x_tr, y_tr, rank, world, batch, steps, seed)
    for xb, yb in tqdm(batches, total=steps, desc=f"torch/{algo_name}", disable=rank != 0, leave=False):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(wrapped(torch.from_numpy(xb)), torch.from_numpy(yb))
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    if hasattr(wrapped, "shutdown"):
        wrapped.shutdown()

    with torch.no_grad():
        correct = (model(torch.from_numpy(x_te)).argmax(1).numpy() == y_te).mean()
    curve = torch.tensor(losses)
    stats = torch.tensor([float(correct)])
    dist.all_reduce(curve)
    dist.all_reduce(stats)
    result = {
        "frontend": "torch", "algorithm": algo_name, "losses": (curve / world).tolist(),
        "accuracy": float(stats[0]) / world, "step_ms": 1000 * float(np.mean(times[len(times) // 5 :])),
        "bytes_per_step": sum(algorithm.wire_bytes(b.layout, b.itemsize, world) for b in wrapped.buckets),
    }
    dist.destroy_process_group()
    return result
