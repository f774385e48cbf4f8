"""core/wire.py: plain JSON between ranks; pickles, oversize and non-plain data refused."""

import json
import math
import pickle

import pytest

from bagua_x.core import BaguaXError
from bagua_x.core import wire


@pytest.mark.parametrize("value", [
    None, True, False, 0, -7, 2**70, 1.5, "", "naïve ✓", [], (), [1, "a", None, [2.5, [True]]],
    ("tensor #0", ("w", (3, 4), "float32")),
])
def test_round_trip(value):
    def tuples(v):  # lists come back as tuples
        return tuple(tuples(e) for e in v) if isinstance(v, (list, tuple)) else v
    data = wire.encode(value)
    assert isinstance(data, bytes)
    back = wire.decode(data, "test")
    assert back == tuples(value) and type(back) is type(tuples(value))


def test_non_finite_floats_round_trip():
    back = wire.decode(wire.encode([math.inf, -math.inf, math.nan]), "test")
    assert back[0] == math.inf and back[1] == -math.inf and math.isnan(back[2])


def test_encoding_is_compact_json():
    assert wire.encode((1, [2, "x"])) == b'[1,[2,"x"]]'
    assert wire.decode(bytearray(b"[1]"), "test") == (1,)


class Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # unpickling this would create the file
        return (open, (self.path, "w"))


def test_a_crafted_pickle_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(Marker(str(marker)))
    with pytest.raises(BaguaXError, match=r"store key k: received data that is not bagua_x's JSON.*first bytes"):
        wire.decode(payload, "store key k")
    assert not marker.exists()
    pickle.loads(payload)  # the same bytes do run code when unpickled: the test would notice
    assert marker.exists()


def test_oversize_is_refused_unread(monkeypatch):
    monkeypatch.setattr(wire, "MAX_BYTES", 10)
    with pytest.raises(BaguaXError, match=r"src: 11 bytes is more than the 10"):
        wire.decode(b"[" + b"1," * 4 + b"1]", "src")
    assert wire.decode(b"[1,2,3,4]", "src") == (1, 2, 3, 4)  # 9 bytes: fine
    assert wire.decode(b"[1,2,3,45]", "src") == (1, 2, 3, 45)  # exactly 10: fine


def test_max_bytes_default():
    assert wire.MAX_BYTES == 64 * 2**20


@pytest.mark.parametrize("data", ["[1]", [1], None, memoryview(b"[1]")])
def test_non_bytes_is_refused(data):
    with pytest.raises(BaguaXError, match=rf"src: expected bytes, got {type(data).__name__}"):
        wire.decode(data, "src")


@pytest.mark.parametrize("data", [b"\xff\xfe", b"{not json", b"[1,", b""])
def test_garbage_is_refused(data):
    with pytest.raises(BaguaXError, match="src: received data that is not bagua_x's JSON"):
        wire.decode(data, "src")


def test_objects_are_refused_on_arrival():
    with pytest.raises(BaguaXError, match="received a JSON object"):
        wire.decode(b'[1, {"a": 1}]', "src")


def test_deep_nesting_is_refused_on_arrival():
    with pytest.raises(BaguaXError, match="src: received data that is not bagua_x's JSON.*RecursionError"):
        wire.decode(b"[" * 100_000 + b"]" * 100_000, "src")


@pytest.mark.parametrize("value, where", [
    ({"a": 1}, "value is a dict"), ([1, {2}], r"value\[1\] is a set"), (b"x", "value is a bytes"),
    ([[object()]], r"value\[0\]\[0\] is a object"),
])
def test_encode_refuses_non_plain_values(value, where):
    with pytest.raises(BaguaXError, match=rf"bagua_x.core.wire: {where}; only plain values can be sent"):
        wire.encode(value)


def test_encode_refuses_deep_nesting():
    v = []
    for _ in range(33):
        v = [v]
    with pytest.raises(BaguaXError, match="nested more than 32 levels deep"):
        wire.encode(v)
    ok = []
    for _ in range(32):
        ok = [ok]
    assert json.loads(wire.encode(ok)) == ok


@pytest.mark.parametrize("levels", [34, 500, 990, 1000, 100_000])
def test_decode_refuses_deep_nesting_with_its_own_error(levels):
    # 500 levels used to escape as a bare RecursionError (from turning arrays into tuples)
    with pytest.raises(BaguaXError, match="src: received"):
        wire.decode(b"[" * levels + b"]" * levels, "src")


def test_decode_takes_the_deepest_value_encode_sends():
    ok = []
    for _ in range(32):
        ok = [ok]
    value = wire.decode(wire.encode(ok), "src")
    for _ in range(32):
        assert isinstance(value, tuple) and len(value) == 1
        value = value[0]
    assert value == ()


def test_decode_description():
    pairs = [("tensor #0", ("w", (3,), "float32")), ("number of tensors", 1)]
    assert wire.decode_description(wire.encode(pairs), "src") == pairs
    assert wire.decode_description(wire.encode([]), "src") == []
    for bad in ([1, 2], [("a", 1, 2)], [(1, 2)], "x", [["a"]]):
        with pytest.raises(BaguaXError, match="src: received .*not a list of \\(name, value\\) pairs"):
            wire.decode_description(wire.encode(bad), "src")
