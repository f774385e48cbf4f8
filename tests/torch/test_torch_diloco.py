"""DiLoCo through ``bagua_x.torch.wrap`` on real gloo ranks, against N model copies trained in one process.

The ground truth is independent of the library: N copies of the model, each with its own inner optimizer and
its rank's data; every H steps ``torch.optim.SGD(nesterov=True)`` steps a global copy with
``.grad = global - mean(local)`` and every copy continues from it.  Streaming and quantised settings follow
:class:`bagua_x.testing.reference.DiLoCoWorkers` (numpy, fragments over the bucket's element order).
Ranks start from different initial weights: the global copy must be made after rank 0's broadcast.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import bagua_x.torch as bxt
from bagua_x.algorithms import DiLoCo, TopK
from bagua_x.testing.reference import DiLoCoWorkers
from multirank import multirank

STEPS = 12
CONFIGS = {
    "diloco": dict(sync_every=4),
    "streaming": dict(sync_every=4, fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5),
    "bits8": dict(sync_every=4, bits=8),
    # SparseLoCo's outer step (lr 1, no momentum), 2 of every 16 entries sent at 2 bits, error feedback
    "sparse": dict(sync_every=4, outer_lr=1.0, outer_momentum=0.0, compression=TopK(fraction=0.125, chunk=16)),
}


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    xs = torch.randn(STEPS, 8, 5, generator=g)
    return xs, xs.sum(-1, keepdim=True).sin()


def _inner(model):
    return torch.optim.AdamW(model.parameters(), lr=0.02)


def _inner_step(model, opt, x, y):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def _outer_step(global_model, outer, copies):
    """torch's outer optimizer on ``.grad = global - mean(local)``; every copy continues from the new global."""
    with torch.no_grad():
        for g, *local in zip(global_model.parameters(), *(m.parameters() for m in copies)):
            g.grad = g - torch.stack(local).mean(0)
    outer.step()
    with torch.no_grad():
        for m in copies:
            for p, g in zip(m.parameters(), global_model.parameters()):
                p.copy_(g)


def simulate_torch_outer(n, sync_every):
    """N copies, inner AdamW each, and torch's Nesterov SGD on a global copy every ``sync_every`` steps."""
    copies = [_model(0) for _ in range(n)]
    inner = [_inner(m) for m in copies]
    global_model = _model(0)
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    data = [_data(r) for r in range(n)]
    for t in range(STEPS):
        for m, opt, (xs, ys) in zip(copies, inner, data):
            _inner_step(m, opt, xs[t], ys[t])
        if (t + 1) % sync_every == 0:
            _outer_step(global_model, outer, copies)
    return copies


def simulate_reference(n, names, config):
    """N copies, inner AdamW each, and the numpy DiLoCo reference on their weights laid out as the wrapper's
    bucket (``names``: its parameters in bucket order), after every inner step."""
    copies = [_model(0) for _ in range(n)]
    inner = [_inner(m) for m in copies]
    data = [_data(r) for r in range(n)]

    workers = DiLoCoWorkers.like(DiLoCo(**config), _vector(copies[0], names), n)
    for t in range(STEPS):
        for m, opt, (xs, ys) in zip(copies, inner, data):
            _inner_step(m, opt, xs[t], ys[t])
        for m, x in zip(copies, workers.after_step([_vector(m, names) for m in copies])):
            torch.nn.utils.vector_to_parameters(torch.from_numpy(x), [dict(m.named_parameters())[k] for k in names])
    return copies


def _vector(model, names):
    params = dict(model.named_parameters())
    return torch.nn.utils.parameters_to_vector([params[k] for k in names]).detach().numpy()


def _train(config):
    """This rank's wrapped run (its own initial weights, rank 0's broadcast at wrap); the wrapper is returned."""
    rank = dist.get_rank()
    model = _model(rank)
    opt = _inner(model)
    wrapped = bxt.wrap(model, opt, algorithm=DiLoCo(**config))
    xs, ys = _data(rank)
    for t in range(STEPS):
        _inner_step(wrapped, opt, xs[t], ys[t])
    return model, wrapped


