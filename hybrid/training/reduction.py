"""How losses are combined over micro-batches and data-parallel ranks (see hybrid.training.runtime):
the DP mean of logged losses and the per-token (per-pair) per-iteration scale."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def dp_mean(values: torch.Tensor, groups) -> torch.Tensor:
    """Mean over the DP x CP ranks of per-rank values (a device tensor; no host sync here): each CP rank's
    micro-batch loss is its part of the whole sequences' mean already scaled by CP (hybrid.model.loss)."""
    values = values.detach().float().clone()
    if groups.dp_cp.size > 1:
        dist.all_reduce(values, group=groups.dp_cp.group)
        values /= groups.dp_cp.size
    return values


class ItemScale:
    """The iteration's loss as a mean over items (--calculate-per-token-loss: tokens; --dpo: pairs) of the whole
    global batch: the factor GAS x DP / N by which each micro-batch's item sum is multiplied, N the items
    (`objective.count`) of the iteration's micro-batches on every DP rank, counted on the device before the first
    forward (one small all-reduce, no host sync), so the mean over micro-batches and DeepSpeed's DP average
    give exactly the sum over items / N. Every CP rank counts its samples' whole labels: the count is divided
    by the objective's `sequence_factor`."""

    def __init__(self, objective, groups, device):
        self.objective, self.groups, self.device = objective, groups, device

    def __call__(self, micro_batches: list) -> torch.Tensor:
        local = torch.stack([self.objective.count(ids, labels) for ids, labels, *_ in micro_batches]).sum()
        total = local.to(self.device, torch.float32).reshape(1)
        dp_cp = self.groups.dp_cp.size
        if dp_cp > 1:
            dist.all_reduce(total, group=self.groups.dp_cp.group)
        total = total / self.objective.sequence_factor(self.groups.sequence_split)
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
