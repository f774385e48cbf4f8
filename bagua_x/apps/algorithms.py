"""The algorithms the demo and benchmarks run, by short name, with settings suited to a small model."""

from __future__ import annotations

from ..algorithms import (
    ByteGrad, Decentralized, DiLoCo, GradientAllReduce, LowPrecisionDecentralized, ModelAverage, QAdam, SparseLoCo,
)

NAMES = ["allreduce", "bytegrad", "decentralized", "lowprec", "qadam", "model_average", "diloco", "streaming",
         "sparseloco"]
# what `bagua-x demo` runs unless told: the baseline and one algorithm for each kind of link, as slow as it gets
# (ModelAverage, the decentralized ones and QAdam serve other needs; --algorithms runs them)
DEMO = ["allreduce", "bytegrad", "diloco", "sparseloco"]


def make(name: str, steps: int):
    """A fresh algorithm instance for the demo's ``name``."""
    factories = {
        "allreduce": lambda: GradientAllReduce(),
        "bytegrad": lambda: ByteGrad(),
        "decentralized": lambda: Decentralized(peer_selection_mode="all"),
        "lowprec": lambda: LowPrecisionDecentralized(),
        # a short warmup freezes v too early; eps: where v froze near 0 (dead ReLUs), the 8-bit momentum's rounding
        # error divided by sqrt(v) + eps would blow the weights up
        "qadam": lambda: QAdam(lr=3e-3, warmup_steps=max(steps // 5, 50), eps=1e-4),
        "model_average": lambda: ModelAverage(period=4),
        # H = 8: the demo's few hundred steps see dozens of outer steps; flat (every rank a worker), the form the
        # demo's step functions run in both frontends; streaming's exchange overlaps the next step (tau = 1)
        "diloco": lambda: DiLoCo(sync_every=8, hierarchical=False),
        "streaming": lambda: DiLoCo(sync_every=8, fragments=4, fragment_sync_delay=1, bits=4, hierarchical=False),
        # the paper's exchange (top 2 % of each 4096-element chunk, 2 bits, error feedback) at the demo's H
        "sparseloco": lambda: SparseLoCo(sync_every=8, hierarchical=False),
    }
    if name not in factories:
        raise SystemExit(f"unknown algorithm {name!r}; choose from {', '.join(NAMES)}")
    return factories[name]()
