"""The links of a ``bagua-x cluster``: inter-node vs intra-node transfer, flat vs hierarchical allreduce.

    sudo bagua-x cluster --nodes 2 --nproc-per-node 2 -- python benchmarks/cluster_link.py [--mb 50] [--json OUT]

Rank 0 sends MB megabytes to rank 1 (same node, loopback) and to the first
rank of node 1 (across the capped veth), and every rank allreduces MB/2
megabytes flat (gloo ring over all ranks) and hierarchically (bagua_x:
reduce-scatter inside the node, allreduce of each rank's shard across nodes,
allgather inside the node), and each of the hierarchical steps alone.  Rank 0 prints
one JSON line, with the node's veth byte counters to show that only
inter-node traffic crosses the veth.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import bagua_x.torch as bxt
from bagua_x.algorithms import EmptyState, GradientAllReduce
from bagua_x.core import ReduceOp


def veth_bytes():
    base = f"/sys/class/net/{os.environ.get('GLOO_SOCKET_IFNAME', '')}/statistics/"
    try:
        return int(open(base + "tx_bytes").read()) + int(open(base + "rx_bytes").read())
    except (OSError, ValueError):
        return None


def timed(fn, reps):
    fn()  # warm-up: connections, lazily made groups
    dist.barrier()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    dist.barrier()
    return (time.perf_counter() - t) / reps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=50.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    buf = torch.zeros(int(args.mb * 1e6 / 4))
    res = {"world": world, "local_world_size": local, "mb": args.mb, "link": os.environ.get("BAGUA_X_LINK")}

    def send_to(peer):
        def f():
            if rank == 0:
                dist.send(buf, peer)
            elif rank == peer:
                dist.recv(buf, 0)
        return f

    before = veth_bytes()
    res["intra_node_s"] = timed(send_to(1), args.reps)
    mid = veth_bytes()
    res["inter_node_s"] = timed(send_to(local), args.reps)
    after = veth_bytes()
    if before is not None:
        res["veth_mb_during_intra_node"] = (mid - before) / 1e6
        res["veth_mb_during_inter_node"] = (after - mid) / 1e6
    res["inter_node_mb_per_s"] = args.mb / res["inter_node_s"]
    half = torch.ones(int(args.mb * 1e6 / 8))
    comm = bxt.TorchCommunicator()
    comm.enable_hierarchical(True)
    two_level = GradientAllReduce(average=False, hierarchical=True)
    res["allreduce_mb"] = args.mb / 2
    res["flat_allreduce_s"] = timed(lambda: dist.all_reduce(half), args.reps)
    res["hierarchical_allreduce_s"] = timed(lambda: two_level.reduce(half, None, EmptyState(), comm), args.reps)
    rows = half.reshape(local, -1)  # the hierarchical steps alone
    res["node_reduce_scatter_s"] = timed(lambda: comm.within.reduce_scatter(rows, ReduceOp.SUM), args.reps)
    res["across_allreduce_s"] = timed(lambda: comm.across.allreduce(rows[0], ReduceOp.SUM), args.reps)
    res["node_allgather_s"] = timed(lambda: comm.within.allgather(rows[0]), args.reps)
    if rank == 0:
        print(json.dumps(res), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
