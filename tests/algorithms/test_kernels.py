"""algorithms/kernels.py: kernels run plain, or compiled once per namespace on large enough arrays."""

import numpy as np
import pytest

from bagua_x.algorithms import kernels
from bagua_x.algorithms.kernels import kernel, register_compiler

NUMPY = "array_api_compat.numpy"  # the namespace name of numpy arrays


@pytest.fixture
def compilers(monkeypatch):
    table = {}
    monkeypatch.setattr(kernels, "_COMPILERS", table)
    return table


def make_kernel():
    calls = []

    @kernel
    def double(x, y):
        calls.append("plain")
        return 2 * x + y
    return double, calls


def test_without_a_compiler_the_plain_function_runs(compilers):
    double, calls = make_kernel()
    assert np.array_equal(double(np.ones(3), 1), [3, 3, 3]) and calls == ["plain"]
    assert double.__name__ == "double"
    assert np.array_equal(double.plain(np.ones(2), 0), [2, 2])


def test_registered_compiler_runs_at_and_above_min_numel_compiled_once(compilers):
    compiled = []

    def compile(fn):
        compiled.append(fn.__name__)
        return lambda x, *args: ("compiled", fn(x, *args))

    register_compiler(NUMPY, compile, min_numel=4)
    assert compilers == {NUMPY: (compile, 4)}
    double, calls = make_kernel()
    assert np.array_equal(double(np.ones(3), 0), [2, 2, 2])  # 3 < 4: plain
    assert compiled == []
    tag, value = double(np.ones((2, 2)), 1)  # 4 elements: compiled
    assert tag == "compiled" and np.array_equal(value, np.full((2, 2), 3))
    double(np.ones(10), 0)
    assert compiled == ["double"]  # compiled once, reused


def test_default_min_numel_compiles_every_call(compilers):
    register_compiler(NUMPY, lambda fn: (lambda x: "compiled"))
    assert compilers[NUMPY][1] == 0
    double, _ = make_kernel()
    assert double(np.ones(1)) == "compiled"


def test_compiler_of_another_namespace_is_not_used(compilers):
    register_compiler("array_api_compat.torch", lambda fn: (lambda *a: "compiled"))
    double, calls = make_kernel()
    assert np.array_equal(double(np.ones(2), 0), [2, 2]) and calls == ["plain"]
