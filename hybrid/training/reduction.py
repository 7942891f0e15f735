"""How losses are combined over micro-batches and data-parallel ranks (see hybrid.training.steps):
the DP mean of logged losses and `--calculate-per-token-loss`'s per-iteration scale."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid.parallel.cross_entropy import IGNORE_INDEX


def dp_mean(values: torch.Tensor, topology) -> torch.Tensor:
    """Mean over the DP group of per-rank values (a device tensor; no host sync here)."""
    values = values.detach().float().clone()
    if topology.dp_world_size > 1:
        dist.all_reduce(values, group=topology.dp_group)
        values /= topology.dp_world_size
    return values


class PerTokenScale:
    """`--calculate-per-token-loss`: the factor GAS x DP / N by which each micro-batch's token sum is
    multiplied, N the valid tokens of the whole iteration over every DP rank (see the module docstring)."""

    def __init__(self, topology, device):
        self.topology, self.device = topology, device

    def __call__(self, micro_batches: list) -> torch.Tensor:
        local = torch.stack([(labels != IGNORE_INDEX).sum() for _, labels in micro_batches]).sum()
        total = local.to(self.device, torch.float32).reshape(1)
        dp = self.topology.dp_world_size  # DP x CP: every CP rank counted its samples' whole labels
        if dp > 1:
            dist.all_reduce(total, group=self.topology.dp_group)
        total = total / self.topology.sequence_world_size
        return (len(micro_batches) * dp / total.clamp(min=1.0)).reshape(())


def take(batches, count: int) -> list:
    """The next `count` micro-batches of an iterator, as a list."""
    return [next(batches) for _ in range(count)]
