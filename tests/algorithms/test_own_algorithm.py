"""docs/write-your-own-algorithm.md's algorithm (examples/own_algorithm.py) on 2, 3, 4 and 8 simulated ranks, and
the page's code checked against the files it comes from."""

# --8<-- [start:simulated]
import numpy as np
import pytest

from bagua_x.testing import flat_layout, reference, run
from own_algorithm import Float16AllReduce


def reduce_on_every_rank(xs):
    """Each rank's result of one ``reduce`` of its own ``xs[rank]``, and the communicators (what each sent)."""
    algorithm = Float16AllReduce()

    def one_rank(comm):
        x = xs[comm.rank]
        state = algorithm.init(x, flat_layout(x), comm.size)
        return algorithm.reduce(x, flat_layout(x), state, comm)[0]

    return run(len(xs), one_rank)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_the_mean_to_float16_precision(n):
    rng = np.random.default_rng(n)
    xs = [rng.standard_normal(1000).astype(np.float32) for _ in range(n)]
    results, comms = reduce_on_every_rank(xs)
    mean = reference.allreduce(xs)[0]
    # n roundings to float16 (each cast, each addition), each within 2**-11 of a value <= max |x|
    bound = n * 2.0**-11 * np.max(np.abs(xs), axis=0)
    for out in results:
        assert out.dtype == np.float32
        assert np.all(np.abs(out - mean) <= bound)
        np.testing.assert_array_equal(out, results[0])  # every rank the same
    for comm in comms:  # float16 on the wire: half the bytes of float32
        assert [(s.op, s.dtype) for s in comm.sent] == [("allreduce", np.float16)]
        assert comm.bytes_sent() == Float16AllReduce().wire_bytes(flat_layout(1000), 4, n)
        assert comm.bytes_sent() == 2 * (n - 1) / n * 1000 * 2

# --8<-- [end:simulated]


# --8<-- [start:overflow]
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_no_overflow_where_one_rank_fits_float16(n):
    xs = [np.full(4, 60000.0, np.float32) for _ in range(n)]  # float16's largest is 65504
    results, _ = reduce_on_every_rank(xs)
    for out in results:
        assert np.all(np.abs(out - 60000.0) <= n * 2.0**-11 * 60000.0)
# --8<-- [end:overflow]


def lines_in(block: str, source: str) -> bool:
    """``block``'s lines appear consecutively in ``source``, whatever their indentation there."""
    want, have = [line.strip() for line in block.strip().splitlines()], [line.strip() for line in source.splitlines()]
    return any(have[i : i + len(want)] == want for i in range(len(have)))


def test_the_page_shows_the_tested_code():
    """The page includes the algorithm and its tests from these files (pymdownx.snippets, whole files or
    ``# --8<-- [start:...]`` sections), and its usage lines are the frontend tests' own."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "write-your-own-algorithm.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    included = [re.fullmatch(r'--8<-- "([^":]+)(?::(\w+))?"\n', block) for block in blocks]
    assert [m.groups() for m in included if m] == [("examples/own_algorithm.py", None),
                                                  ("tests/algorithms/test_own_algorithm.py", "simulated"),
                                                  ("tests/algorithms/test_own_algorithm.py", "overflow")]
    this = Path(__file__).read_text()
    for section in ("simulated", "overflow"):
        assert this.count(f"# --8<-- [start:{section}]\n") == this.count(f"# --8<-- [end:{section}]\n") == 1
    usage = [block for block, m in zip(blocks, included) if not m]
    frontends = [(root / "tests" / path).read_text() for path in ("torch/test_torch_own_algorithm.py",
                                                                  "jax/test_jax_own_algorithm.py")]
    assert len(usage) == 2
    for block, source in zip(usage, frontends):
        assert lines_in(block, source), f"the page's code is not {source}'s:\n{block}"
