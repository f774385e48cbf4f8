"""Lightning runs for tests/torch/test_torch_lightning.py, launched by Lightning itself.

``python bx_lightning_script.py SCENARIO OUT_DIR``: rank 0's Trainer starts rank 1 by
re-running this command (Lightning's subprocess launcher); each rank pickles its
results to ``OUT_DIR/rank{r}.pkl``.
"""

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
from bagua_x.torch import QAdamOptimizer
from bagua_x.torch.lightning import BaguaXStrategy

logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


class Digits(L.LightningModule):
    """A small MLP on scikit-learn's digits; SGD with momentum (stateful, so resuming must restore it)."""

    def __init__(self, qadam: bool = False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.qadam = qadam
        self.losses = []
        self.trained_by = None

    def on_train_start(self):
        model = self.trainer.strategy.model  # what the strategy trains: bagua_x's wrapper, or DDP
        self.trained_by = type(getattr(model, "algorithm", model)).__name__

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


def fit(strategy, epochs, qadam=False, callbacks=(), ckpt_path=None):
    L.seed_everything(0, verbose=False)
    module = Digits(qadam)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=epochs, logger=False,
                        enable_checkpointing=bool(callbacks), callbacks=list(callbacks), enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return {"params": [p.detach().numpy().copy() for p in module.parameters()], "losses": module.losses,
            "accuracy": held_out_accuracy(module), "steps": trainer.global_step, "trained_by": module.trained_by}


ALGORITHMS = {
    "ByteGrad": lambda: algorithms.ByteGrad(),
    "Decentralized": lambda: algorithms.Decentralized(),
    "LowPrecisionDecentralized": lambda: algorithms.LowPrecisionDecentralized(),
    "ModelAverage": lambda: algorithms.ModelAverage(period=4),
    "AsyncModelAverage": lambda: algorithms.AsyncModelAverage(sync_interval_ms=20),
    "local": lambda: algorithms.ModelAverage(period=10**6),  # no averaging after the start: the baseline
}


def main(scenario, out_dir):
    results = {}
    if scenario == "ddp_vs_allreduce":
        results["ddp"] = fit("ddp", 2)
        results["bagua_x"] = fit(BaguaXStrategy(algorithm=algorithms.GradientAllReduce()), 2)
    elif scenario == "algorithms":
        for name, make in ALGORITHMS.items():
            results[name] = fit(BaguaXStrategy(algorithm=make()), 2)
        results["QAdam"] = fit(BaguaXStrategy(), 2, qadam=True)  # QAdam taken from the QAdamOptimizer
    elif scenario.startswith("resume:"):
        make = ALGORITHMS[scenario.split(":")[1]]
        every_epoch = ModelCheckpoint(dirpath=os.path.join(out_dir, "ckpt"), save_top_k=-1, every_n_epochs=1)
        results["uninterrupted"] = fit(BaguaXStrategy(algorithm=make()), 2, callbacks=[every_epoch])
        first = glob.glob(os.path.join(out_dir, "ckpt", "epoch=0-*.ckpt"))[0]
        saved = torch.load(first, weights_only=False)
        results["saved"] = {"ranks": len(saved["bagua_x"]["ranks"]),
                            "algorithm_state": [sorted(next(iter(r["algorithm_state"].values())))
                                                for r in saved["bagua_x"]["ranks"]]}
        results["resumed"] = fit(BaguaXStrategy(algorithm=make()), 2, callbacks=[ModelCheckpoint(
            dirpath=os.path.join(out_dir, "ckpt2"))], ckpt_path=first)
    rank = torch.distributed.get_rank()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    torch.distributed.barrier()  # rank 0 hosts the store: leave together


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # a normal interpreter exit: bagua_x's stall responder must not abort it (rank 0's store goes first)
