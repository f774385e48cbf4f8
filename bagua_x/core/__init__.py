"""bagua_x core: registration, buckets, DLPack buffers, the Communicator protocol.

Imports neither torch nor jax: it works on any array with ``__dlpack__`` and on
the Array API (``array_api_compat``).
"""

from .bucket import Bucket, BucketLayout, Slot, plan_buckets
from .comm import Communicator, Feature, ReduceOp
from .dlpack import BufferInfo, buffer_info, check_writable, data_pointer, is_jax_owned
from .errors import BaguaXError
from .readiness import BucketDispatcher
from .tensor import RegisteredTensor, TensorRegistry
from .validation import check_same_everywhere, describe, first_mismatch

__all__ = [
    "BaguaXError", "BufferInfo", "buffer_info", "check_writable", "data_pointer", "is_jax_owned",
    "RegisteredTensor", "TensorRegistry", "Bucket", "BucketLayout", "Slot", "plan_buckets",
    "BucketDispatcher", "Communicator", "Feature", "ReduceOp", "describe", "first_mismatch", "check_same_everywhere",
]
