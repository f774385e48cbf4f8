"""Keeping the C++ chatter of gloo out of the demo's output.

JAX's gloo collectives print ``[Gloo] Rank N is connected to ...`` from C++
straight to standard output when processes connect; Python cannot catch that.
:func:`without_gloo_lines` points file descriptors 1 and 2 at pipes for the
duration of a block and forwards everything else unchanged, cut at ``\\n`` or
``\\r`` so that a progress bar (which redraws with ``\\r``) still moves.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading

__all__ = ["without_gloo_lines"]


def _forward(read: int, out: int) -> None:
    pending = b""
    while chunk := os.read(read, 65536):
        pending += chunk
        *done, pending = re.split(rb"(?<=[\r\n])", pending)
        for piece in done:
            if not piece.startswith(b"[Gloo]"):
                os.write(out, piece)
    if pending and not pending.startswith(b"[Gloo]"):
        os.write(out, pending)
    os.close(read)


@contextlib.contextmanager
def without_gloo_lines():
    sys.stdout.flush()
    sys.stderr.flush()
    saved, pumps = {}, []
    for fd in (1, 2):
        read, write = os.pipe()
        saved[fd] = os.dup(fd)
        os.dup2(write, fd)
        os.close(write)
        pumps.append(threading.Thread(target=_forward, args=(read, saved[fd]), daemon=True))
        pumps[-1].start()
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, original in saved.items():
            os.dup2(original, fd)  # closes the pipe's last write end: its pump sees the end and stops
        for pump in pumps:
            pump.join(timeout=5)
        for original in saved.values():
            os.close(original)
