"""Megatron-LM's learning-rate schedule: linear warmup, then constant, linear or cosine decay."""

from __future__ import annotations

import math

from hybrid.errors import ConfigError


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
    """A scheduler DeepSpeed can drive (`step()` after each optimizer step) and checkpoint.

    As Megatron-LM's OptimizerParamScheduler it counts samples (or, for Megatron-DeepSpeed's
    token-based flags, tokens): each optimizer step advances it by `units_per_step`, the global
    batch (x sequence length), which the trainer updates when --rampup-batch-size changes it.
    """

    def __init__(self, optimizer, max_lr, min_lr, warmup_steps, decay_steps, style, unit: str = "samples",
                 units_per_step: int = 1):
        self.optimizer = optimizer
        self.max_lr, self.min_lr, self.warmup_steps, self.decay_steps, self.style = (
            max_lr, min_lr, warmup_steps, decay_steps, style)
        self.unit, self.units_per_step = unit, units_per_step
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

    def step(self, increment=None) -> None:
        self.num_steps += self.units_per_step if increment is None else increment
        self._apply()

    def set_position(self, num_steps: int) -> None:
        """Move the schedule to `num_steps` units (a resume that restores no scheduler state)."""
        self.num_steps = int(num_steps)
        self._apply()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "unit": self.unit}

    def load_state_dict(self, state: dict) -> None:
        if "unit" not in state:  # saved before schedules counted samples: its steps were iterations
            self.num_steps = int(state["num_steps"]) * self.units_per_step
        elif state["unit"] != self.unit:
            raise ConfigError(f"the checkpoint's LR schedule counts {state['unit']}, this run's flags count "
                              f"{self.unit}; use the same --lr-*-tokens or --lr-*-samples/--lr-*-iters flags.")
        else:
            self.num_steps = int(state["num_steps"])
        self._apply()
