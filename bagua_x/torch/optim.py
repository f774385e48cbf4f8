"""``QAdamOptimizer``: Adam whose momentum bagua_x communicates, 8-bit, once warmup is over.

The optimizer keeps the moments and applies the update; wrapping the model
with it (``wrap(model, opt)``) picks the engine that communicates them
(:mod:`.engine.momentum`): allreduced gradients during warmup, then each
parameter's ``exp_avg``, compressed.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from ..algorithms import QAdam

__all__ = ["QAdamOptimizer"]


class QAdamOptimizer(torch.optim.Optimizer):
    """Adam whose momentum bagua_x communicates (8-bit) after ``warmup_steps``; use with ``wrap()``."""

    def __init__(self, params: Iterable, lr: float = 1e-3, warmup_steps: int = 100,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 hierarchical: Optional[bool] = None):
        self.algorithm = QAdam(lr=lr, warmup_steps=warmup_steps, betas=tuple(betas), eps=eps,
                               weight_decay=weight_decay, hierarchical=hierarchical)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.step_id = 0  # completed steps
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                self.state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def state_dict(self):
        return {**super().state_dict(), "step_id": self.step_id}

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        self.step_id = int(state_dict.pop("step_id", 0))
        super().load_state_dict(state_dict)

    @property
    def in_warmup(self) -> bool:
        """Whether the coming step communicates gradients (else momentum)."""
        return self.algorithm.is_warmup(self.step_id + 1)

    def decayed_grad(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        g = p.grad
        return g + group["weight_decay"] * p.detach() if group["weight_decay"] else g

    @torch.no_grad()
    def step(self, closure=None):
        """Adam's update (the formula of :func:`~bagua_x.algorithms.qadam.adam_direction`) with torch's
        multi-tensor ops, in place: the Array API form's per-tensor passes made the step several times
        slower (measured on the docs' Performance page)."""
        loss = closure() if closure is not None else None
        warmup = self.in_warmup
        self.step_id += 1
        t = self.step_id
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            ms = [self.state[p]["exp_avg"] for p in params]  # in place: the state tensors may be bucket views
            vs = [self.state[p]["exp_avg_sq"] for p in params]
            if warmup:  # grads are already averaged: plain Adam
                gs = [self.decayed_grad(p, group) for p in params]
                torch._foreach_mul_(ms, beta1)
                torch._foreach_add_(ms, gs, alpha=1 - beta1)
                torch._foreach_mul_(vs, beta2)
                torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
            denom = torch._foreach_sqrt(vs)
            torch._foreach_div_(denom, (1 - beta2**t) ** 0.5)
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_addcdiv_(params, ms, denom, value=-group["lr"] / (1 - beta1**t))
        return loss
