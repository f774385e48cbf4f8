"""bagua_x as a Lightning strategy: ``Trainer(strategy=BaguaXStrategy(algorithm=ByteGrad()))``.

The one-line change from Lightning's DDP::

    from bagua_x.algorithms import ByteGrad
    from bagua_x.torch.integrations.lightning import BaguaXStrategy

    trainer = lightning.Trainer(strategy=BaguaXStrategy(algorithm=ByteGrad()), accelerator="cpu", devices=2)

It is Lightning's ``DDPStrategy`` (same launcher, process group, samplers and
collectives) with the model wrapped by :func:`bagua_x.torch.wrap` instead of
``DistributedDataParallel``.  Every algorithm runs: gradient ones during
backward, Decentralized around forward/backward, LowPrecisionDecentralized,
ModelAverage and AsyncModelAverage after ``optimizer.step()``.  QAdam is an
optimizer: return ``bagua_x.torch.QAdamOptimizer(self.parameters(), lr=...,
warmup_steps=...)`` from ``configure_optimizers`` and leave ``algorithm``
unset (the strategy then takes QAdam from the optimizer, as wrap() does).
Other keywords are DDP's and go to wrap() (``find_unused_parameters``,
``bucket_cap_mb``, ``broadcast_buffers``, ``static_graph``...), plus wrap's
``timeout`` and ``check_finite`` through ``wrap_kwargs``.

What differs from DDPStrategy, and why:

* The optimizer is created *before* wrapping (DDPStrategy creates it after):
  weight and momentum algorithms hook ``optimizer.step()``.  One optimizer
  per module (wrap takes one).
* bagua_x communicates on its own process group (wrap makes one from the
  default group, or from ``process_group=``), so its communication thread
  never interleaves collectives with the ones Lightning issues meanwhile
  (``self.log(..., sync_dist=True)`` during an exchange, barriers, broadcasts).
  Hierarchical variants see Lightning's nodes (``num_nodes`` nodes of
  ``devices`` ranks): ``hierarchical=None`` runs in the faster form, timed, with
  >= 2 nodes of >= 2 ranks, as under wrap().
* Gradient accumulation (``accumulate_grad_batches``) skips communication on
  the micro-batches that are not followed by a step, as DDP's ``no_sync``:
  every algorithm communicates once per optimizer step.
* Checkpoints (Lightning's own, e.g. ``ModelCheckpoint``) also hold each
  rank's algorithm state (``algorithm_state_dict()``) and, for weight
  algorithms (ranks' weights differ by design), its model and optimizer state:
  every rank writes its own file next to the checkpoint
  (``<checkpoint>.bagua_x-rank<r>``, through Lightning's ``checkpoint_io``),
  so nothing travels between ranks and nothing is unpickled from the network.
  Resume needs those files beside the checkpoint.  The strategy restores them
  after wrapping (wrap copies rank 0's weights), so a resumed run continues as
  the uninterrupted one.
* Validation, test and predict steps call the LightningModule directly: no
  exchange is started by a forward that has no backward.
"""

import logging
from contextlib import contextmanager
from typing import Any, Generator, Mapping, Optional

import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from ...algorithms.base import Algorithm, Target
from ...core.errors import BaguaXError
from ..wrap import DistributedModel, wrap

__all__ = ["BaguaXStrategy", "rank_file"]

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "bagua_x"


