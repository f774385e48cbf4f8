"""One rank of tests/test_cluster.py's DiLoCo wire-bytes run: node 0's veth counters around every step.

Usage: torch_diloco_bytes.py OUT HIERARCHICAL CONFIGS
HIERARCHICAL is DiLoCo's setting (``none``, ``true``, ``false``); CONFIGS a JSON list of
``{"bits": b, "fragments": p}`` or ``{"topk": {TopK's keywords}, "fragments": p, "side": S}``.  For each config
a fresh SIDE x SIDE linear model (512 unless ``side`` says otherwise: one bucket of 2^18 float32) is wrapped with DiLoCo(sync_every=H, ...) and trained 2 H steps; rank 0 (on node 0)
reads the node's veth byte counters (rx + tx: in a 2-node cluster every byte between the nodes
crosses it) after a barrier before the first step, after every step and once more after a last
barrier, and writes the cumulative counts to OUT/bytes.json.  Every reading sits between two
barriers (``read()``): with only one, the ranks that leave it first start the next exchange (a
ring's first chunk needs nobody) while rank 0 has not read yet, and a sync's bytes leak into the
window before it.  The barriers' own packets are the control traffic the test subtracts.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import bagua_x.torch as bxt
from bagua_x.algorithms import DiLoCo, TopK

H, CYCLES, SIDE = 8, 2, 512


def veth_bytes():
    """rx + tx bytes of this node's veth, from /proc/net/dev (the node's network namespace)."""
    dev = os.environ["GLOO_SOCKET_IFNAME"]
    for line in open("/proc/net/dev").read().splitlines()[2:]:
        name, fields = line.split(":", 1)
        if name.strip() == dev:
            fields = fields.split()
            return int(fields[0]) + int(fields[8])
    raise SystemExit(f"no {dev} in /proc/net/dev")


def read():
    """Node 0's counter at a point every rank has reached and none has left before it was read."""
    dist.barrier()
    count = veth_bytes() if dist.get_rank() == 0 else 0
    dist.barrier()
    return count


def main():
    out, setting, configs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    hierarchical = {"none": None, "true": True, "false": False}[setting]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = []
    for config in configs:
        side = config.get("side", SIDE)
        torch.manual_seed(0)
        model = torch.nn.Linear(side, side, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        settings = {k: v for k, v in config.items() if k not in ("topk", "side")}
        if "topk" in config:
            settings["compression"] = TopK(**config["topk"])
        algorithm = DiLoCo(sync_every=H, hierarchical=hierarchical, **settings)
        wrapped = bxt.wrap(model, opt, algorithm=algorithm)
        gen = torch.Generator().manual_seed(rank)
        readings = [read()]
        for _ in range(CYCLES * H):
            x, y = torch.randn(16, side, generator=gen), torch.randn(16, side, generator=gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(wrapped(x), y).backward()
            opt.step()  # the exchange (on sync steps) is over when step() returns
            readings.append(read())
        results.append(dict(config, sync_every=H, numel=side * side, offsets=algorithm.offsets(), readings=readings))
        wrapped.shutdown()
    if rank == 0:
        with open(os.path.join(out, "bytes.json"), "w") as f:
            json.dump({"world": dist.get_world_size(), "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
                       "results": results}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
