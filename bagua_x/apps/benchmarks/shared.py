"""What the torch and JAX benchmarks share, without importing either framework: the zoo's sizes and the algorithms.

One place for both, so the JAX zoo (``jax_zoo.py``) builds the same models as
the torch zoo (``torch_zoo.py``) and both time the same algorithm settings.
"""

from __future__ import annotations

MODELS = ("mlp", "transformer", "resnet")
JAX_MODELS = MODELS  # the ResNet's batch statistics: state beside the params (jax_zoo.build)

MLP_WIDTH, MLP_LAYERS, MLP_CLASSES, MLP_BATCH = 1024, 12, 10, 64
VOCAB, WIDTH, HEADS, LAYERS, SEQ, TRANSFORMER_BATCH = 8192, 256, 4, 12, 32, 4

ALGORITHMS = ("allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "model_average", "qadam",
              "diloco", "streaming_diloco", "sparseloco")


def make_algorithm(name: str):
    """A fresh algorithm of the benchmarks' ``name`` (QAdam: a 2-step warmup, so the timed steps run compressed)."""
    from bagua_x import algorithms as A

    return {
        "allreduce": A.GradientAllReduce, "bytegrad": A.ByteGrad, "decentralized": A.Decentralized,
        "low_precision_decentralized": A.LowPrecisionDecentralized, "model_average": A.ModelAverage,
        "qadam": lambda: A.QAdam(lr=1e-4, warmup_steps=2),
        # H = 5 divides torch_vs_ddp's rounds (5 or 10 steps after as many warm-up ones), so each round holds
        # whole outer cycles: 1 exchange of the model (DiLoCo), or of a 4-bit fifth every step (streaming)
        "diloco": lambda: A.DiLoCo(sync_every=5, hierarchical=False),
        "streaming_diloco": lambda: A.DiLoCo(sync_every=5, fragments=5, bits=4, hierarchical=False),
        "sparseloco": lambda: A.SparseLoCo(sync_every=5, hierarchical=False),  # TopK 2 % at 2 bits
    }[name]()
