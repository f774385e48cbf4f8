"""Stopping after k steps and resuming in fresh processes (model, optimizer and algorithm state dicts)
continues bitwise identically to an uninterrupted run, for every algorithm with deterministic results;
so does loading the checkpoint back into the live wrapper."""

import os

import numpy as np
import pytest

from launch import run_workers

ENV = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}

CASES = {
    "GradientAllReduce": ("GradientAllReduce", {}),
    "ByteGrad": ("ByteGrad", {}),
    "Decentralized": ("Decentralized", {}),
    "DecentralizedShiftOne": ("Decentralized", {"peer_selection_mode": "shift_one", "communication_interval": 2}),
    "LowPrecisionDecentralized": ("LowPrecisionDecentralized", {}),
    "ModelAverage": ("ModelAverage", {"period": 2}),
    "QAdamStopInWarmup": ("QAdam", {"warmup_steps": 4}),  # resumes in warmup, switches afterwards
    "QAdamStopAfterWarmup": ("QAdam", {"warmup_steps": 2}),  # resumes straight into compressed momentum
    # buckets rebuilt in ready order after step 1; PowerSGD's per-bucket state only fits the rebuilt buckets
    "PowerSGDOutOfOrder": ("PowerSGD", {"start_powerSGD_iter": 2}, "out_of_order"),
    "DiLoCoMidH": ("DiLoCo", {"sync_every": 2}),  # stops after step 3: one inner step since the last sync
    # fragment 0 launched at step 3 (the checkpoint), lands at 4; fragment 1 launches at 6, lands at 7
    "StreamingDiLoCoInFlight": ("DiLoCo", {"sync_every": 6, "fragments": 2, "fragment_sync_delay": 1,
                                           "fragment_update_alpha": 0.5, "bits": 4}),
    # the error-feedback buffer holds what steps 2's exchange did not send; step 4's exchange reads it
    "SparseLoCoMidH": ("SparseLoCo", {"sync_every": 2, "fraction": 0.1, "chunk": 16}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bitwise_identical(case, tmp_path):
    name, kwargs, *model = CASES[case]
    total, k = 7, 3
    args = (name, kwargs, total, k, str(tmp_path), *model)
    full = run_workers("bx_checkpoint_workers:uninterrupted_and_first_part", nproc=2, timeout=120, env=ENV, args=args)
    resumed = run_workers("bx_checkpoint_workers:resume", nproc=2, timeout=120, env=ENV, args=args)
    assert len(full) == len(resumed) == 2
    for rank, ((uninterrupted, rolled_back), b) in enumerate(zip(full, resumed)):
        assert len(uninterrupted) == len(b) == len(rolled_back) > 0, (len(uninterrupted), len(b), len(rolled_back))
        for i, (x, y, z) in enumerate(zip(uninterrupted, b, rolled_back)):
            np.testing.assert_array_equal(x, y, err_msg=f"{case}: resumed, rank {rank}, parameter {i}")
            np.testing.assert_array_equal(x, z, err_msg=f"{case}: rolled back in place, rank {rank}, parameter {i}")


def test_saved_bucket_state_loads_as_its_type_and_a_misfit_is_refused_by_name():
    """The dict form on disk (an older checkpoint's included) becomes the algorithm's NamedTuple again; a
    misspelt or missing field names the bucket and the fields instead of loading half a state."""
    from types import SimpleNamespace

    import torch

    from bagua_x.algorithms import PowerSGDState
    from bagua_x.core import BaguaXError
    from bagua_x.torch import streams
    from bagua_x.torch.engine.registration import load_states, state_dict_of

    side = streams.side(torch.device("cpu"), "comm")  # the stream that reads the loaded state
    bucket = SimpleNamespace(name="bucket_0")
    live = PowerSGDState(step=torch.tensor(3, dtype=torch.int32), q=torch.ones(2), error=torch.zeros(4))
    saved = state_dict_of([SimpleNamespace(bucket=bucket, state=live)])
    assert list(saved) == ["bucket_0"] and list(saved["bucket_0"]) == ["step", "q", "error"]  # the form on disk
    assert all(torch.equal(saved["bucket_0"][k], v) for k, v in live._asdict().items())
    assert saved["bucket_0"]["q"] is not live.q  # a copy
    slot = SimpleNamespace(bucket=bucket, state=PowerSGDState(step=torch.tensor(0, dtype=torch.int32),
                                                              q=torch.zeros(2), error=torch.ones(4)))
    load_states([slot], {"bucket_0": {"step": torch.tensor(5, dtype=torch.int32), "q": torch.full((2,), 2.0),
                                               "error": torch.full((4,), 3.0)}}, side)
    assert type(slot.state) is PowerSGDState and int(slot.state.step) == 5
    assert slot.state.q.tolist() == [2.0, 2.0] and slot.state.error.tolist() == [3.0] * 4
    misspelt = {"bucket_0": {"step": live.step, "q": live.q, "eror": live.error}}
    with pytest.raises(BaguaXError, match=r"state of bucket 'bucket_0' does not fit PowerSGDState .*missing "
                                          r"\['error'\], unknown \['eror'\]"):
        load_states([slot], misspelt, side)
    assert int(slot.state.step) == 5  # untouched by the refused load


def test_diloco_state_saved_with_another_delay_is_refused_by_bucket_and_field():
    """fragment_sync_delay sizes DiLoCo's in-flight pseudo-gradients: a state saved without them must not load
    into a wrapper that launches some (it would fail inside reduce, on the communication thread)."""
    from types import SimpleNamespace

    import torch

    from bagua_x.algorithms import DiLoCo
    from bagua_x.core import BaguaXError
    from bagua_x.torch import streams
    from bagua_x.torch.engine.registration import load_states, state_dict_of

    side = streams.side(torch.device("cpu"), "comm")
    flat, layout = torch.arange(6.0), SimpleNamespace()
    saved = state_dict_of([SimpleNamespace(bucket=SimpleNamespace(name="bucket_0"),
                                           state=DiLoCo(sync_every=4).init(flat, layout, 2))])
    slot = SimpleNamespace(bucket=SimpleNamespace(name="bucket_0"),
                           state=DiLoCo(sync_every=4, fragments=2, fragment_sync_delay=1).init(flat, layout, 2))
    with pytest.raises(BaguaXError, match=r"bucket 'bucket_0' has 'pending' of shape \(0,\), but this wrapper's is "
                                          r"\(6,\)"):
        load_states([slot], saved, side)
    assert slot.state.pending.shape == (6,)  # untouched by the refused load
