"""Training script run under ``python -m torch.distributed.run`` by test_torch_elastic.py.

Usage: ``bx_elastic_train.py WORKDIR TOTAL_STEPS EVERY KILL_AT``.  Rank 0
checkpoints every EVERY steps to WORKDIR/checkpoint.pt (atomically); every
(re)start resumes from it.  On the first attempt only
(TORCHELASTIC_RESTART_COUNT == 0), rank 1 dies abruptly before step KILL_AT
(-1: never): rank 0 must raise within wrap's timeout (not hang), so the
elastic agent restarts both ranks.  Rank 0 writes the final parameters to
WORKDIR/final.pt and appends ``attempt start_step`` lines to WORKDIR/attempts.
"""

import logging
import os
import sys

import torch
import torch.nn.functional as F

import bagua_x.torch as bxt


def main(workdir: str, total: int, every: int, kill_at: int) -> None:
    logging.basicConfig(level=logging.WARNING)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    wrapped = bxt.wrap(model, opt, timeout=10)
    rank = torch.distributed.get_rank()
    checkpoint = os.path.join(workdir, "checkpoint.pt")
    start = 0
    if os.path.exists(checkpoint):  # gradient allreduce keeps ranks identical: rank 0's checkpoint serves all
        saved = torch.load(checkpoint)
        wrapped.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        wrapped.load_algorithm_state_dict(saved["algorithm"])
        start = saved["step"]
    if rank == 0:
        with open(os.path.join(workdir, "attempts"), "a") as f:
            f.write(f"{attempt} {start}\n")
    for step in range(start, total):
        if attempt == 0 and rank == 1 and step == kill_at:
            os._exit(1)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        opt.zero_grad()
        F.mse_loss(wrapped(x), y).backward()
        opt.step()
        if rank == 0 and (step + 1) % every == 0:
            tmp = checkpoint + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "algorithm": wrapped.algorithm_state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, checkpoint)
    if rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], os.path.join(workdir, "final.pt"))
    wrapped.shutdown()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
