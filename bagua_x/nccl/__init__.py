"""bagua_x.nccl: the Communicator protocol on NCCL through nccl4py -- **experimental**.

No frontend uses it yet; tested on CPU for everything except the collectives
themselves (those run only in the ``gpu``-marked tests).  Install the binding
with ``pip install 'bagua-x[nccl]'``.  Like :mod:`bagua_x.core`, importing this
package imports neither torch nor JAX, nor nccl4py (imported when a
communicator is created).

* :mod:`~bagua_x.nccl.communicator`: :class:`NcclCommunicator`, eager
  collectives on any CUDA DLPack buffer (torch tensors, JAX arrays).
* :mod:`~bagua_x.nccl.rendezvous`: the NCCL unique-id exchange over the job's
  key-value store (``torch.distributed.TCPStore``, JAX's distributed client).
* :mod:`~bagua_x.nccl.streams`: CUDA stream handles and the DLPack stream value.
* :mod:`~bagua_x.nccl.datatypes`: bagua_x dtypes and reduce ops -> NCCL's.
"""

from .communicator import INSTALL_HINT, UNIQUE_ID_BYTES, NcclCommunicator
from .datatypes import COMPLEX_AS_REAL, NCCL_REDUCE_DTYPES, NCCL_REDUCE_OPS, ReducePlan, reduce_plan
from .rendezvous import JaxKeyValueStore, exchange_unique_id, jax_kv_store
from .streams import dlpack_stream, stream_handle

__all__ = [
    "NcclCommunicator", "UNIQUE_ID_BYTES", "INSTALL_HINT",
    "exchange_unique_id", "jax_kv_store", "JaxKeyValueStore",
    "stream_handle", "dlpack_stream",
    "NCCL_REDUCE_DTYPES", "COMPLEX_AS_REAL", "NCCL_REDUCE_OPS", "ReducePlan", "reduce_plan",
]
