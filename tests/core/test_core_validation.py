import pytest

from bagua_x.core import BaguaXError
from bagua_x.core.validation import check_same_everywhere, describe, first_mismatch


def test_identical_descriptions_pass():
    d = describe([("w", (2, 3), "float32")], {"algorithm": "ByteGrad", "average": True})
    check_same_everywhere([d, list(d)], "wrap")


def test_shape_difference_names_the_tensor_and_each_rank():
    d0 = describe([("a", (4,), "float32"), ("fc.w", (2, 3), "float32")], {})
    d1 = describe([("a", (4,), "float32"), ("fc.w", (3, 3), "float32")], {})
    msg = first_mismatch([d0, d1])
    assert "tensor #1" in msg and "rank 0: 'fc.w' shape (2, 3)" in msg and "rank 1: 'fc.w' shape (3, 3)" in msg
    with pytest.raises(BaguaXError, match="wrap: ranks disagree"):
        check_same_everywhere([d0, d1], "wrap")


def test_count_and_setting_differences():
    d0 = describe([("a", (4,), "float32")], {"bucket_cap_mb": 25.0})
    d1 = describe([("a", (4,), "float32"), ("b", (1,), "float32")], {"bucket_cap_mb": 25.0})
    assert "number of tensors" in first_mismatch([d0, d1])
    d2 = describe([("a", (4,), "float32")], {"bucket_cap_mb": 10.0})
    assert "setting 'bucket_cap_mb'" in first_mismatch([d0, d2])
