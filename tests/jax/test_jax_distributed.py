"""init_distributed: torchrun-style environment -> jax.distributed.initialize arguments."""

import jax
import pytest

from bagua_x.jax import init_distributed
from bagua_x.jax.distributed import COORDINATOR_PORT_OFFSET


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.append(kw))
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "JAX_COORDINATOR_BIND_ADDRESS"):
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


@pytest.mark.parametrize("env", [{}, {"WORLD_SIZE": "1", "RANK": "0"}], ids=["plain-python", "world-of-one"])
def test_single_process_is_skipped(calls, monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    init_distributed()
    assert calls == []
