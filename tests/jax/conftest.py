"""Single-process JAX tests see 4 CPU devices: the flag must be set before JAX starts its backend.

Appending to XLA_FLAGS (instead of overwriting) keeps other flags; the backend
reads it at the first computation, which comes after collection.
"""

import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=4".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
