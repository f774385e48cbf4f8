"""Tracing ``bagua_x.torch.streams`` in tests: every stream operation the engines ask for, as ``(operation,
stream name)`` in call order, on the CPU too (where the operations do nothing else).

The engines call the stream functions through the module, so replacing the module's functions traces them;
bagua_x itself holds no tracing hook.
"""

from __future__ import annotations

import threading

# each traced function -> (operation, stream) from its arguments
_OPERATIONS = {
    "record": lambda stream: ("record", stream),
    "mark": lambda stream: ("mark", stream),
    "wait": lambda stream, event: ("wait", stream),
    "wait_stream": lambda stream, other: (f"wait_stream {other.name}", stream),
    "use": lambda stream: ("use", stream),
    "keep_for": lambda tensor, stream: ("keep_for", stream),
}
_saved: dict = {}


def start_tracing() -> list:
    """Trace from now on; the list fills as the engines' threads call the stream functions."""
    from bagua_x.torch import streams

    trace, lock = [], threading.Lock()

    def traced(fn, describe):
        def call(*args):
            op, stream = describe(*args)
            with lock:
                trace.append((op, stream.name))
            return fn(*args)
        return call

    for name, describe in _OPERATIONS.items():
        _saved.setdefault(name, getattr(streams, name))
        setattr(streams, name, traced(_saved[name], describe))
    return trace


def stop_tracing() -> None:
    """The stream functions as bagua_x defines them again."""
    from bagua_x.torch import streams

    for name, fn in _saved.items():
        setattr(streams, name, fn)