def _parity(name):
    config = CONFIGS[name]
    rank, n = dist.get_rank(), dist.get_world_size()
    model, wrapped = _train(config)
    assert len(wrapped.buckets) == 1
    names = [k.removeprefix("module.") for k in wrapped.buckets[0].layout.names]
    got = _vector(model, names)
    want = _vector(simulate_reference(n, names, config)[rank], names)
    everyone = [np.empty_like(got) for _ in range(n)]
    dist.all_gather_object(everyone, got)
    if name == "diloco":
        truth = _vector(simulate_torch_outer(n, config["sync_every"])[rank], names)
        np.testing.assert_allclose(got, truth, rtol=0, atol=1e-6)
    if name == "bits8":
        exact = _vector(simulate_reference(n, names, {k: v for k, v in config.items() if k != "bits"})[rank], names)
        # quantised for real: farther from the full-precision run than float rounding could take it
        assert np.abs(got - exact).max() > 1e-4
    if name == "sparse":  # sparse for real: the dense run with the same outer step lands far away
        exact = _vector(simulate_reference(n, names, {k: v for k, v in config.items() if k != "compression"})[rank],
                        names)
        assert np.abs(got - exact).max() > 1e-2
    # bits=8: the reference quantises the same pseudo-gradients with the same formula, so the codes agree (seen:
    # 6e-8 apart, while the quantisation itself moves the weights 1.4e-3); gloo may sum ranks in another order than
    # numpy, and a sum at a code boundary then rounds to the neighbouring code: allow a few steps (~1e-4 each)
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-4 if name == "bits8" else 1e-6)
    if name != "streaming":  # every worker continues from the same global weights (the last step is a sync)
        for other in everyone:
            np.testing.assert_array_equal(other, everyone[0])
    wrapped.shutdown()


@pytest.mark.parametrize("name", list(CONFIGS))
@multirank(nproc=2, timeout=120)
def test_two_ranks_match_n_copies_in_one_process(name):
    _parity(name)


@pytest.mark.parametrize("name", list(CONFIGS))
@multirank(nproc=4, timeout=180)
def test_four_ranks_match_n_copies_in_one_process(name):
    _parity(name)


