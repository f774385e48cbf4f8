"""Checkpoint and resume workers (import name ``bx_checkpoint_workers``).

``uninterrupted_and_first_part`` trains ``total`` steps without stopping, then
(in the same processes, a second wrap) trains the first ``k`` steps again and
saves every rank's checkpoint; it also rolls the live wrapper back to it and
trains on.  ``resume`` starts fresh processes from the checkpoints.  The test
compares the final parameters bitwise.
"""

from __future__ import annotations

import os


def _init():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _batch(rank, step):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)  # per rank and step: a resumed run sees the same data
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _build(name, kwargs, seed, model_name):
    import torch

    from bagua_x import algorithms
    import bagua_x.torch as bxt
    from bx_bucket_order_workers import out_of_order_model

    torch.manual_seed(seed)
    if model_name == "out_of_order":  # buckets rebuilt after the first step: the checkpoint keeps their order
        model = out_of_order_model(torch.distributed.get_rank())
    else:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if name == "QAdam":
        opt = bxt.QAdamOptimizer(model.parameters(), lr=1e-2, **kwargs)
        wrapped = bxt.wrap(model, opt, bucket_cap_mb=1e-3)  # several buckets
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        wrapped = bxt.wrap(model, opt, algorithm=getattr(algorithms, name)(**kwargs), bucket_cap_mb=1e-3)
    return model, opt, wrapped


def _train(wrapped, opt, rank, steps):
    import torch.nn.functional as F

    for s in steps:
        x, y = _batch(rank, s)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(wrapped(x), y).backward()
        opt.step()


def _params(model):
    return [p.detach().clone().numpy() for p in model.parameters()]


def uninterrupted_and_first_part(name, kwargs, total, k, directory, model_name="mlp"):
    import torch

    rank, _ = _init()
    model, opt, wrapped = _build(name, kwargs, seed=rank, model_name=model_name)
    _train(wrapped, opt, rank, range(total))
    wrapped.shutdown()
    final = _params(model)

    model, opt, wrapped = _build(name, kwargs, seed=rank, model_name=model_name)
    _train(wrapped, opt, rank, range(k))
    path = os.path.join(directory, f"rank{rank}.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "algorithm": wrapped.algorithm_state_dict()}, path)
    # roll back in place: train on, then load the checkpoint into the live wrapper (e.g. QAdam's momentum,
    # already in the bucket buffers, is replaced by new tensors that must be re-swapped in)
    _train(wrapped, opt, rank, range(k, k + 2))
    _load(wrapped, opt, path)
    _train(wrapped, opt, rank, range(k, total))
    wrapped.shutdown()
    return final, _params(model)


def _load(wrapped, opt, path):
    import torch

    saved = torch.load(path)
    # after wrap(): wrap copies rank 0's weights to every rank, but decentralized ranks' weights differ
    wrapped.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    wrapped.load_algorithm_state_dict(saved["algorithm"])


def resume(name, kwargs, total, k, directory, model_name="mlp"):
    rank, _ = _init()
    # other initial weights: loading must win
    model, opt, wrapped = _build(name, kwargs, seed=100 + rank, model_name=model_name)
    _load(wrapped, opt, os.path.join(directory, f"rank{rank}.pt"))
    _train(wrapped, opt, rank, range(k, total))
    wrapped.shutdown()
    return _params(model)