class BaguaXStrategy(DDPStrategy):
    """Lightning's DDP strategy with the model wrapped by bagua_x (see the module docstring)."""

    strategy_name = "bagua_x"

    def __init__(self, algorithm: Optional[Algorithm] = None, wrap_kwargs: Optional[dict] = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.algorithm = algorithm
        self._wrap_kwargs = dict(wrap_kwargs or {})
        self._wrapped: Optional[DistributedModel] = None

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore after wrapping: wrap() copies rank 0's weights over each rank's, which are then loaded."""
        return True

    # -- wrapping ---------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        """DDPStrategy.setup, with the optimizer created before the model is wrapped."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            _optimizers_to_device(self.optimizers, self.root_device)
            self.configure_ddp()
        else:
            _sync_module_states(self.model)  # not wrapped: nothing to communicate but rank 0's weights
        self.setup_precision_plugin()

    def configure_ddp(self) -> None:
        self.model = self._setup_model(self.model)

    def _setup_model(self, model: torch.nn.Module) -> DistributedModel:
        if len(self.optimizers) > 1:
            raise BaguaXError(
                f"BaguaXStrategy: configure_optimizers returned {len(self.optimizers)} optimizers; bagua_x wraps a "
                "module with one optimizer (its weight and momentum algorithms hook optimizer.step()): use one"
            )
        optimizer = self.optimizers[0] if self.optimizers else None
        kwargs = {"local_world_size": self.num_processes, **self._ddp_kwargs, **self._wrap_kwargs}
        self._wrapped = wrap(model, optimizer, algorithm=self.algorithm, **kwargs)
        log.info("BaguaXStrategy: %s", type(self._wrapped.algorithm).__name__)
        return self._wrapped

    def teardown(self) -> None:
        if self._wrapped is not None:
            self._wrapped.shutdown()  # hooks removed, threads stopped (AsyncModelAverage's averaging included)
            self.model, self._wrapped = self.lightning_module, None
        super().teardown()

    # -- gradient accumulation -----------------------------------------------------------------
    @contextmanager
    def block_backward_sync(self) -> Generator:
        """Lightning's gradient accumulation: no communication on a micro-batch without a step.

        Lightning's own version calls ``no_sync`` on a model that passes its
        DDP check (in Lightning 2.6 a structural one, which bagua_x's wrapper
        passes by having ``no_sync``); this one does not depend on that check.
        Gradients (QAdam: the moments' inputs) accumulate locally and weights
        stay put until the micro-batch before the step.
        """
        if self._wrapped is None:
            yield
        else:
            with self._wrapped.no_sync():
                yield

    # -- steps without backward ---------------------------------------------------------------
    def validation_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.test_step_context():
            return self.lightning_module.test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.predict_step_context():
            return self.lightning_module.predict_step(*args, **kwargs)

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Optional[Any] = None) -> None:
        """Lightning calls it on every rank: each writes its own bagua_x state beside the checkpoint."""
        if self._wrapped is not None:
            mine = {"algorithm_state": self._wrapped.algorithm_state_dict()}
            if self._wrapped.algorithm.target is Target.WEIGHT:
                mine["state_dict"] = checkpoint["state_dict"]
                mine["optimizer_states"] = checkpoint.get("optimizer_states", [])
            self.checkpoint_io.save_checkpoint(mine, rank_file(filepath, self.global_rank), storage_options)
            checkpoint = {**checkpoint, CHECKPOINT_KEY: {
                "algorithm": self._wrapped.algorithm.hyperparameters(), "world_size": self.world_size}}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def remove_checkpoint(self, filepath) -> None:
        super().remove_checkpoint(filepath)
        if self._wrapped is not None:
            self.checkpoint_io.remove_checkpoint(rank_file(filepath, self.global_rank))

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict:
        """The checkpoint, with this rank's bagua_x state from its own file under ``CHECKPOINT_KEY``."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None or self._wrapped is None:
            return checkpoint
        if saved["world_size"] != self.world_size:
            raise BaguaXError(
                f"the checkpoint {checkpoint_path} holds bagua_x state of {saved['world_size']} ranks, but this run "
                f"has {self.world_size}; resume with the same number of ranks"
            )
        if saved["algorithm"] != self._wrapped.algorithm.hyperparameters():
            raise BaguaXError(
                f"the checkpoint {checkpoint_path} was saved with {saved['algorithm']}, this run uses "
                f"{self._wrapped.algorithm.hyperparameters()}; resume with the same algorithm"
            )
        path = rank_file(checkpoint_path, self.global_rank)
        try:
            mine = self.checkpoint_io.load_checkpoint(path, weights_only=True)  # tensors and plain values only
        except FileNotFoundError:
            raise BaguaXError(
                f"rank {self.global_rank}'s bagua_x state {path} is missing: every rank saves its own file beside "
                f"the checkpoint; copy them all with {checkpoint_path}"
            ) from None
        return {**checkpoint, CHECKPOINT_KEY: {**saved, "rank": mine}}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        mine = checkpoint.get(CHECKPOINT_KEY, {}).get("rank")
        if mine is None or self._wrapped is None:
            super().load_model_state_dict(checkpoint, strict)
            return
        self.lightning_module.load_state_dict(mine.get("state_dict", checkpoint["state_dict"]), strict=strict)
        self._wrapped.load_algorithm_state_dict(mine["algorithm_state"])

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        mine = checkpoint.get(CHECKPOINT_KEY, {}).get("rank")
        if mine is not None and "optimizer_states" in mine:
            checkpoint = {**checkpoint, "optimizer_states": mine["optimizer_states"]}
        super().load_optimizer_state_dict(checkpoint)


def rank_file(checkpoint_path, rank: int) -> str:
    """Where ``rank`` keeps its bagua_x state for the checkpoint at ``checkpoint_path`` (not ``*.ckpt``:
    Lightning's searches for checkpoints do not pick it up)."""
    return f"{checkpoint_path}.bagua_x-rank{rank}"
