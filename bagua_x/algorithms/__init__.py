"""Communication algorithms, each written once on the Array API and the Communicator protocol."""

from .allreduce import GradientAllReduce
from .base import Algorithm, Phase, Target
from .bytegrad import ByteGrad
from .decentralized import Decentralized
from .low_precision_decentralized import LowPrecisionDecentralized
from .model_average import AsyncModelAverage, ModelAverage
from .powersgd import PowerSGD
from .qadam import QAdam

__all__ = [
    "Algorithm", "Target", "Phase", "GradientAllReduce", "ByteGrad", "Decentralized",
    "LowPrecisionDecentralized", "ModelAverage", "AsyncModelAverage", "QAdam", "PowerSGD",
]
