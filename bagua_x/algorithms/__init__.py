"""Communication algorithms, each written once on the Array API and the Communicator protocol."""

from .allreduce import GradientAllReduce
from .base import Algorithm, EmptyState, Phase, Target
from .bytegrad import ByteGrad
from .diloco import DiLoCo, DiLoCoState, SparseLoCo
from .decentralized import Decentralized, DecentralizedState
from .low_precision_decentralized import LowPrecisionDecentralized, LowPrecisionDecentralizedState
from .model_average import AsyncModelAverage, ModelAverage, ModelAverageState
from .powersgd import PowerSGD, PowerSGDState
from .qadam import QAdam, QAdamState
from .sparse import TopK

__all__ = [
    "Algorithm", "Target", "Phase", "EmptyState", "GradientAllReduce", "ByteGrad", "Decentralized",
    "DecentralizedState", "LowPrecisionDecentralized", "LowPrecisionDecentralizedState", "ModelAverage",
    "ModelAverageState", "AsyncModelAverage", "QAdam", "QAdamState", "PowerSGD", "PowerSGDState", "DiLoCo", "DiLoCoState",
    "TopK", "SparseLoCo",
]
