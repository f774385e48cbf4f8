"""How bagua_x dtypes and reduce ops map to NCCL's, as names (nccl4py is not imported here).

Reductions map the DLPack dtype (as :func:`bagua_x.core.dlpack.buffer_info`
spells it) to NCCL's (:data:`NCCL_REDUCE_DTYPES`); complex numbers are summed
as pairs of reals, booleans take MIN/MAX as bytes.  Data movement (allgather,
alltoall, broadcast, permute) is dtype-blind: it moves bytes
(:data:`BYTES_DTYPE`), so every dtype works.  ``AVG`` uses ``ncclAvg`` for
floating point when the loaded NCCL has it (>= 2.10), else ``SUM`` then a
division; integers are summed then floor-divided, as in the torch communicator.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from bagua_x.core.comm import ReduceOp
from bagua_x.core.errors import BaguaXError

__all__ = [
    "NCCL_REDUCE_DTYPES", "COMPLEX_AS_REAL", "NCCL_REDUCE_OPS", "BYTES_DTYPE", "NCCL_AVG_MIN_VERSION",
    "ReducePlan", "reduce_plan",
]

# DLPack dtype name -> nccl.core.NcclDataType member name.
NCCL_REDUCE_DTYPES = {
    "int8": "INT8", "uint8": "UINT8", "int32": "INT32", "uint32": "UINT32",
    "int64": "INT64", "uint64": "UINT64", "float16": "FLOAT16", "float32": "FLOAT32",
    "float64": "FLOAT64", "bfloat16": "BFLOAT16",
}
# Complex numbers are reduced (SUM/AVG) as twice as many reals of this dtype.
COMPLEX_AS_REAL = {"complex64": "float32", "complex128": "float64"}
# bagua_x ReduceOp -> nccl.core.NcclRedOp member name.
NCCL_REDUCE_OPS = {ReduceOp.SUM: "SUM", ReduceOp.AVG: "AVG", ReduceOp.MIN: "MIN", ReduceOp.MAX: "MAX"}
# Data movement goes as bytes.
BYTES_DTYPE = "UINT8"
NCCL_AVG_MIN_VERSION = 21000  # ncclAvg appeared in NCCL 2.10.0
_FLOATING = ("float16", "float32", "float64", "bfloat16")


class ReducePlan(NamedTuple):
    """One NCCL reduction: ``count`` elements of ``dtype`` reduced with ``op`` (NCCL names), then ``post``."""

    dtype: str  # a nccl.core.NcclDataType member name
    count: int
    op: str  # a nccl.core.NcclRedOp member name
    post: Optional[str]  # None, "div" (divide by the world size) or "floordiv"


def reduce_plan(dtype: str, count: int, op, has_avg: bool, what: str = "allreduce") -> ReducePlan:
    """How NCCL reduces ``count`` elements of DLPack ``dtype`` with ``op`` (``has_avg``: the NCCL has ncclAvg)."""
    if not isinstance(op, ReduceOp):
        raise BaguaXError(f"NcclCommunicator.{what}: unsupported reduce op {op!r}; use a bagua_x.core.ReduceOp")
    name = dtype
    if name in COMPLEX_AS_REAL:
        if op in (ReduceOp.MIN, ReduceOp.MAX):
            raise BaguaXError(f"NcclCommunicator.{what}: {op.name} is undefined for complex {name}")
        name, count = COMPLEX_AS_REAL[name], count * 2
    elif name == "bool":
        if op not in (ReduceOp.MIN, ReduceOp.MAX):
            raise BaguaXError(f"NcclCommunicator.{what}: {op.name} of booleans is ambiguous; use MIN or MAX")
        name = "uint8"
    if name not in NCCL_REDUCE_DTYPES:
        raise BaguaXError(
            f"NcclCommunicator.{what}: NCCL cannot reduce {dtype}; it reduces "
            f"{', '.join(NCCL_REDUCE_DTYPES)} (and complex64/128 for SUM/AVG)"
        )
    post, nccl_op = None, NCCL_REDUCE_OPS[op]
    if op is ReduceOp.AVG:
        floating = name in _FLOATING
        if not (floating and has_avg):
            nccl_op, post = "SUM", ("div" if floating else "floordiv")
    return ReducePlan(NCCL_REDUCE_DTYPES[name], count, nccl_op, post)
