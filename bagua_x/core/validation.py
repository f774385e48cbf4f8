"""Checking that every rank registered the same thing, with an error that says what differs.

A model that differs across ranks (a parameter's name, shape or dtype, a bucket
layout, an algorithm setting) makes collectives mismatch, which ends in a hang
or a bare "connection closed".  Each frontend instead gathers every rank's
:func:`describe` output once (a cheap allgather of small tuples) and calls
:func:`check_same_everywhere`, which raises the same error on every rank.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from .errors import BaguaXError

__all__ = ["describe", "first_mismatch", "check_same_everywhere"]


def describe(tensors: Iterable[tuple[str, Sequence[int], str]], settings: dict[str, Any]) -> list[tuple[str, Any]]:
    """An ordered list of ``(what, value)``: each tensor's name, shape and dtype, their count, then each setting.

    Tensors come first so that a missing or extra tensor is reported by name.
    """
    entries: list[tuple[str, Any]] = []
    for name, shape, dtype in tensors:
        entries.append((f"tensor #{len(entries)}", (name, tuple(int(s) for s in shape), str(dtype))))
    entries.append(("number of tensors", len(entries)))
    entries.extend((f"setting {key!r}", _plain(value)) for key, value in settings.items())
    return entries


def _plain(value):
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _plain(v)) for k, v in value.items()))
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


def first_mismatch(per_rank: Sequence[list[tuple[str, Any]]]) -> str | None:
    """A message naming the first entry that differs across ranks and what each rank has, or None."""
    longest = max(len(d) for d in per_rank)
    for i in range(longest):
        values = [d[i] if i < len(d) else ("(missing)", None) for d in per_rank]
        if any(v != values[0] for v in values[1:]):
            what = next(v[0] for v in values if v[0] != "(missing)")
            lines = "\n".join(f"  rank {r}: {_show(v)}" for r, v in enumerate(values))
            return f"ranks disagree on {what}:\n{lines}"
    return None


def _show(entry) -> str:
    what, value = entry
    if what.startswith("tensor #") and isinstance(value, tuple) and len(value) == 3:
        name, shape, dtype = value
        return f"{name!r} shape {shape} dtype {dtype}"
    return f"{what} = {value!r}"


def check_same_everywhere(per_rank: Sequence[list[tuple[str, Any]]], context: str) -> None:
    """Raise the same :class:`BaguaXError` on every rank when the descriptions differ."""
    message = first_mismatch(per_rank)
    if message:
        raise BaguaXError(
            f"{context}: {message}\nEvery rank must build the same model with the same settings; "
            "fix the rank that differs (same code, same config, same seed-independent architecture)"
        )
