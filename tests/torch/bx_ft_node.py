"""One rank of one node (a torchft replica group) of the fault-tolerance tests.

Run as a process with torchrun-style variables for its node (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT of the node's own store), REPLICA_GROUP_ID and
TORCHFT_LIGHTHOUSE.  Trains an MLP until ``target`` steps are committed; the
batch of each step is a pure function of (node, rank, committed step), so the
data position is the committed step and a healed node continues where its peer
is.  Every step appends one JSON line to ``log``: the committed count after it,
whether it committed, how many nodes took part, the time, and the loss.  At the
end it writes the final weights and algorithm state (``.pt``).

    python bx_ft_node.py ALGORITHM TARGET LOG [DELAY]

LOG may hold ``{node}`` and ``{rank}`` (every rank of a ``bagua-x cluster`` runs the same command).  With
``BX_FT_DIE_AT=K`` every rank of node 1 kills itself (SIGKILL) after its K-th step of its first attempt, so
that torchrun restarts the node (``bagua-x cluster --fault-tolerant``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

ALGORITHMS = {
    "allreduce": lambda a: a.GradientAllReduce(),
    "bytegrad": lambda a: a.ByteGrad(),
    "diloco": lambda a: a.DiLoCo(sync_every=4),
    "sparseloco": lambda a: a.SparseLoCo(sync_every=4),
}


def batch(stream: int, index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s part of batch ``index`` of data stream ``stream``: the same whichever process draws it."""
    g = torch.Generator().manual_seed(1_000_000 * stream + 100 * index + rank)
    x = torch.randn(16, 8, generator=g)
    return x, (x[:, :2].sum(dim=1) > 0).long()


def _flat_state(wrapped):
    out = []
    for name, bucket in sorted(wrapped.algorithm_state_dict().items()):
        if isinstance(bucket, dict):
            out += [(f"{name}/{k}", v) for k, v in sorted(bucket.items()) if isinstance(v, torch.Tensor)]
    return out


def model(seed: int) -> torch.nn.Module:
    """An MLP; BX_FT_WIDTH changes its hidden width (a node that joins with another model)."""
    torch.manual_seed(seed)
    width = int(os.environ.get("BX_FT_WIDTH", "32"))
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 2))


def main(algorithm: str, target: int, log_path: str, delay: float = 0.0) -> None:
    """Gradient algorithms draw from one global stream: a step's batches are numbered from torchft's count of
    batches committed, one per taking-part node (its place in the quorum), so a discarded step's batches are
    drawn again and a healed node continues the count.  DiLoCo's nodes each read their own stream, at a
    position healed from the peer with the rest."""
    import bagua_x.algorithms as alg
    import bagua_x.torch as bxt

    rank = int(os.environ["RANK"])  # wrap() initialises torch.distributed: a store prefix per torchrun restart
    node = int(os.environ["REPLICA_GROUP_ID"].removeprefix("node"))
    log_path = log_path.format(node=node, rank=rank)
    die_at = int(os.environ.get("BX_FT_DIE_AT", "-1")) if node == 1 else -1
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        die_at = -1  # a restarted node lives
    net = model(seed=node)  # nodes start apart: the first quorum heals them to one
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    algo = ALGORITHMS[algorithm](alg)
    wrapped = bxt.wrap(net, opt, algorithm=algo,
                       fault_tolerance=bxt.FaultTolerance(
                           timeout=10, quorum_timeout=float(os.environ.get("BX_FT_QUORUM_TIMEOUT", 60))), timeout=60)
    replicas = wrapped.replicas
    manager = replicas.manager
    per_step = not isinstance(algo, alg.DiLoCo)
    position = {"inner": 0}
    replicas.keep("data", lambda: dict(position), position.update)
    steps_here = 0  # in this attempt
    with open(log_path, "a") as log:
        while (manager.current_step() if per_step else position["inner"]) < target:
            if per_step:
                replicas.begin()  # the quorum first: who takes part (and healing) decides this step's batches
                place = manager.participating_rank()
                stream, index = 0, manager.batches_committed() + place
            else:
                place, stream, index = None, node, position["inner"]
            x, y = batch(stream, index, rank)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(wrapped(x), y)
            loss.backward()
            before = manager.current_step()
            opt.step()
            position["inner"] += 1
            log.write(json.dumps({"rank": rank, "index": index, "rank_in_quorum": place, "step": manager.current_step(),
                                  "committed": manager.current_step() > before, "nodes": manager.num_participants(),
                                  "time": time.time(), "loss": loss.item(),
                                  "debug": [float(v.double().sum()) for k, v in _flat_state(wrapped)]}) + "\n")
            log.flush()
            steps_here += 1
            if steps_here == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(delay)
    torch.save({"model": {k: v.clone() for k, v in net.state_dict().items()},
                "algorithm": wrapped.algorithm_state_dict()}, f"{log_path}.pt")
    wrapped.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]) if len(sys.argv) > 4 else 0.0)