def _node_step(model, opt, node_data, t):
    """One inner step of a node that is one worker: the mean of its ranks' gradients (each its own data)."""
    grads = []
    for xs, ys in node_data:
        model.zero_grad()
        F.mse_loss(model(xs[t]), ys[t]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for p, *g in zip(model.parameters(), *grads):
        p.grad = torch.stack(g).mean(0)
    opt.step()


def simulate_nodes(nodes, ranks_per_node, sync_every):
    """A node is one worker: one copy per node, stepped with the mean of its ranks' gradients (each rank its own
    data), and torch's Nesterov SGD on a global copy every ``sync_every`` steps."""
    copies = [_model(0) for _ in range(nodes)]
    inner = [_inner(m) for m in copies]
    global_model = _model(0)
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    data = [_data(r) for r in range(nodes * ranks_per_node)]
    for t in range(STEPS):
        for k, (m, opt) in enumerate(zip(copies, inner)):
            _node_step(m, opt, data[k * ranks_per_node:(k + 1) * ranks_per_node], t)
        if (t + 1) % sync_every == 0:
            _outer_step(global_model, outer, copies)
    return copies


@multirank(nproc=4, timeout=180, env={"LOCAL_WORLD_SIZE": "2"})
def test_two_nodes_of_two_ranks_are_two_workers():
    """4 ranks as 2 nodes of 2: a node's ranks average gradients every step (on the node group) and stay equal;
    the outer exchange alone crosses nodes; the result is 2-worker DiLoCo on node-averaged gradients."""
    import collections

    from bagua_x.core.comm import Feature

    calls = collections.Counter()
    wait = bxt.TorchCommunicator._wait

    def counting_wait(comm, work, x):  # every collective of a TorchCommunicator goes through _wait
        calls[id(comm)] += 1
        return wait(comm, work, x)

    bxt.TorchCommunicator._wait = counting_wait
    rank = dist.get_rank()
    model = _model(rank)
    opt = _inner(model)
    wrapped = bxt.wrap(model, opt, algorithm=DiLoCo(sync_every=4))
    comm = wrapped.comm
    assert Feature.HIERARCHICAL in comm.features
    calls.clear()
    xs, ys = _data(rank)
    for t in range(STEPS):
        _inner_step(wrapped, opt, xs[t], ys[t])
    names = [k.removeprefix("module.") for k in wrapped.buckets[0].layout.names]
    got = _vector(model, names)
    counted = dict(calls)
    want = _vector(simulate_nodes(2, 2, 4)[rank // 2], names)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    everyone = [np.empty_like(got) for _ in range(4)]
    dist.all_gather_object(everyone, got)
    np.testing.assert_array_equal(everyone[rank ^ 1], got)  # a node's two ranks are one worker: bitwise equal
    syncs = STEPS // 4
    # one allreduce of the pseudo-gradient shard across nodes per sync; in the node, each step's gradient
    # allreduce plus each sync's reduce-scatter and allgather; nothing on the whole group
    assert counted.get(id(comm.across)) == syncs, counted
    assert counted.get(id(comm.within)) == STEPS + 2 * syncs, counted
    assert id(comm) not in counted, counted
    wrapped.shutdown()


def simulate_nodes_reference(nodes, ranks_per_node, names, config):
    """:func:`simulate_nodes` with the numpy reference (fragments, delay, alpha) as the outer algorithm."""
    copies = [_model(0) for _ in range(nodes)]
    inner = [_inner(m) for m in copies]
    data = [_data(r) for r in range(nodes * ranks_per_node)]
    workers = DiLoCoWorkers.like(DiLoCo(**config), _vector(copies[0], names), nodes)
    for t in range(STEPS):
        for k, (m, opt) in enumerate(zip(copies, inner)):
            _node_step(m, opt, data[k * ranks_per_node:(k + 1) * ranks_per_node], t)
        for m, x in zip(copies, workers.after_step([_vector(m, names) for m in copies])):
            torch.nn.utils.vector_to_parameters(torch.from_numpy(x), [dict(m.named_parameters())[k] for k in names])
    return copies


TWO_NODES = {"streaming": CONFIGS["streaming"],
             "sparse-streaming": dict(CONFIGS["sparse"], fragments=2, fragment_sync_delay=1)}


@pytest.mark.parametrize("name", list(TWO_NODES))
@multirank(nproc=4, timeout=180, env={"LOCAL_WORLD_SIZE": "2"})
def test_two_nodes_streaming_with_the_exchange_in_flight(name):
    """Streaming DiLoCo (tau = 1: each exchange runs on groups of its own while the next step trains, the node's
    gradient allreduce included) over 2 nodes of 2 ranks equals the 2-worker reference on node-mean gradients;
    sparse too (each rank sends half its node's chunks across, the node gathers the rest)."""
    config = TWO_NODES[name]
    rank = dist.get_rank()
    model = _model(rank)
    opt = _inner(model)
    wrapped = bxt.wrap(model, opt, algorithm=DiLoCo(**config))
    xs, ys = _data(rank)
    for t in range(STEPS):
        _inner_step(wrapped, opt, xs[t], ys[t])
    names = [k.removeprefix("module.") for k in wrapped.buckets[0].layout.names]
    got = _vector(model, names)
    want = _vector(simulate_nodes_reference(2, 2, names, config)[rank // 2], names)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    everyone = [np.empty_like(got) for _ in range(4)]
    dist.all_gather_object(everyone, got)
    np.testing.assert_array_equal(everyone[rank ^ 1], got)
    assert not np.array_equal(everyone[0], everyone[2])  # two workers, apart between syncs (alpha = 0.5)
    wrapped.shutdown()


LATE = 2.0  # seconds rank 1 comes late to the step that launches fragment 0


@multirank(nproc=2, timeout=120)
def test_the_streaming_exchange_overlaps_the_next_step():
    """With ``fragment_sync_delay=1`` the optimizer step that launches a fragment returns at once, its exchange
    left in flight (a late peer delays only the landing step); with 0 the same step waits for the late peer."""
    import time

    rank = dist.get_rank()
    took = {}
    for tau in (1, 0):
        model = _model(0)
        opt = _inner(model)
        wrapped = bxt.wrap(model, opt, algorithm=DiLoCo(sync_every=4, fragments=2, fragment_sync_delay=tau))
        assert wrapped.algorithm.offsets()[0] == 2  # fragment 0 launches at the second step
        xs, ys = _data(rank)
        for t in range(4):
            opt.zero_grad()
            F.mse_loss(wrapped(xs[t]), ys[t]).backward()
            if rank == 1 and t == 1:
                time.sleep(LATE)
            start = time.monotonic()
            opt.step()
            took[(tau, t)] = time.monotonic() - start
        wrapped.shutdown()
    if rank == 0:
        assert took[(1, 1)] < 0.5 * LATE, took  # launched and left in flight
        assert took[(0, 1)] > 0.5 * LATE, took  # control: without a lag the launching step waits
