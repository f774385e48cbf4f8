"""Run under torchrun: two steps through wrap(), then rank 0 (the store's host) exits first.

Every rank must exit with status 0: the stall responder thread must not be left blocked in C++
while Python finalises (that aborts with "terminate called without an active exception").
"""

import time

import torch
import torch.distributed as dist

import bagua_x.torch as bxt

dist.init_process_group("gloo")
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
wrapped = bxt.wrap(model, opt)
for _ in range(2):
    opt.zero_grad()
    wrapped(torch.randn(3, 4)).sum().backward()
    opt.step()
dist.barrier()
if dist.get_rank() != 0:
    time.sleep(2)  # rank 0 and its store are gone by now
print(f"rank {dist.get_rank()} done", flush=True)
