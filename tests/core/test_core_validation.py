import numpy as np
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


def test_describe_exact_entries():
    d = describe([("w", [2, np.int64(3)], np.dtype("float32")), ("b", (), "float64")],
                 {"betas": [0.9, (0.99,)], "opts": {"b": 1, "a": [2]}, "obj": object, "none": None, "flag": True})
    assert d == [
        ("tensor #0", ("w", (2, 3), "float32")),
        ("tensor #1", ("b", (), "float64")),
        ("number of tensors", 2),
        ("setting 'betas'", (0.9, (0.99,))),
        ("setting 'opts'", (("a", (2,)), ("b", 1))),
        ("setting 'obj'", repr(object)),
        ("setting 'none'", None),
        ("setting 'flag'", True),
    ]


def test_first_mismatch_exact_message_and_missing_entries():
    d0 = describe([("a", (4,), "float32")], {"k": 1})
    d1 = describe([("a", (4,), "float32")], {"k": 2})
    assert first_mismatch([d0, d1]) == "ranks disagree on setting 'k':\n  rank 0: setting 'k' = 1\n  rank 1: setting 'k' = 2"
    short = d0[:1]
    assert first_mismatch([short, d0]) == (
        "ranks disagree on number of tensors:\n  rank 0: (missing) = None\n  rank 1: number of tensors = 1")
    assert first_mismatch([d0, short]) == (
        "ranks disagree on number of tensors:\n  rank 0: number of tensors = 1\n  rank 1: (missing) = None")
    assert first_mismatch([d0, list(d0), list(d0)]) is None
    odd = [("tensor #0", ("a", (4,)))]  # not a (name, shape, dtype) triple: shown plainly
    assert first_mismatch([odd, d0]).endswith("rank 0: tensor #0 = ('a', (4,))\n  rank 1: 'a' shape (4,) dtype float32")
    other = [("setting 'x'", ("n", (1,), "f"))]  # a triple that is not a tensor entry
    assert "rank 0: setting 'x' = ('n', (1,), 'f')" in first_mismatch([other, d0])


def test_check_same_everywhere_exact_message():
    d0, d1 = describe([], {"k": 1}), describe([], {"k": 2})
    with pytest.raises(BaguaXError) as e:
        check_same_everywhere([d0, d1], "wrap")
    assert str(e.value) == (
        "wrap: ranks disagree on setting 'k':\n  rank 0: setting 'k' = 1\n  rank 1: setting 'k' = 2\n"
        "Every rank must build the same model with the same settings; fix the rank that differs "
        "(same code, same config, same seed-independent architecture)")
