"""Typed algorithm state: every stateful algorithm's state is its own NamedTuple, and a saved dict that does not
fit it (a misspelt, missing or unknown field) is refused by name instead of loading half a state."""

import numpy as np
import pytest

from bagua_x.algorithms import (ByteGrad, Decentralized, DecentralizedState, EmptyState, GradientAllReduce,
                                LowPrecisionDecentralized, LowPrecisionDecentralizedState, ModelAverage,
                                ModelAverageState, PowerSGD, PowerSGDState, QAdam, QAdamState)
from bagua_x.algorithms.base import state_from_dict
from bagua_x.core import BaguaXError
from bagua_x.testing import flat_layout

STATES = [(GradientAllReduce(), EmptyState), (ByteGrad(), EmptyState), (Decentralized(), DecentralizedState),
          (LowPrecisionDecentralized(), LowPrecisionDecentralizedState), (ModelAverage(), ModelAverageState),
          (PowerSGD(), PowerSGDState), (QAdam(), QAdamState)]


@pytest.mark.parametrize("algorithm, state_type", STATES, ids=lambda v: type(v).__name__)
def test_init_returns_the_algorithms_state_type_and_its_dict_round_trips(algorithm, state_type):
    flat = np.arange(8, dtype=np.float32)
    state = algorithm.init(flat, flat_layout(flat), 2)
    assert type(state) is state_type
    back = state_from_dict(state, state._asdict(), "bucket 'b0'")
    assert type(back) is state_type and all(a is b for a, b in zip(back, state))


def test_a_misspelt_field_is_refused_naming_the_bucket_and_the_fields():
    state = QAdam().init(np.zeros(4, np.float32), flat_layout(np.zeros(4, np.float32)), 2)
    saved = {"step": state.step, "m": state.m, "vv": state.v}
    with pytest.raises(BaguaXError, match=r"state of bucket 'b0' does not fit QAdamState \(fields \['step', 'm', "
                                          r"'v'\]\): missing \['v'\], unknown \['vv'\]"):
        state_from_dict(state, saved, "bucket 'b0'")


def test_a_missing_field_and_a_state_of_another_algorithm_are_refused():
    flat = np.zeros(4, np.float32)
    state = LowPrecisionDecentralized().init(flat, flat_layout(flat), 2)
    with pytest.raises(BaguaXError, match=r"missing \['right'\], unknown \[\]"):
        state_from_dict(state, {k: v for k, v in state._asdict().items() if k != "right"}, "bucket 'b0'")
    with pytest.raises(BaguaXError, match=r"does not fit EmptyState .*missing \[\], unknown \['step'\]"):
        state_from_dict(EmptyState(), {"step": np.int32(3)}, "bucket 'b0'")


def test_a_misspelt_attribute_is_an_error():
    state = ModelAverage().init(np.zeros(2, np.float32), flat_layout(np.zeros(2, np.float32)), 2)
    with pytest.raises(AttributeError):
        state.stpe  # noqa: B018
