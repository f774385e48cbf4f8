"""bagua_x as a Lightning strategy: ``Trainer(strategy=BaguaXStrategy(algorithm=ByteGrad()))``.

The one-line change from Lightning's DDP::

    from bagua_x.algorithms import ByteGrad
    from bagua_x.torch.lightning import BaguaXStrategy

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
* bagua_x communicates on its own process group, made from the default one,
  so its communication thread never interleaves collectives with the ones
  Lightning issues meanwhile (``self.log(..., sync_dist=True)`` during an
  exchange, barriers, broadcasts).  Pass ``process_group=`` to choose it
  (hierarchical algorithms need ``process_group=None``, the default group).
* Checkpoints (Lightning's own, e.g. ``ModelCheckpoint``) also hold every
  rank's algorithm state (``algorithm_state_dict()``) under ``"bagua_x"``; for
  weight algorithms (ranks' weights differ by design) every rank's model and
  optimizer state too.  The strategy restores them after wrapping (wrap copies
  rank 0's weights), so a resumed run continues as the uninterrupted one.
* Validation, test and predict steps call the LightningModule directly: no
  exchange is started by a forward that has no backward.
"""

import logging
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from ..algorithms.base import Algorithm, Target
from ..core.errors import BaguaXError
from .wrap import DistributedModel, wrap

__all__ = ["BaguaXStrategy"]

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
        kwargs = {**self._ddp_kwargs, **self._wrap_kwargs}
        if "process_group" not in kwargs:
            kwargs["process_group"] = dist.new_group(backend=dist.get_backend())  # collective: every rank
        self._wrapped = wrap(model, optimizer, algorithm=self.algorithm, **kwargs)
        log.info("BaguaXStrategy: %s", type(self._wrapped.algorithm).__name__)
        return self._wrapped

    def teardown(self) -> None:
        if self._wrapped is not None:
            self._wrapped.shutdown()  # hooks removed, threads stopped (AsyncModelAverage's averaging included)
            self.model, self._wrapped = self.lightning_module, None
        super().teardown()

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
        """Collective (Lightning calls it on every rank): rank 0 writes every rank's bagua_x state along."""
        if self._wrapped is not None:
            mine = {"algorithm_state": self._wrapped.algorithm_state_dict()}
            if self._wrapped.algorithm.target is Target.WEIGHT:
                mine["state_dict"] = checkpoint["state_dict"]
                mine["optimizer_states"] = checkpoint.get("optimizer_states", [])
            ranks = [None] * self.world_size if self.is_global_zero else None
            dist.gather_object(mine, ranks, dst=0)
            if self.is_global_zero:
                checkpoint = {**checkpoint, CHECKPOINT_KEY: {
                    "algorithm": self._wrapped.algorithm.hyperparameters(), "ranks": ranks}}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def _saved_rank(self, checkpoint: Mapping[str, Any]) -> Optional[dict]:
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None or self._wrapped is None:
            return None
        if len(saved["ranks"]) != self.world_size:
            raise BaguaXError(
                f"the checkpoint holds bagua_x state of {len(saved['ranks'])} ranks, but this run has "
                f"{self.world_size}; resume with the same number of ranks"
            )
        if saved["algorithm"] != self._wrapped.algorithm.hyperparameters():
            raise BaguaXError(
                f"the checkpoint was saved with {saved['algorithm']}, this run uses "
                f"{self._wrapped.algorithm.hyperparameters()}; resume with the same algorithm"
            )
        return saved["ranks"][self.global_rank]

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        mine = self._saved_rank(checkpoint)
        if mine is None:
            super().load_model_state_dict(checkpoint, strict)
            return
        self.lightning_module.load_state_dict(mine.get("state_dict", checkpoint["state_dict"]), strict=strict)
        self._wrapped.load_algorithm_state_dict(mine["algorithm_state"])

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        mine = self._saved_rank(checkpoint)
        if mine is not None and "optimizer_states" in mine:
            checkpoint = {**checkpoint, "optimizer_states": mine["optimizer_states"]}
        super().load_optimizer_state_dict(checkpoint)
