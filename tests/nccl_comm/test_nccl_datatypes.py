"""bagua_x.nccl.datatypes: the dtype/op tables (against the installed nccl4py when there is one) and
the reduction plan, without a GPU."""

from __future__ import annotations

import pytest

from bagua_x.core import BaguaXError, ReduceOp
from bagua_x.nccl import UNIQUE_ID_BYTES
from bagua_x.nccl import datatypes as N


# NCCL's ncclDataType_t / ncclRedOp_t values, as nccl4py 0.6.0 exposes them in
# nccl.core.NcclDataType / NcclRedOp (read from the installed package).
NCCL_DTYPE_CODES = {"INT8": 0, "UINT8": 1, "INT32": 2, "UINT32": 3, "INT64": 4, "UINT64": 5,
                    "FLOAT16": 6, "FLOAT32": 7, "FLOAT64": 8, "BFLOAT16": 9}
NCCL_OP_CODES = {"SUM": 0, "PROD": 1, "MAX": 2, "MIN": 3, "AVG": 4}


def test_reduce_dtype_table_maps_every_nccl_type():
    assert set(N.NCCL_REDUCE_DTYPES.values()) == set(NCCL_DTYPE_CODES)
    for dtype, nccl_name in N.NCCL_REDUCE_DTYPES.items():
        assert nccl_name == dtype.upper()  # int8 -> INT8, bfloat16 -> BFLOAT16, ...
    assert N.COMPLEX_AS_REAL == {"complex64": "float32", "complex128": "float64"}


def test_reduce_op_table_covers_every_reduce_op():
    assert set(N.NCCL_REDUCE_OPS) == set(ReduceOp)
    assert all(name in NCCL_OP_CODES for name in N.NCCL_REDUCE_OPS.values())
    assert N.NCCL_REDUCE_OPS[ReduceOp.AVG] == "AVG"


def test_tables_match_installed_nccl4py():
    nc = pytest.importorskip("nccl.core", reason="nccl4py is not installed")
    pytest.importorskip("nccl.bindings.nccl")
    for nccl_name, code in NCCL_DTYPE_CODES.items():
        assert int(nc.NcclDataType[nccl_name]) == code
    for nccl_name in N.NCCL_REDUCE_OPS.values():
        assert int(nc.NcclRedOp[nccl_name]) == NCCL_OP_CODES[nccl_name]
    assert len(bytes(nc.get_unique_id(empty=True))) == UNIQUE_ID_BYTES


def test_reduce_plan_maps_dtypes_and_ops():
    assert N.reduce_plan("float32", 6, ReduceOp.SUM, True) == ("FLOAT32", 6, "SUM", None)
    assert N.reduce_plan("bfloat16", 6, ReduceOp.MAX, False) == ("BFLOAT16", 6, "MAX", None)
    assert N.reduce_plan("complex64", 3, ReduceOp.SUM, True) == ("FLOAT32", 6, "SUM", None)  # pairs of reals
    assert N.reduce_plan("bool", 4, ReduceOp.MIN, True) == ("UINT8", 4, "MIN", None)


def test_reduce_plan_average():
    assert N.reduce_plan("float16", 5, ReduceOp.AVG, True) == ("FLOAT16", 5, "AVG", None)  # ncclAvg
    assert N.reduce_plan("float32", 5, ReduceOp.AVG, False) == ("FLOAT32", 5, "SUM", "div")  # NCCL < 2.10
    assert N.reduce_plan("int64", 5, ReduceOp.AVG, True) == ("INT64", 5, "SUM", "floordiv")
    assert N.reduce_plan("complex128", 2, ReduceOp.AVG, True) == ("FLOAT64", 4, "AVG", None)


def test_reduce_plan_refusals():
    with pytest.raises(BaguaXError, match="MAX is undefined for complex"):
        N.reduce_plan("complex64", 1, ReduceOp.MAX, True)
    with pytest.raises(BaguaXError, match="booleans is ambiguous"):
        N.reduce_plan("bool", 1, ReduceOp.SUM, True)
    with pytest.raises(BaguaXError, match="NCCL cannot reduce int16"):
        N.reduce_plan("int16", 1, ReduceOp.SUM, True, "reduce_scatter")
    with pytest.raises(BaguaXError, match="unsupported reduce op"):
        N.reduce_plan("float32", 1, "sum", True)
