"""One process of tests/test_cluster.py's JAX run: psum across every process's devices, result to OUT/rank<R>.json."""

import json
import os
import socket
import sys

import bagua_x.jax as bxj

bxj.init_distributed()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

out = sys.argv[1]
pid, nproc = jax.process_index(), jax.process_count()
ndev = jax.local_device_count()
# device d of process p holds (p * ndev + d + 1) * arange(8)
local = np.stack([(pid * ndev + d + 1) * np.arange(8, dtype=np.float32) for d in range(ndev)])
total = jax.pmap(lambda v: jax.lax.psum(v, "i"), axis_name="i")(local)
expected = sum(range(1, nproc * ndev + 1)) * np.arange(8, dtype=np.float32)
result = {
    "rank": pid, "processes": nproc, "devices": jax.device_count(), "local_devices": ndev,
    "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]), "hostname": socket.gethostname(),
    "psum_ok": bool(np.allclose(np.asarray(total), expected)),
}
multihost_utils.sync_global_devices("done")
with open(os.path.join(out, f"rank{pid}.json"), "w") as f:
    json.dump(result, f)
