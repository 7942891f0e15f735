"""--grpo's mathematics, as TRL's GRPOTrainer (1.16) computes it: group-normalized advantages of the rewards, the
clipped surrogate on each completion token's probability ratio to the policy that sampled it, the optional KL to
the frozen starting policy, and the loss aggregated per sequence (GRPO), per token (DAPO) or by a constant
(Dr. GRPO).

Each training row is one completion: its prompt, then its tokens, right-padded; the labels take the completion's
tokens only. The per-row values (advantage, the sampler's log-probabilities, the reference's) ride with the row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.parallel.cross_entropy import IGNORE_INDEX

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")


@dataclass(frozen=True)
class GRPOOptions:
    """TRL's GRPOConfig fields of the same meaning (TRL's name in the comment)."""

    group_size: int = 8  # num_generations: completions per prompt
    epsilon: float = 0.2  # epsilon (epsilon_low)
    epsilon_high: Optional[float] = None  # epsilon_high (DAPO's clip-higher); None: epsilon
    beta: float = 0.0  # beta: the KL weight (0: no reference model)
    loss_type: str = "dapo"  # loss_type: grpo | dapo | dr_grpo | bnpo
    scale_rewards: str = "group"  # scale_rewards: group | batch | none (Dr. GRPO)
    iterations: int = 1  # num_iterations: optimizer steps on each generation batch
    max_new_tokens: int = 64  # max_completion_length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    reward_functions: tuple = ()  # "FILE.py:NAME" each
    reward_weights: tuple = ()  # one per function (default 1 each)

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def advantages(rewards: torch.Tensor, group_size: int, scale: str, batch_std=None) -> torch.Tensor:
    """Rewards [n] (groups of `group_size` consecutive completions of one prompt; NaN where no function scored one)
    -> advantages [n]: reward minus its group's mean, divided by the group's (or the batch's) standard deviation
    + 1e-4 unless `scale` is none (TRL's formula; the training rows take a NaN advantage as 0: no signal).
    `batch_std`: the whole generation batch's std where these rewards are one data-parallel rank's part."""
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
    out = rewards - mean
    if scale == "group":
        out = out / (nanstd(grouped, 1).repeat_interleave(group_size) + 1e-4)
    elif scale == "batch":
        out = out / ((nanstd(rewards) if batch_std is None else batch_std) + 1e-4)
    return out


def nanstd(values: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """TRL's nanstd: the mean square deviation over the non-NaN entries times count / (count - 1) (NaN for one)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim)
    count = (~torch.isnan(values)).sum(dim=dim)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    return (variance * correction).sqrt()


def policy_loss(logps, old, reference, advantage, mask, options: GRPOOptions, scale: Optional[torch.Tensor],
                fresh: Optional[torch.Tensor] = None, sampled: Optional[torch.Tensor] = None):
    """The micro-batch's loss (TRL's _compute_loss, importance sampling per token) and its statistics.

    logps, old, reference [b, s] (reference None when beta is 0), advantage [b], mask [b, s] bool. `scale`: the
    runtime's factor for a mean over the global batch's items (hybrid.model.objectives.GroupPolicy.count); None
    takes the micro-batch's own mean. `fresh` [b] bool: the rows the sampler made with the trainer's current
    weights, where the mismatch between the trainer's log-probabilities and `sampled` (the sampler's; default
    `old`) is measured (default all rows)."""
    mask_f = mask.float()
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - options.epsilon, 1 + options.clip_high)
    a = advantage[:, None]
    per_token = -torch.min(ratio * a, clipped * a)
    kl = None
    if options.beta != 0.0:
        # k3's estimate, times the importance ratio (TRL's use_bias_correction_kl, its default: the unbiased
        # reverse-KL gradient of DeepSeek-V3.2)
        kl = (torch.exp(reference - logps) - (reference - logps) - 1) * ratio
        per_token = per_token + options.beta * kl
    summed = per_token * mask_f
    if options.loss_type == "grpo":
        items = summed.sum(-1) / mask_f.sum(-1).clamp(min=1.0)
    elif options.loss_type == "dr_grpo":
        items = summed.sum(-1) / options.max_new_tokens
    else:  # dapo, bnpo: a mean over tokens
        items = summed.sum(-1)
    if scale is not None:
        loss = items.sum() * scale
    else:
        loss = items.sum() / (mask_f.sum().clamp(min=1.0) if options.loss_type in ("dapo", "bnpo") else len(items))
    with torch.no_grad():
        low = (ratio < 1 - options.epsilon) & (a < 0)
        high = (ratio > 1 + options.clip_high) & (a > 0)
        measured = mask if fresh is None else mask & fresh[:, None]
        stats = torch.stack([mask_f.sum(), ((low | high).float() * mask_f).sum(),
                             (kl * mask_f).sum() if kl is not None else torch.zeros((), device=logps.device),
                             measured.float().sum(),
                             ((logps - (old if sampled is None else sampled)).abs() * measured).amax()])
    return loss, stats


@dataclass
class PolicyStats:
    """The loss's statistics of the micro-batches since the last log line: tokens, clipped tokens, KL sum, tokens
    fresh from the sampler and their largest |trainer - sampler| log-probability (the train-inference mismatch,
    measured on the first pass over a generation batch)."""

    pending: list = field(default_factory=list)
    # per generation batch on this DP rank: completions, reward sum, reward square sum, completion tokens,
    # generation seconds, generated tokens, completions with a reward, the KV cache's bytes, the generation's peak
    # accelerator bytes (CUDA; 0 elsewhere) (fp64)
    rollouts: list = field(default_factory=list)

    def add(self, stats: torch.Tensor) -> None:
        self.pending.append(stats.detach())

    def add_rollout(self, values: torch.Tensor) -> None:
        self.rollouts.append(values)

    def metrics(self, dp=None, pp=None, device=None) -> dict:
        """The interval's statistics over every DP rank (one host read)."""
        if not self.pending and not self.rollouts and (pp is None or pp.size == 1):
            return {}
        device = self.pending[0].device if self.pending else device
        stacked = torch.stack(self.pending) if self.pending else torch.zeros(1, 5, device=device)
        rollouts = torch.stack(self.rollouts) if self.rollouts else torch.zeros(1, 9, device=device,
                                                                                dtype=torch.float64)
        rolled, generations = rollouts[:, :8].sum(0), len(self.rollouts)
        self.pending, self.rollouts = [], []
        sums = torch.cat([stacked[:, :4].sum(0).double(), rolled])
        worst = torch.stack([stacked[:, 4].amax().double(), rollouts[:, 8].amax()])
        if pp is not None and pp.size > 1:  # the loss's statistics live on the last stage
            dist.all_reduce(sums[:4], group=pp.group)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=pp.group)
        if dp is not None and dp.size > 1:
            dist.all_reduce(sums, group=dp.group)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=dp.group)
        tokens, clipped, kl, fresh, rows, reward, square, length, seconds, new, scored, cache = sums.tolist()
        out = {"clip_fraction": clipped / max(tokens, 1.0), "kl": kl / max(tokens, 1.0)}
        mismatch, peak = worst.tolist()
        if fresh:  # measured on the first pass over a generation batch only (--grpo-iterations)
            out["logprob_mismatch"] = mismatch
        if peak:
            out["generate_peak_gib"] = peak / 2 ** 30
        if rows:
            mean = reward / max(scored, 1.0)
            ranks = dp.size if dp is not None else 1
            out.update(reward_mean=mean, reward_std=math.sqrt(max(square / max(scored, 1.0) - mean * mean, 0.0)),
                       completion_length=length / rows, generate_tokens_per_s=new / max(seconds / ranks, 1e-9),
                       generate_s=seconds / ranks / max(generations, 1),
                       kv_cache_mib=cache / ranks / max(generations, 1) / 2 ** 20)
        return out


