"""Megatron-LM's learning-rate schedule: linear warmup, then constant, linear or cosine decay."""

from __future__ import annotations

import math


def megatron_lr(step: int, max_lr: float, min_lr: float, warmup_steps: int, decay_steps: int, style: str) -> float:
    """The learning rate after `step` optimizer steps (Megatron's OptimizerParamScheduler.get_lr):
    warmup from 0 (so the first iteration of a warmup runs at lr 0, as in Megatron-LM)."""
    if warmup_steps > 0 and step <= warmup_steps:
        return max_lr * step / warmup_steps
    if style == "constant":
        return max_lr
    if step > decay_steps:
        return min_lr
    ratio = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"unknown --lr-decay-style {style}")
    return min_lr + coeff * (max_lr - min_lr)


class MegatronLRScheduler:
    """A scheduler DeepSpeed can drive (`step()` after each optimizer step) and checkpoint."""

    def __init__(self, optimizer, max_lr, min_lr, warmup_steps, decay_steps, style):
        self.optimizer = optimizer
        self.max_lr, self.min_lr, self.warmup_steps, self.decay_steps, self.style = (
            max_lr, min_lr, warmup_steps, decay_steps, style)
        self.num_steps = 0
        self._apply()

    def get_lr(self) -> list[float]:
        lr = megatron_lr(self.num_steps, self.max_lr, self.min_lr, self.warmup_steps, self.decay_steps, self.style)
        return [lr for _ in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        self._apply()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        self._apply()
