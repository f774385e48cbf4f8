"""The torch engine's control path: Python calls per backward, and the frames a gradient crosses.

    python benchmarks/control_path.py

GradientAllReduce on an 8-layer MLP (Linear(256, 256), 7 gradient buckets at
``bucket_cap_mb=0.3``), gloo with world size 1, after the first backward (the
one that rebuilds the buckets).  Printed:

* bagua_x calls per backward: every Python function of ``bagua_x`` called
  during ``loss.backward()``, on the training thread and the communication
  thread (``sys.setprofile`` / ``threading.setprofile``), per file;
* the path of the gradient that completes a bucket: the frames from its hook
  (the first bagua_x frame autograd calls) to the hand-off to the
  communication thread (``CommWorker.submit``), and from the thread's loop
  (``CommWorker._run``) to the collective (``TorchCommunicator.allreduce``),
  with the files they lie in, and the two together end to end.

The counts are exact and do not depend on the machine's load (no timings).
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
import threading

import torch
import torch.distributed as dist

import bagua_x
import bagua_x.torch as bxt

PACKAGE = os.path.dirname(bagua_x.__file__)
STEPS = 5


def _ours(code) -> bool:
    return code.co_filename.startswith(PACKAGE)


def _short(code) -> str:
    return os.path.relpath(code.co_filename, PACKAGE)


def _path(frame, stop) -> list[str]:
    """``file:function`` of bagua_x frames from ``frame`` outwards, until one whose caller ``stop`` rejects."""
    out = []
    while frame is not None and _ours(frame.f_code) and not stop(frame):
        out.append(f"{_short(frame.f_code)}:{frame.f_code.co_name}")
        frame = frame.f_back
    return out[::-1]


class Profiler:
    """Counts bagua_x calls on every thread; keeps the frame paths to the hand-off and to the collective."""

    def __init__(self):
        self.calls: collections.Counter = collections.Counter()
        self.threads: collections.Counter = collections.Counter()
        self.to_submit: list[str] = []
        self.to_collective: list[str] = []
        self._lock = threading.Lock()
        self.active = False

    def __call__(self, frame, event, _arg):
        if not self.active or event != "call" or not _ours(frame.f_code):
            return
        with self._lock:
            self.calls[_short(frame.f_code)] += 1
            self.threads[threading.current_thread().name] += 1
        name = frame.f_code.co_name
        if name == "submit" and _short(frame.f_code).endswith("comm_thread.py") and not self.to_submit:
            self.to_submit = _path(frame, lambda f: False)
        elif name == "allreduce" and _short(frame.f_code).endswith("communicator.py") and not self.to_collective:
            self.to_collective = _path(frame, lambda f: False)  # from the thread's loop


def main() -> None:
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    prof = Profiler()
    threading.setprofile(prof)  # before wrap() starts the communication thread (Python 3.11 has no setprofile_all_threads)
    ddp = bxt.wrap(model, opt, bucket_cap_mb=0.3)
    x = torch.randn(16, 256)
    for _ in range(2):  # the first backward records the order and rebuilds the buckets
        ddp(x).sum().backward()
        opt.step()
        opt.zero_grad()
    sys.setprofile(prof)
    for _ in range(STEPS):
        loss = ddp(x).sum()
        prof.active = True
        loss.backward()
        prof.active = False
        opt.step()
        opt.zero_grad()
    sys.setprofile(None)
    buckets = ddp.buckets
    total = sum(prof.calls.values()) / STEPS
    print(f"{len(buckets)} gradient buckets, {sum(len(b.tensors) for b in buckets)} gradients")
    print(f"bagua_x calls per backward: {total:.0f}")
    for name, n in [*prof.threads.most_common(), *prof.calls.most_common()]:
        print(f"  {n / STEPS:6.1f}  {name}")
    for title, path in (("hook -> hand-off", prof.to_submit), ("thread -> collective", prof.to_collective),
                        ("end to end", prof.to_submit + prof.to_collective)):
        files = sorted({p.split(":")[0] for p in path})
        print(f"{title}: {len(path)} frames in {len(files)} files {files}")
        for p in path:
            print(f"    {p}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
