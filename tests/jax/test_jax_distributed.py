"""init_distributed: torchrun-style environment -> jax.distributed.initialize arguments."""

import jax
import pytest

from bagua_x.jax import init_distributed
from bagua_x.jax.distributed import COORDINATOR_PORT_OFFSET


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.append(kw))
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "JAX_COORDINATOR_BIND_ADDRESS", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "JAX_LOCAL_DEVICE_IDS", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    return seen


def test_from_torchrun_env(calls, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29500")
    init_distributed(initialization_timeout=30)
    assert calls == [{
        "coordinator_address": f"10.0.0.7:{29500 + COORDINATOR_PORT_OFFSET}", "num_processes": 2, "process_id": 1,
        "local_device_ids": None, "initialization_timeout": 30,
        "coordinator_bind_address": f"10.0.0.7:{29500 + COORDINATOR_PORT_OFFSET}",  # not JAX's [::]
    }]


def test_explicit_arguments_win(calls, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    init_distributed("host:1234", num_processes=4, process_id=3, local_device_ids=[0])
    assert calls == [{"coordinator_address": "host:1234", "num_processes": 4, "process_id": 3, "local_device_ids": [0],
                      "coordinator_bind_address": "host:1234"}]


@pytest.mark.parametrize("env, ids", [
    ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}, [3]),  # torchrun, 8 processes a node: GPU 3 only, not all 8
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "4,5"}, [1]),  # the node's 2 GPUs
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, None),  # one process a node keeps all its devices
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "5"}, None),  # the launcher chose
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "JAX_LOCAL_DEVICE_IDS": "0,1"}, None),  # JAX reads it itself
])
def test_under_torchrun_each_local_process_takes_one_gpu(calls, monkeypatch, env, ids):
    for k, v in {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **env}.items():
        monkeypatch.setenv(k, v)
    init_distributed()
    assert len(calls) == 1 and calls[0]["local_device_ids"] == ids
    init_distributed(local_device_ids=[0, 1])
    assert calls[1]["local_device_ids"] == [0, 1]  # an explicit choice wins


@pytest.mark.parametrize("env", [{}, {"WORLD_SIZE": "1", "RANK": "0"}], ids=["plain-python", "world-of-one"])
def test_single_process_is_skipped(calls, monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    init_distributed()
    assert calls == []
