"""Minimal data-parallel training with bagua_x.torch.

    torchrun --nproc_per_node 2 examples/torch_train.py              # GradientAllReduce (like DDP)
    torchrun --nproc_per_node 2 examples/torch_train.py bytegrad     # 8-bit compressed gradients

Each rank trains on its own shard of a synthetic regression task; wrap()
initialises torch.distributed from torchrun's environment, copies rank 0's
weights to every rank and synchronises every step with the chosen algorithm.
"""

import sys

import torch
import torch.nn.functional as F

import bagua_x.torch as bxt
from bagua_x.algorithms import ByteGrad, Decentralized, GradientAllReduce, LowPrecisionDecentralized, ModelAverage

ALGORITHMS = {
    "allreduce": GradientAllReduce, "bytegrad": ByteGrad, "decentralized": Decentralized,
    "low_precision_decentralized": LowPrecisionDecentralized, "model_average": ModelAverage,
}


def main():
    algorithm = ALGORITHMS[sys.argv[1] if len(sys.argv) > 1 else "allreduce"]()
    torch.manual_seed(0)
    true_w = torch.randn(32, 1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model = bxt.wrap(model, optimizer, algorithm=algorithm)

    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    for step in range(200):
        x = torch.randn(64, 32, generator=g)
        loss = F.mse_loss(model(x), x @ true_w)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 50 == 49:
            print(f"step {step + 1}: loss {loss.item():.4f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
