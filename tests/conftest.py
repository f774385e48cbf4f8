import os
import sys

# Single-process JAX tests use 4 CPU devices; this must be set before anything imports jax.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import pytest  # noqa: E402

_TESTS = os.path.dirname(os.path.abspath(__file__))
# launch.py, the numpy references, each frontend's worker modules and examples/own_algorithm.py import by plain name.
for sub in ("", "algorithms", "torch", "jax", "../examples"):
    path = os.path.normpath(os.path.join(_TESTS, sub))
    if path not in sys.path:
        sys.path.insert(0, path)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except (ImportError, AttributeError):  # no torch (tests/torch is then found as a namespace)
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
