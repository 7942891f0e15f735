"""How losses are combined over micro-batches and data-parallel ranks (see hybrid.training.steps):
the DP mean of logged losses and `--calculate-per-token-loss`'s per-iteration scale."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from hybrid.model.preference import pairs_in
from hybrid.parallel.cross_entropy import IGNORE_INDEX


def dp_mean(values: torch.Tensor, groups) -> torch.Tensor:
    """Mean over the DP x CP ranks of per-rank values (a device tensor; no host sync here): each CP rank's
    micro-batch loss is its part of the whole sequences' mean already scaled by CP (hybrid.model.loss)."""
    values = values.detach().float().clone()
    if groups.dp_cp.size > 1:
        dist.all_reduce(values, group=groups.dp_cp.group)
        values /= groups.dp_cp.size
    return values


class PerTokenScale:
    """`--calculate-per-token-loss`: the factor GAS x DP / N by which each micro-batch's token sum is
    multiplied, N the valid tokens of the whole iteration over every DP rank (see the module docstring)."""

    def __init__(self, groups, device):
        self.groups, self.device = groups, device

    def count(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """What the iteration's loss is a mean over, in one micro-batch: its valid tokens."""
        return (labels != IGNORE_INDEX).sum()

    def __call__(self, micro_batches: list) -> torch.Tensor:
        local = torch.stack([self.count(ids, labels) for ids, labels, *_ in micro_batches]).sum()
        total = local.to(self.device, torch.float32).reshape(1)
        dp_cp = self.groups.dp_cp.size  # every CP rank counted its samples' whole labels
        if dp_cp > 1:
            dist.all_reduce(total, group=self.groups.dp_cp.group)
        total = total / self.groups.sequence_split
        return (len(micro_batches) * dp_cp / total.clamp(min=1.0)).reshape(())


def reduce_interval(step, losses: list, norm_flags: Optional[list] = None) -> list[float]:
    """Pending per-iteration losses as their DP means (`step.reduce`: the layout's rule) and, given, their
    gradient norms' finiteness flags (global norms: the same on every rank, no reduction): one collective
    and one host sync for a whole log interval."""
    stacked = step.reduce(torch.stack([loss.float().reshape(()) for loss in losses]))
    if norm_flags is not None:
        flags = torch.stack([torch.as_tensor(f, device=stacked.device).float().reshape(()) for f in norm_flags])
        stacked = torch.cat([stacked, flags])
    return stacked.tolist()


def take(batches, count: int) -> list:
    """The next `count` micro-batches of an iterator, as a list."""
    return [next(batches) for _ in range(count)]


class PerPairScale(PerTokenScale):
    """--dpo: the same factor with preference pairs in place of tokens (the loss is the mean over the pairs of
    the iteration; hybrid.model.preference)."""

    def __init__(self, groups, device, separator: int):
        super().__init__(groups, device)
        self.separator = separator

    def count(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return pairs_in(ids, labels, self.separator)

    def __call__(self, micro_batches: list) -> torch.Tensor:
        # A token's loss is on one sequence rank, a pair's on all of them (their parts are summed before the
        # loss): each rank's share is the whole, so the CP / Ulysses factor of the token case is taken out.
        return super().__call__(micro_batches) / self.groups.sequence_split
