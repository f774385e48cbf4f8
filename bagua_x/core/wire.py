"""Plain data between ranks: JSON, checked on arrival, never pickle.

Whatever reaches a rank through a socket (the torch.distributed store, a
gather across JAX processes) could have been written by anyone who can reach
that port.  Unpickling it would run their code on every rank, so bagua_x only
exchanges JSON of plain values (None, bool, int, float, str, and lists or
tuples of them; tuples come back as tuples) and refuses anything else with an
error that names where it came from.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import BaguaXError

__all__ = ["encode", "decode", "decode_description", "MAX_BYTES"]

MAX_BYTES = 64 * 2**20  # no legitimate description comes near this; a larger value is refused unread
MAX_DEPTH = 32  # arrays nested deeper are refused both ways, long before Python's recursion limit


def encode(value: Any) -> bytes:
    """``value`` as UTF-8 JSON; tuples and lists both become JSON arrays."""
    return json.dumps(_check(value, "value"), separators=(",", ":"), allow_nan=True).encode()


def decode(data: bytes, source: str) -> Any:
    """The plain value in ``data`` (arrays as tuples), or a BaguaXError naming ``source``."""
    if not isinstance(data, (bytes, bytearray)):
        raise BaguaXError(f"{source}: expected bytes, got {type(data).__name__}")
    if len(data) > MAX_BYTES:
        raise BaguaXError(f"{source}: {len(data)} bytes is more than the {MAX_BYTES} a bagua_x message may have")
    try:
        value = json.loads(bytes(data).decode("utf-8"), parse_constant=_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BaguaXError(
            f"{source}: received data that is not bagua_x's JSON ({type(e).__name__}: {e}; first bytes "
            f"{bytes(data[:32])!r}); something other than a bagua_x rank wrote to this job's store or "
            "collective, or the ranks run different bagua_x versions"
        ) from None
    return _tuples(value, source, 0)


def decode_description(data: bytes, source: str) -> list[tuple[str, Any]]:
    """A ``core.validation.describe`` list from ``data``: a list of ``(str, plain value)`` pairs."""
    value = decode(data, source)
    if not isinstance(value, tuple) or not all(
        isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str) for e in value
    ):
        raise BaguaXError(f"{source}: received {str(value)[:200]!r}, not a list of (name, value) pairs")
    return list(value)


def _check(value: Any, where: str, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise BaguaXError(f"bagua_x.core.wire: {where} is nested more than {MAX_DEPTH} levels deep")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_check(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    raise BaguaXError(f"bagua_x.core.wire: {where} is a {type(value).__name__}; only plain values can be sent")


def _constant(name: str) -> float:
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[name]


def _tuples(value: Any, source: str, depth: int) -> Any:
    if isinstance(value, list):
        if depth > MAX_DEPTH:
            raise BaguaXError(
                f"{source}: received arrays nested more than {MAX_DEPTH} levels deep, which no bagua_x rank "
                "sends; something other than a bagua_x rank wrote to this job's store or collective"
            )
        return tuple(_tuples(v, source, depth + 1) for v in value)
    if isinstance(value, dict):
        raise BaguaXError("bagua_x.core.wire: received a JSON object; bagua_x sends only arrays and scalars")
    return value
