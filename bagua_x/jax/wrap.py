"""Data parallelism for a JAX params pytree: buckets, algorithm state, and the step-side calls.

``wrap(params)`` registers every floating leaf under its key path (the proxy:
JAX arrays are immutable, so the path is what stays fixed), groups the leaves
into buckets per dtype (:class:`~.leaf_plan.LeafPlan`) and checks that every process wrapped
the same tree.  Inside the pmapped / shard_mapped step, ``reduce_gradients``
and ``sync_params`` pack each bucket into one flat array, run the algorithm on
it through an :class:`AxisCommunicator` and unpack; under ``jit`` XLA fuses the
copies.  Across processes one collective per bucket instead of one per leaf is
what makes this fast (per-collective latency dominates on gloo); in one
process only small leaves are worth packing.

One rule for the four step-side calls: each communicates for the algorithms
whose ``target`` it is made for -- ``reduce_gradients`` and
``gradient_transformation`` for gradients, ``sync_params`` for weights,
``optimizer`` for the momentum (QAdam) -- and raises a BaguaXError naming the
call that does communicate for any other, so a step can never silently skip
the communication (a call that passed the tree through unchanged would).  The
one exception: ``reduce_gradients`` with a weight algorithm that declares
``averages_gradients_in_node`` (DiLoCo) averages the gradients inside the node.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Hashable, Optional, Sequence

import jax
import jax.numpy as jnp

from ..algorithms import Algorithm, EmptyState, GradientAllReduce, Phase, Target
from ..algorithms.base import initial_state
from ..core.bucket import BucketLayout
from ..core.comm import Feature, ReduceOp
from ..core.errors import BaguaXError
from ..core.validation import describe
from .checks import FiniteCheck, check_stacked, check_state_stacked, refuse_invariant, refuse_jit_level
from .communicator import AxisCommunicator, default_local_size
from .distributed import check_same_across_processes
from .leaf_plan import LeafPlan
from .mesh_step import Layout, axis_bound, per_device, shard_over, step_mesh
from .node_form import StepForms, decided_by_trial, form_topology, run_in_form, storable, with_form
from .placement import check_mesh_axis, context_mesh, mesh_axis_size
from .placement import replicate as _replicate
from .placement import unreplicate as _unreplicate
from .schedule import scheduled
from .step import StepGuard, check_timeouts

__all__ = ["DataParallel", "wrap"]

logger = logging.getLogger(__name__)


SMALL_LEAF_BYTES = 128 * 1024  # in one process, trees of leaves this small on average are packed


class DataParallel:
    """A params pytree made data parallel with ``algorithm`` (made by :func:`wrap`).

    In a multi-process run, every process must call ``wrap`` with the same
    tree (checked across processes, JSON only).  Inside the step, call
    :meth:`DataParallel.reduce_gradients` / :meth:`DataParallel.sync_params`,
    or use the optax forms :meth:`DataParallel.gradient_transformation` and
    :meth:`DataParallel.optimizer` (QAdam).

    Args:
        params: the params pytree; its key paths name the leaves in every message.
        algorithm: default :class:`~bagua_x.algorithms.GradientAllReduce`.
        axis_name: the ``pmap`` / ``shard_map`` axis the step runs over; on a 2-D
            mesh a tuple ``("node", "local")``: nodes along the first axis, a
            node's devices along the second, the two levels of the hierarchical
            algorithms (:class:`~.communicator.AxisCommunicator`).
        bucket_cap_mb: the largest bucket (leaves are packed per dtype up to it).
        world_size: the axis size (default: that of ``mesh``, else ``jax.device_count()``, all devices of
            all processes: call :func:`~.distributed.init_distributed` before ``wrap``).
        pack_buckets: one collective per bucket (True) or per leaf (False);
            default automatic.  Algorithms that need padding always pack.
        timeout: seconds (default off): a step run through
            :meth:`DataParallel.step` that does not finish in time ends the
            process with a report (which processes never arrived), so an elastic
            launcher can restart the job.  It must stay 10 s below JAX's heartbeat
            timeout (:func:`~.distributed.init_distributed`).  Only a step still running is
            reported: one that raises (and Ctrl-C) leaves the process alive.
        check_finite: raise a BaguaXError naming the leaves when a reduced value
            is NaN or inf, on every process at the same step (:mod:`.checks`).
        devices_per_node: groups the axis into nodes for the hierarchical
            algorithms (default: this process's devices times torchrun's
            ``LOCAL_WORLD_SIZE``), which run in two levels under ``pmap`` with
            >= 2 nodes.  With >= 2 devices per node, ``hierarchical=None`` takes
            the faster form: the first 12 steps through :meth:`DataParallel.step`
            time whole steps in each and decide (until then, and without ``dp.step``,
            the step runs flat); the choice is part of the state (``init``), so a
            restored state keeps its form through ``dp.step`` (:mod:`.node_form`).
            Where there are no node groups (``shard_map``: JAX has
            no grouped collectives there; a ``devices_per_node`` that does not
            divide the axis) the default ``hierarchical=None`` runs flat and
            ``hierarchical=True`` is refused when the step is traced.
        first_step_timeout: the first step's limit under ``timeout``: it traces
            and compiles the program (default: the larger of ``timeout`` and
            600 s); a later call that compiles again (new input shapes) has ``timeout``.
        mesh: the mesh whose ``axis_name`` axis the step-side calls shard over when
            called at jit level (:meth:`DataParallel.value_and_grad`), and where
            ``replicate`` / ``init`` lay trees out (default: the mesh of
            ``jax.set_mesh`` around each call); ``world_size`` defaults to that axis's size.
        fault_tolerance: a :class:`bagua_x.ft.FaultTolerance`: this process and its devices are one node (a
            torchft replica group) of a job that survives losing a node; DiLoCo's exchange between nodes runs
            on the host through :meth:`sync_replicas` (:mod:`.fault_tolerance`).  Needs ``bagua-x[ft]``.
    """

    def __init__(
        self,
        params: Any,
        *,
        algorithm: Optional[Algorithm] = None,
        axis_name: Hashable = "batch",
        bucket_cap_mb: float = 25.0,
        world_size: Optional[int] = None,
        pack_buckets: Optional[bool] = None,
        timeout: Optional[float] = None,
        check_finite: bool = False,
        devices_per_node: Optional[int] = None,
        first_step_timeout: Optional[float] = None,
        mesh: Optional[jax.sharding.Mesh] = None,
        fault_tolerance: Optional[Any] = None,
    ):
        self.algorithm = algorithm if algorithm is not None else GradientAllReduce()
        if fault_tolerance is not None:
            from .fault_tolerance import check_supported  # imports torch: only where asked for

            self.algorithm = check_supported(self.algorithm)
        if mesh is not None:
            check_mesh_axis(mesh, axis_name, "bagua_x.jax.wrap: the mesh")
        self.mesh = mesh
        self.devices_per_node = devices_per_node
        if self.algorithm.phase is Phase.BACKGROUND:
            raise BaguaXError(
                f"bagua_x.jax.wrap: {type(self.algorithm).__name__} communicates on a background thread of its own, "
                "which needs mutable weights (the torch frontend); in JAX average synchronously with "
                "ModelAverage(period=...), every period steps"
            )
        self.axis_name = axis_name
        if world_size is None:
            world_size = mesh_axis_size(mesh, axis_name) if mesh is not None else jax.device_count()
        self.world_size = int(world_size)
        self.plan = LeafPlan.of(params, self.algorithm.alignment(self.world_size), bucket_cap_mb)
        per_leaf_ok = self.algorithm.elementwise
        if pack_buckets is False and not per_leaf_ok:
            raise BaguaXError(
                f"wrap(pack_buckets=False) works only with GradientAllReduce; {self.algorithm!r} needs whole buckets"
            )
        if pack_buckets is None:
            # Across processes every collective pays network latency, so pack.  In one process
            # XLA's allreduce of large leaves beats the pack/unpack copies, while small leaves pay
            # more per collective than the copies cost (benchmarks/jax_vs_pmean.py, 4 CPU devices:
            # packed 0.5-0.75x per-leaf time for 16-64 KiB leaves, 1.7x for 256 KiB ones).
            pack_buckets = not (per_leaf_ok and jax.process_count() == 1
                                and self.plan.mean_leaf_bytes() >= SMALL_LEAF_BYTES)
        self.pack_buckets = bool(pack_buckets)
        self._initial = params
        self._finite = FiniteCheck(self.plan.names) if check_finite else None
        check_timeouts(timeout, first_step_timeout)
        check_same_across_processes(
            describe(
                zip(self.plan.names, self.plan.shapes, map(str, self.plan.dtypes)),
                {**self.algorithm.hyperparameters(), "axis_name": repr(axis_name), "bucket_cap_mb": bucket_cap_mb,
                 "world_size": self.world_size, "timeout": timeout, "first_step_timeout": first_step_timeout,
                 "check_finite": bool(check_finite),
                 "devices_per_node": devices_per_node or default_local_size(),  # the node layout
                 "mesh": dict(mesh.shape) if mesh is not None else None,
                 "fault_tolerance": fault_tolerance is not None},
            ),
            "bagua_x.jax.wrap: the params trees or settings differ across processes",
        )
        if not self.plan.registered:  # after the check above: every process raises alike, none waits for the others
            found = ", ".join(f"{n} ({d})" for n, d in zip(self.plan.names, self.plan.dtypes)) or "no leaves at all"
            raise BaguaXError(
                f"bagua_x.jax.wrap: the params tree has no float leaf to communicate ({found}); wrap the tree of "
                "trainable float parameters (flax: nnx.state(model, nnx.Param))"
            )
        # hierarchical=None on nodes: flat until dp.step's trial of whole steps decides (a 2-D mesh's axes say
        # where the nodes are: its two levels are not timed against flat)
        local = devices_per_node or min(default_local_size(), self.world_size)
        trial = not isinstance(axis_name, tuple) and decided_by_trial(self.algorithm, self.world_size, local)
        self._forms = StepForms(self.algorithm, axis_name, form_topology(
            self.algorithm, self.layouts, self.world_size, local)) if trial else None
        self._guard = StepGuard(timeout, first_step_timeout, self._finite, self._forms,
                                branches=self.algorithm.branch_key(0) is not None)
        self._node = None  # fault_tolerance's host side (.fault_tolerance.NodeExchange)
        if fault_tolerance is not None:
            from .fault_tolerance import NodeExchange

            self._node = NodeExchange(self, fault_tolerance)
        logger.info(
            "bagua_x.jax.wrap: %d leaves in %d buckets, %s, world size %d%s",
            len(self.names), len(self.bucket_leaves), self.algorithm.hyperparameters(), self.world_size,
            "" if self.pack_buckets else " (per-leaf collectives in one process)",
        )

    @property
    def names(self) -> list[str]:
        """Every leaf's key path, in the flattened params tree's order."""
        return self.plan.names

    @property
    def bucket_leaves(self) -> list[list[int]]:
        """Each bucket's leaves, as indices into :attr:`names`."""
        return self.plan.bucket_leaves

    @property
    def layouts(self) -> list[BucketLayout]:
        """Each bucket's layout (its leaves' names, shapes and offsets in the flat buffer)."""
        return self.plan.layouts

    def __repr__(self) -> str:
        return (f"DataParallel({len(self.names)} leaves, {len(self.bucket_leaves)} buckets, "
                f"{self.algorithm!r}, axis_name={self.axis_name!r})")

    # -- outside the step: placement -------------------------------------------------------
    def replicate(self, tree: Any, mesh: Optional[jax.sharding.Mesh] = None, per_device: bool = False) -> Any:
        """Put ``tree`` on every device, process 0's values winning.

        Without ``mesh``: the wrap's mesh, else the one of ``jax.set_mesh`` around the call, else the
        pmap layout.  With a mesh: replicated
        (``in_specs=P()``), or with ``per_device`` one copy per device along the
        axis (``in_specs=P(axis_name)``), for values that diverge per device:
        the params and optimizer state of weight algorithms.  See :mod:`.placement`.
        A ``mesh`` that is not the step's (the wrap's, else ``jax.set_mesh``'s) is refused.
        """
        if mesh is not None:
            self._check_step_mesh(mesh, "dp.replicate")
        return _replicate(tree, self.axis_name, mesh if mesh is not None else self.mesh, per_device)

    def unreplicate(self, tree: Any) -> Any:
        """One device's copy of a replicated tree (after training: all copies agree for most algorithms)."""
        return _unreplicate(tree)

    def init_state(self, params: Any = None) -> tuple:
        """The algorithm state for one device: a tuple with one state per bucket, each the algorithm's
        ``NamedTuple`` (``PowerSGDState``...), so a pytree (pure, jit-safe), with any zero-size array as None
        (orbax cannot save one: :func:`~.node_form.storable`); where the algorithm branches on its step, inside
        a :class:`~.schedule.Scheduled` (the same leaves and key paths), and where ``dp.step`` decides the
        form, inside a :class:`~.node_form.FormState`.

        Empty for a momentum algorithm (QAdam): its optimizer, :meth:`optimizer`, holds the state.
        """
        if self.algorithm.target is Target.MOMENTUM:
            return tuple(EmptyState() for _ in self.bucket_leaves)
        if self.algorithm.target is Target.GRAD:  # gradient state starts from zeros
            leaves = [jnp.zeros(shape, dtype) for shape, dtype in zip(self.plan.shapes, self.plan.dtypes)]
        else:
            leaves = self.plan.leaves(self._initial if params is None else params, "init_state")
        return with_form(scheduled(tuple(
            storable(initial_state(self.algorithm, layout.pack([leaves[i] for i in bucket], xp=jnp), layout,
                                   self.world_size))
            for bucket, layout in zip(self.bucket_leaves, self.layouts)
        ), self.algorithm), self._forms)

    def init(self, params: Any = None, mesh: Optional[jax.sharding.Mesh] = None) -> tuple:
        """:meth:`init_state` (from ``params``, default the wrapped ones) on every device.

        In the pmap layout, or on a mesh (``mesh``, the wrap's, or the one of ``jax.set_mesh``) one copy per
        device (``in_specs=P(axis_name)``), since an algorithm's state may differ per device.
        """
        return self.replicate(jax.device_get(self.init_state(params)), mesh, per_device=True)

    # -- inside the step ----------------------------------------------------------------------
    def value_and_grad(self, fun: Callable, has_aux: bool = False,
                       batch_argnums: Optional[Sequence[int]] = None) -> Callable:
        """``jax.value_and_grad(fun)`` per device, then this wrap's gradient communication: the one call
        that is right in a ``jax.jit`` step over a mesh, inside ``jax.shard_map`` and inside ``jax.pmap``.

        ``(loss, grads), state = dp.value_and_grad(loss_fn)(params, *batch, state=state)`` (with
        ``has_aux``: ``((loss, aux), grads), state``).  Each device differentiates on its own part of
        the batch, with respect to a per-device copy of the params (inside ``shard_map`` JAX would
        otherwise sum the gradient over the axis itself: :mod:`.mesh_step`), and the gradients come out
        as the next call takes them: a gradient algorithm's reduced ones, for any optax optimizer;
        QAdam's per device, for ``dp.optimizer()``; a weight algorithm's per device (DiLoCo's averaged in
        the node), for an optimizer per device and then :meth:`sync_params`.

        Called at jit level (outside ``pmap`` / ``shard_map``), it runs its own ``jax.shard_map`` over
        the wrap's axis of the wrap's mesh or the one of ``jax.set_mesh``: the arguments ``batch_argnums``
        names (positions in ``fun``'s arguments; default every one after the params) are batches split
        along their first axis, the others (a model's batch statistics...) the same on every device;
        the state is the one of ``dp.init()``; the params are
        replicated, except for weight algorithms, whose params are one copy per device
        (``dp.replicate(params, per_device=True)``).  The loss (and ``aux``) come out with a leading axis
        of one entry per device: ``loss.mean()`` is the global batch's loss, at the cost of one scalar
        collective where it is used.  Per-device gradients (QAdam, weight algorithms) come out the same
        way.  Inside ``pmap`` / ``shard_map`` every value is this device's own.
        """
        algorithm = self.algorithm
        grad_fn = jax.value_and_grad(fun, has_aux=has_aux)

        def on_device(params, state, *args):
            if algorithm.target is not Target.WEIGHT:  # replicated params: each device's own gradient
                params = per_device(params, self.axis_name)
            out, grads = grad_fn(params, *args)
            if algorithm.target is Target.GRAD or algorithm.averages_gradients_in_node:
                grads, state = self.reduce_gradients(grads, state)
            return out, grads, state

        def call(params, *args, state):
            if axis_bound(self.axis_name):
                out, grads, state = on_device(params, state, *args)
                return (out, grads), state
            where = "dp.value_and_grad(...)(params, ..., state=state)"
            self._check_stacked(params if algorithm.target is Target.WEIGHT else None, state, where)
            stacked, replicated = Layout.STACKED, Layout.REPLICATED
            out_layout = (stacked, stacked) if has_aux else stacked
            params_layout = stacked if algorithm.target is Target.WEIGHT else replicated
            grads_layout = replicated if algorithm.target is Target.GRAD else stacked
            mesh = step_mesh(self.mesh, self.axis_name, where)
            batches = set(range(1, len(args) + 1) if batch_argnums is None else batch_argnums)
            if not batches <= set(range(1, len(args) + 1)):
                raise BaguaXError(f"{where}: batch_argnums={tuple(batch_argnums)} names positions of fun's "
                                  f"arguments after the params, 1 to {len(args)} here")
            args_layouts = [Layout.SPLIT if i in batches else replicated for i in range(1, len(args) + 1)]
            mapped = shard_over(on_device, mesh, self.axis_name, [params_layout, stacked] + args_layouts,
                                (out_layout, grads_layout, stacked))
            out, grads, state = mapped(params, state, *args)
            return (out, grads), state

        return call

    def reduce_gradients(self, grads: Any, state: tuple) -> tuple[Any, tuple]:
        """Communicate gradients with a gradient algorithm (``Target.GRAD``).

        Call it inside the pmapped / shard_mapped step on this device's own gradients (:meth:`value_and_grad`
        is this call with the differentiation before it, and also works at jit level).  Inside ``shard_map``,
        gradients JAX types as the same on every device are refused: ``jax.grad`` with respect to params
        passed with ``P()`` has summed them over the axis already (:mod:`.mesh_step`).

        With a weight algorithm that declares ``averages_gradients_in_node`` (DiLoCo: where it runs over
        nodes, a node is one worker), the gradients averaged inside the node every step, before the
        optimizer, so a node's devices stay identical; unchanged where each device is a worker (one node
        per device, or ``shard_map``: no node groups).  The state passes through, so the step reads the
        same in either form.  Raises for any other algorithm, naming the call that communicates for it
        (module docstring).
        """
        where = "reduce_gradients"
        if self.algorithm.averages_gradients_in_node:
            if not axis_bound(self.axis_name):  # weight algorithm at jit level: per-device gradients, stacked
                self._check_stacked(grads, state, "dp.reduce_gradients(grads, state)")
                mesh = step_mesh(self.mesh, self.axis_name, "dp.reduce_gradients(grads, state)")
                return shard_over(lambda g, s: self._run(self._node_mean, [g], s, where), mesh, self.axis_name,
                                  [Layout.STACKED] * 2, (Layout.STACKED, Layout.STACKED))(grads, state)
            self._refuse_invariant(grads, where, "gradients")
            return self._run(self._node_mean, [grads], state, where)
        self._only_for(Target.GRAD, "dp.reduce_gradients(grads, state)")
        refuse_jit_level("dp.reduce_gradients(grads, state)", self.axis_name, self.algorithm)
        self._refuse_invariant(grads, where, "gradients")
        return self._run(self.algorithm.reduce, [grads], state, where)

    def sync_params(self, params: Any, state: tuple) -> tuple[Any, tuple]:
        """Communicate weights with a weight algorithm (``Target.WEIGHT``).

        Where to call it follows ``algorithm.phase``: ``BEFORE_FORWARD``
        (Decentralized) between computing gradients and applying them,
        ``AFTER_STEP`` (LowPrecisionDecentralized, ModelAverage, DiLoCo) after applying them.
        Inside the pmapped / shard_mapped step it takes this device's params (inside ``shard_map`` passed
        with ``P(axis)``: params JAX types as the same on every device are refused); at jit level, one copy
        per device stacked along a leading axis (``dp.replicate(params, per_device=True)``), and it runs
        its own ``jax.shard_map`` over the wrap's or the context's mesh (:mod:`.mesh_step`).
        Raises for any other algorithm, naming the call that communicates for it (module docstring).
        """
        call = "dp.sync_params(params, state)"
        self._only_for(Target.WEIGHT, call)
        if self._node is not None:
            raise BaguaXError(f"{call}: with fault_tolerance the exchange between nodes runs on the host: leave it "
                              "out of the jitted step and call params, opt_state, state = "
                              "dp.sync_replicas(params, opt_state, state) after each step")
        if not axis_bound(self.axis_name):
            self._check_stacked(params, state, call)
            mesh = step_mesh(self.mesh, self.axis_name, call)
            return shard_over(self.sync_params, mesh, self.axis_name, [Layout.STACKED] * 2,
                              (Layout.STACKED, Layout.STACKED))(params, state)
        self._refuse_invariant(params, "sync_params", "params")
        return self._run(self.algorithm.reduce, [params], state, "sync_params")

    def gradient_transformation(self):
        """An ``optax.GradientTransformation`` whose update is :meth:`reduce_gradients`.

        Chain it first: ``optax.chain(dp.gradient_transformation(), optax.adam(1e-3))``, inside the
        pmapped / shard_mapped step (at jit level the gradients are already XLA's mean: use
        :meth:`value_and_grad` and a plain optimizer there).
        Only for gradient algorithms: a weight algorithm communicates with
        :meth:`sync_params` and QAdam is its own optimizer (:meth:`optimizer`), so
        for them this raises instead of silently communicating nothing.
        """
        import optax

        self._only_for(Target.GRAD, "dp.gradient_transformation()")

        def update(updates, state, params=None):
            refuse_jit_level("dp.gradient_transformation()'s update", self.axis_name, self.algorithm)
            return self.reduce_gradients(updates, state)

        return optax.GradientTransformation(lambda params: self.init_state(), update)

    def optimizer(self):
        """The algorithm as the whole optimizer, an ``optax.GradientTransformation``, for algorithms that
        communicate the optimizer's momentum (``Target.MOMENTUM``: QAdam).

        Its state is the algorithm's per-bucket state (QAdam: step, momentum,
        variance), built by ``init(params)``; ``update(grads, state, params)``
        runs the algorithm's ``step`` on each bucket (QAdam: allreduced
        gradients in warmup, then 8-bit compressed momentum), so call it
        inside the pmapped / shard_mapped step.
        """
        import optax

        algorithm = self.algorithm
        self._only_for(Target.MOMENTUM, "dp.optimizer()")

        def init(params):
            leaves = self.plan.leaves(params, "optimizer init")
            return with_form(scheduled(tuple(
                storable(initial_state(algorithm, jnp.zeros((layout.padded_numel,), leaves[bucket[0]].dtype), layout,
                                       self.world_size))
                for bucket, layout in zip(self.bucket_leaves, self.layouts)
            ), algorithm), self._forms)

        def update(grads, state, params=None):
            if params is None:
                raise BaguaXError(f"dp.optimizer(): call update(grads, state, params); {type(algorithm).__name__} "
                                  "needs the params")
            if not axis_bound(self.axis_name):  # per-device gradients (dp.value_and_grad), replicated params
                call = "dp.optimizer()'s update"
                self._check_stacked(grads, state, call)
                mesh = step_mesh(self.mesh, self.axis_name, call)
                return shard_over(update, mesh, self.axis_name,
                                  [Layout.STACKED, Layout.STACKED, Layout.REPLICATED],
                                  (Layout.REPLICATED, Layout.STACKED))(grads, state, params)
            self._refuse_invariant(grads, "optimizer update", "gradients")
            return self._run(algorithm.step, [grads, params], state, "optimizer update")

        return optax.GradientTransformation(init, update)

    # -- around the step, on the host ----------------------------------------------------------
    def sync_replicas(self, params: Any, opt_state: Any, state: tuple) -> tuple[Any, Any, tuple]:
        """With ``fault_tolerance``: DiLoCo's exchange between nodes, on the host, after each inner step (a
        jitted step that averages gradients over this node's devices: :meth:`value_and_grad`).

        ``params, opt_state, state = dp.sync_replicas(params, opt_state, state)``, all three as the step
        returns them (params one copy per device).  At an outer step: the quorum, healing this node from a
        live one if it is behind (which replaces all three), the exchange over the live nodes, and the vote;
        a step that some node could not complete returns the inputs unchanged and is retried at the next
        call.  Between outer steps it only advances the algorithm's step counter, on the devices.
        (:mod:`.fault_tolerance`.)
        """
        if self._node is None:
            raise BaguaXError("dp.sync_replicas: this wrap has no fault_tolerance; pass "
                              "wrap(..., fault_tolerance=bagua_x.ft.FaultTolerance()), or call dp.sync_params in "
                              "the step")
        return self._node.sync(params, opt_state, state)

    @property
    def replicas(self):
        """With ``fault_tolerance``: the node's :class:`bagua_x.ft.Replicas` (``keep(key, save, load)`` for
        state a healing node takes, such as the data position; ``manager``, torchft's); else None."""
        return self._node.replicas if self._node is not None else None

    def shutdown(self) -> None:
        """Stop the torchft manager of ``fault_tolerance`` (nothing to do without it)."""
        if self._node is not None:
            self._node.replicas.shutdown()

    def step(self, fn: Callable) -> Callable:
        """``fn`` (the pmapped / jitted training step) with this wrap's host-side work around each call
        (:mod:`.step`).

        ``train_step = dp.step(jax.pmap(step, axis_name="batch"))``.  Each call
        waits for the step's results (``jax.block_until_ready``).  With ``wrap(timeout=...)`` a watchdog
        (:mod:`.watchdog`) ends the process with a report when a step takes
        longer (the first, compiling step: ``first_step_timeout``); a step whose
        program fails (e.g. a peer's connection closed) raises a BaguaXError
        naming the step and the processes that never arrived; any other
        exception, Ctrl-C included, ends the step and reaches the caller unchanged;
        with ``check_finite=True`` a non-finite reduction raises its BaguaXError
        (instead of JAX's ``JaxRuntimeError`` around it).

        Where the algorithm branches on its step counter (``Algorithm.branch_key``), the host reads the
        counter before each call and the step is compiled once per key, each program holding its branch
        alone (:mod:`.schedule`).  Where the form is open (``hierarchical=None`` on node groups), the first
        12 steps through it are a trial: it sets the form of this wrap's bagua_x states among ``fn``'s
        arguments (static: each form compiled once, alone), times each step, and then keeps the form the
        slowest process's median step favours, logged (:class:`~.node_form.StepForms`); until then, and in
        steps not run through ``dp.step``, the step runs flat.  A call whose arguments hold none of the
        states (an evaluation) or that raises is not a step of the trial; another wrap's states pass
        unchanged (drive them with its ``step`` too: ``a.step(b.step(fn))``).  With none of these it
        returns ``fn`` unchanged.
        """
        return self._guard.guard(fn)

    # -- internals ------------------------------------------------------------------------------
    def _check_step_mesh(self, mesh: jax.sharding.Mesh, call: str) -> None:
        """Raise where ``mesh`` is not the one the step shards over (the wrap's, else ``jax.set_mesh``'s):
        JAX would refuse arrays laid out on it at the step's first call, naming devices, not the cause."""
        step, which = (self.mesh, "the wrap's") if self.mesh is not None else (context_mesh(self.axis_name),
                                                                                 "the one of jax.set_mesh")
        if step is None or mesh == step:
            return
        raise BaguaXError(
            f"{call}: mesh= {_describe_mesh(mesh)} is not the mesh the step shards over, {which}: "
            f"{_describe_mesh(step)}; the step's arrays must be laid out on its mesh: pass no mesh (the step's is "
            "taken), or the same mesh to wrap(mesh=...) / jax.set_mesh and here"
        )

    def _only_for(self, target: Target, call: str) -> None:
        """Raise unless this wrap's algorithm communicates ``target``: ``call`` would communicate nothing."""
        algorithm = self.algorithm
        if algorithm.target is target:
            return
        instead = {
            Target.GRAD: "grads, state = dp.reduce_gradients(grads, state) before the optimizer, or "
                         "optax.chain(dp.gradient_transformation(), <optax optimizer>)",
            Target.WEIGHT: f"params, state = dp.sync_params(params, state) in the step ({algorithm.phase.value}) "
                           "with a plain optax optimizer",
            Target.MOMENTUM: "dp.optimizer() as the whole optimizer",
        }[algorithm.target]
        raise BaguaXError(
            f"{call}: {algorithm!r} communicates {algorithm.target.value}s, not {target.value}s, so this call "
            f"would communicate nothing; use {instead}"
        )

    def _refuse_invariant(self, tree: Any, where: str, what: str) -> None:
        if len(jax.tree_util.tree_leaves(tree)) == len(self.names):
            leaves, names, _ = self.plan.registered_leaves(tree)
            refuse_invariant(leaves, names, self.axis_name, self.algorithm, where, what)

    def _check_stacked(self, tree: Any, state: Any, call: str) -> None:
        """At jit level: ``tree`` and the state one copy per device (``tree`` None: the state only)."""
        devices = mesh_axis_size(step_mesh(self.mesh, self.axis_name, call), self.axis_name)
        if tree is not None:
            check_stacked(*self.plan.registered_leaves(tree), devices, self.axis_name, self.algorithm, call)
        check_state_stacked(state, devices, self.axis_name, call)

    def _node_mean(self, flat, layout, state, comm):
        """The node's mean of ``flat`` where the algorithm runs over nodes (the communicator offers node groups
        and the algorithm uses them), else ``flat``: the gradient step of a node that is one worker.  With
        fault_tolerance the node is this process's devices: the whole axis."""
        if self._node is not None:
            return comm.allreduce(flat, ReduceOp.AVG).astype(flat.dtype), state
        if Feature.HIERARCHICAL in self.algorithm.uses and Feature.HIERARCHICAL in comm.features:
            flat = comm.within.allreduce(flat, ReduceOp.AVG).astype(flat.dtype)
        return flat, state

    def _run(self, fn, trees: list, state: tuple, where: str) -> tuple[Any, tuple]:
        """``fn(flat, *more_flats, layout, bucket_state, comm) -> (flat, bucket_state)`` on every bucket of ``trees``.

        The result replaces the first tree's registered leaves; other leaves pass through.
        """
        comm = AxisCommunicator(self.axis_name, self.devices_per_node)
        if Feature.HIERARCHICAL in self.algorithm.requires and comm.node_problem():
            # raised while tracing, before any collective, on every process alike: they trace one program
            # with settings wrap checked to be the same everywhere
            raise BaguaXError(
                f"{where}: {self.algorithm!r} asks for hierarchical=True, but {comm.node_problem()}; or pass "
                "hierarchical=None (two levels where there are node groups, else flat) or hierarchical=False"
            )
        if self._forms is not None:  # tracing: whether the step holds both forms, for dp.step's trial
            self._forms.forms_in_step = Feature.HIERARCHICAL in comm.features
        leaves = [self.plan.leaves(t, where, floats=True) for t in trees]
        if not isinstance(state, (tuple, list)) or len(state) != len(self.bucket_leaves):
            raise BaguaXError(
                f"{where}: expected the state of this wrap (a tuple of {len(self.bucket_leaves)} bucket states), got "
                f"{type(state).__name__}; pass the state from dp.init() or from the transformation's init"
            )
        out, new_state = list(leaves[0]), []
        for bucket, layout, st in zip(self.bucket_leaves, self.layouts, state):
            if not self.pack_buckets:
                for i in bucket:  # one leaf is a bucket of its own
                    out[i], st = run_in_form(fn, [ls[i] for ls in leaves], self.plan.leaf_layout(i), st, comm,
                                             self.algorithm)
            else:
                if layout.padded_numel % self.algorithm.alignment(comm.size):
                    raise BaguaXError(
                        f"{where}: the bucket starting with {layout.names[0]!r} is padded to {layout.padded_numel} "
                        f"elements for world size {self.world_size}, not a multiple of axis {self.axis_name!r}'s "
                        f"size {comm.size}; pass world_size={comm.size} to wrap"
                    )
                flats = [layout.pack([ls[i] for i in bucket], xp=jnp) for ls in leaves]
                flat, st = run_in_form(fn, flats, layout, st, comm, self.algorithm)
                for i, value in zip(bucket, layout.unpack(flat, xp=jnp)):
                    out[i] = value.astype(self.plan.dtypes[i])
            new_state.append(st)
        if self._finite is not None:
            self._finite.insert(out, self.plan.registered, self.axis_name, where)
        return jax.tree_util.tree_unflatten(self.plan.treedef, out), tuple(new_state)


def _describe_mesh(mesh: jax.sharding.Mesh) -> str:
    return f"(axes {dict(mesh.shape)}, devices {[d.id for d in mesh.devices.flat]})"


def wrap(params: Any, **settings: Any) -> DataParallel:
    """Make a params pytree data parallel: ``DataParallel(params, **settings)``, the keywords of
    :class:`DataParallel` (``algorithm``, ``axis_name``, ``mesh``, ``timeout``...)."""
    return DataParallel(params, **settings)


wrap.__signature__ = inspect.signature(DataParallel)  # help() and editors show DataParallel's keywords
