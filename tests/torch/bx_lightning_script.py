"""Lightning runs for tests/torch/test_torch_lightning.py, launched by Lightning itself.

``python bx_lightning_script.py SCENARIO OUT_DIR [NODES]``: each node's local rank 0
(``NODE_RANK``) starts its local rank 1 by re-running this command (Lightning's
subprocess launcher); each rank pickles its results to ``OUT_DIR/rank{r}.pkl``.
bagua_x's collectives are counted per communicator (``TorchCommunicator._wait``,
which every collective of an algorithm goes through).
"""

import collections
import glob
import logging
import os
import pickle
import sys

import torch
from torch import nn

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from bagua_x import algorithms
from bagua_x.apps.data import load_digits_split
from bagua_x.torch import QAdamOptimizer, TorchCommunicator
from bagua_x.torch.integrations.lightning import BaguaXStrategy, rank_file

CALLS = collections.Counter()  # collectives run, per communicator (id)
_wait = TorchCommunicator._wait


def _counting_wait(comm, work, x):
    CALLS[id(comm)] += 1
    return _wait(comm, work, x)


TorchCommunicator._wait = _counting_wait

logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


class Digits(L.LightningModule):
    """A small MLP on scikit-learn's digits; SGD with momentum (stateful, so resuming must restore it)."""

    def __init__(self, qadam: bool = False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.qadam = qadam
        self.losses = []
        self.calls = []  # bagua_x's collectives so far, after each micro-batch
        self.trained_by = None
        self.comm = None

    def on_train_start(self):
        model = self.trainer.strategy.model  # what the strategy trains: bagua_x's wrapper, or DDP
        self.trained_by = type(getattr(model, "algorithm", model)).__name__
        self.comm = getattr(model, "comm", None)
        CALLS.clear()  # count this fit's collectives only

    def on_train_batch_end(self, *_):
        self.calls.append(sum(CALLS.values()))

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.qadam:
            return QAdamOptimizer(self.parameters(), lr=0.01, warmup_steps=10)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader():
    x, y, _, _ = load_digits_split()
    data = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)  # Lightning adds a DistributedSampler


def held_out_accuracy(module):
    _, _, x, y = load_digits_split()
    with torch.no_grad():
        return float((module.net(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def fit(strategy, epochs, qadam=False, callbacks=(), ckpt_path=None, nodes=1, **trainer_kwargs):
    L.seed_everything(0, verbose=False)
    module = Digits(qadam)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=nodes, max_epochs=epochs,
                        logger=False, enable_checkpointing=bool(callbacks), callbacks=list(callbacks),
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        **trainer_kwargs)
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    out = {"params": [p.detach().numpy().copy() for p in module.parameters()], "losses": module.losses,
           "accuracy": held_out_accuracy(module), "steps": trainer.global_step, "trained_by": module.trained_by,
           "calls": module.calls}
    comm = module.comm
    if comm is not None and comm.features:  # node groups: which collectives ran on them
        out["nodes"] = {"within": (comm.within.size, CALLS[id(comm.within)]),
                        "across": (comm.across.size, CALLS[id(comm.across)]), "flat": CALLS[id(comm)]}
    return out


ALGORITHMS = {
    "ByteGrad": lambda: algorithms.ByteGrad(),
    "Decentralized": lambda: algorithms.Decentralized(),
    "LowPrecisionDecentralized": lambda: algorithms.LowPrecisionDecentralized(),
    "ModelAverage": lambda: algorithms.ModelAverage(period=4),
    "AsyncModelAverage": lambda: algorithms.AsyncModelAverage(sync_interval_ms=20),
    "DiLoCo": lambda: algorithms.DiLoCo(sync_every=4, outer_lr=0.7),  # the inner optimizer is the module's SGD
    "DiLoCo-sparse": lambda: algorithms.SparseLoCo(sync_every=4, fraction=0.1, chunk=64),
    "local": lambda: algorithms.ModelAverage(period=10**6),  # no averaging after the start: the baseline
}
# AsyncModelAverage is left out of the accumulation counts: its thread averages on a clock, not per step; DiLoCo
# communicates on one step in sync_every (its counts are ModelAverage's, whose run stays)
ACCUMULATED = {"GradientAllReduce": lambda: algorithms.GradientAllReduce(),
               **{k: v for k, v in ALGORITHMS.items() if k not in ("local", "AsyncModelAverage", "DiLoCo",
                                                                     "DiLoCo-sparse")}}


def main(scenario, out_dir, nodes=1):
    results = {}
    if scenario == "ddp_vs_allreduce":
        results["ddp"] = fit("ddp", 2)
        results["bagua_x"] = fit(BaguaXStrategy(algorithm=algorithms.GradientAllReduce()), 2)
    elif scenario == "algorithms":
        for name, make in ALGORITHMS.items():
            results[name] = fit(BaguaXStrategy(algorithm=make()), 2)
        results["QAdam"] = fit(BaguaXStrategy(), 2, qadam=True)  # QAdam taken from the QAdamOptimizer
    elif scenario == "accumulate":  # 12 optimizer steps (QAdam: 10 of warmup, 2 of momentum), 2 micro-batches each
        results["ddp"] = fit("ddp", 3, max_steps=12, accumulate_grad_batches=2)
        for name, make in [*ACCUMULATED.items(), ("QAdam", None)]:
            strategy = (lambda: BaguaXStrategy(algorithm=make())) if make else BaguaXStrategy
            results[name] = {k: fit(strategy(), 3, qadam=make is None, max_steps=12, accumulate_grad_batches=k)
                             for k in (1, 2)}
    elif scenario == "nodes":  # 2 nodes of 2 ranks
        results["ddp"] = fit("ddp", 1, nodes=nodes, max_steps=10)
        results["allreduce"] = fit(BaguaXStrategy(algorithm=algorithms.GradientAllReduce(hierarchical=True)), 1,
                                   nodes=nodes, max_steps=10)
        results["bytegrad"] = fit(BaguaXStrategy(algorithm=algorithms.ByteGrad(hierarchical=True)), 1, nodes=nodes,
                                  max_steps=10)  # forced: the default times both forms and may keep flat
    elif scenario.startswith("resume:"):
        make = ALGORITHMS[scenario.split(":")[1]]
        every_epoch = ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpt"), save_top_k=-1, every_n_epochs=1)
        results["uninterrupted"] = fit(BaguaXStrategy(algorithm=make()), 2, callbacks=[every_epoch])
        first = glob.glob(os.path.join(out_dir, "ckpt", "epoch=0-*.ckpt"))[0]
        saved = torch.load(first, weights_only=True)
        rank_files = sorted(glob.glob(glob.escape(first) + ".*"))
        results["saved"] = {"main": saved["bagua_x"], "rank_files": [os.path.basename(f) for f in rank_files],
                            "algorithm_state": [sorted(next(iter(torch.load(f, weights_only=True)[
                                "algorithm_state"].values()))) for f in rank_files]}
        assert rank_files[torch.distributed.get_rank()] == rank_file(first, torch.distributed.get_rank())
        results["resumed"] = fit(BaguaXStrategy(algorithm=make()), 2, callbacks=[ModelCheckpoint(
            dirpath=os.path.join(out_dir, "ckpt2"))], ckpt_path=first)
    rank = torch.distributed.get_rank()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    torch.distributed.barrier()  # rank 0 hosts the store: leave together


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))
    # a normal interpreter exit: bagua_x's stall responder must not abort it (rank 0's store goes first)
