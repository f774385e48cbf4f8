"""One rank of tests/test_cluster.py's slow-link run (2 nodes x 1 rank): round trip and bulk time over the link.

Usage: link_timing.py OUT.  Rank 0 writes OUT/link.json: the shortest of 5 round trips of a 4-byte message, and
the time for 1.25 MB (10 Mbit) to reach rank 1 and a 4-byte reply to come back.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def round_trip(rank, payload):
    start = time.monotonic()
    if rank == 0:
        dist.send(payload, 1)
        dist.recv(torch.zeros(1), 1)
    else:
        dist.recv(payload, 0)
        dist.send(torch.zeros(1), 0)
    return time.monotonic() - start


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    small = min(round_trip(rank, torch.zeros(1)) for _ in range(5))
    round_trip(rank, torch.zeros(1000))  # the connection's window grows a little first, as any transfer's would
    bulk = round_trip(rank, torch.zeros(1_250_000 // 4))
    if rank == 0:
        with open(os.path.join(sys.argv[1], "link.json"), "w") as f:
            json.dump({"round_trip_s": small, "bulk_s": bulk}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