class Value(IntEnum):
    """The planes of the per-token values a GRPO row carries beside its ids and labels ([n, 4, s] fp32): its
    advantage (the same at every position), the sampler's log-probability of each label, the reference model's (zeros
    at beta 0), and 1 where the row is fresh from the sampler (the same at every position)."""

    ADVANTAGE = 0
    OLD = 1
    REFERENCE = 2
    FRESH = 3


def completion_rows(prompts: list, completions: list, logprobs: list, advantage: torch.Tensor, seq_length: int,
                    pad: int):
    """Training rows of one completion each: ids = prompt + completion (right-padded with `pad`) [n, s], labels =
    the completion's tokens at the positions that predict them, IGNORE_INDEX elsewhere [n, s], values [n, 4, s]
    fp32 = the advantage, the sampler's log-probability of each label, the reference's (zeros), fresh (zeros)."""
    n = len(prompts)
    ids = torch.full((n, seq_length), pad, dtype=torch.long)
    labels = torch.full((n, seq_length), IGNORE_INDEX, dtype=torch.long)
    values = torch.zeros(n, len(Value), seq_length, dtype=torch.float32)
    for r, (prompt, completion, logps) in enumerate(zip(prompts, completions, logprobs)):
        full = list(prompt) + list(completion)
        ids[r, :len(full) - 1] = torch.tensor(full[:-1])
        first = len(prompt) - 1  # the position whose label is the completion's first token
        labels[r, first:first + len(completion)] = torch.tensor(completion)
        values[r, Value.OLD, first:first + len(completion)] = torch.tensor(logps, dtype=torch.float32)
    values[:, Value.ADVANTAGE] = advantage.float()[:, None]
    return ids, labels, values

