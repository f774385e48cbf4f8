"""One rank of tests/test_cluster.py's torch run: hierarchical and flat allreduce, results to OUT/rank<R>.json.

Usage: torch_allreduce.py OUT [--crash-rank R]
"""

import json
import os
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist

import bagua_x.torch as bxt
from bagua_x.algorithms import EmptyState, GradientAllReduce

out = sys.argv[1]
crash = int(sys.argv[sys.argv.index("--crash-rank") + 1]) if "--crash-rank" in sys.argv else None
with open(os.path.join(out, f"pid{os.environ['RANK']}"), "w") as f:  # the test checks that no rank outlives the run
    f.write(str(os.getpid()))
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if rank == crash:
    raise SystemExit(f"rank {rank} crashes on purpose")
comm = bxt.TorchCommunicator()
comm.enable_hierarchical(True)
x = torch.arange(1000, dtype=torch.float32) * (rank + 1)
hier = GradientAllReduce(average=False, hierarchical=True).reduce(x.clone(), None, EmptyState(), comm)[0].numpy()
flat = x.clone()
dist.all_reduce(flat)
expected = np.sum([np.arange(1000, dtype=np.float32) * (r + 1) for r in range(world)], axis=0)
result = {
    "rank": rank, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]),
    "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]), "node": int(os.environ["BAGUA_X_CLUSTER_NODE"]),
    "hostname": socket.gethostname(), "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    "hierarchical_ok": bool(np.allclose(hier, expected, rtol=1e-6)), "flat_ok": bool(np.allclose(flat.numpy(), expected, rtol=1e-6)),
}
dist.barrier()
dist.destroy_process_group()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
