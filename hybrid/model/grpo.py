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

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo")
TOKEN_MEAN_LOSSES = ("dapo", "cispo", "vespo")  # a token mean over the whole generation batch (num_items_in_batch)
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
    importance_sampling_level: str = "token"  # importance_sampling_level: token | sequence (GSPO)
    delta: Optional[float] = None  # delta: the ratio's upper bound in the clipped losses (two-sided clipping)
    sapo_temperature_pos: float = 1.0  # sapo_temperature_pos
    sapo_temperature_neg: float = 1.05  # sapo_temperature_neg
    vespo_k_pos: float = 2.0  # vespo_k_pos
    vespo_lambda_pos: float = 3.0  # vespo_lambda_pos
    vespo_k_neg: float = 3.0  # vespo_k_neg
    vespo_lambda_neg: float = 2.0  # vespo_lambda_neg
    # the sampler-trainer importance correction (vllm_importance_sampling_correction with vllm_importance_sampling_mode;
    # None: off): the trainer's log-probabilities at generation against the sampler's, as TRL corrects vLLM's
    rollout_correction: Optional[str] = None
    correction_clip_min: Optional[float] = None  # vllm_importance_sampling_clip_min
    correction_clip_max: Optional[float] = 3.0  # vllm_importance_sampling_clip_max
    off_policy_mask_threshold: Optional[float] = None  # off_policy_mask_threshold (DeepSeek-V3.2's sequence mask)
    mask_truncated_completions: bool = False  # mask_truncated_completions
    top_entropy_quantile: float = 1.0  # top_entropy_quantile: the policy loss on this share of highest-entropy tokens
    environment: Optional[str] = None  # environment_factory: "FILE.py:NAME" (hybrid.training.environments)
    max_turns: int = 4  # max_tool_calling_iterations + 1: the model's turns per episode
    max_tokens_per_turn: Optional[int] = None  # a turn's tokens at most (None: the completion's remaining budget)
    reasoning_gym: tuple = ()  # the prompt source: reasoning_gym's tasks by name (hybrid.data.gym_tasks)
    reasoning_gym_size: int = 1000  # entries per task
    dynamic_sampling: bool = False  # DAPO's dynamic sampling (verl's filter_groups): groups without signal refilled
    dynamic_sampling_rounds: int = 8  # sampling rounds per batch at most (verl's max_num_gen_batches)

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
                fresh: Optional[torch.Tensor] = None, sampled: Optional[torch.Tensor] = None,
                entropy_mask: Optional[torch.Tensor] = None):
    """The micro-batch's loss (TRL's _compute_loss) and its statistics.

    logps, old, reference [b, s] (reference None when beta is 0), advantage [b], mask [b, s] bool. `old`: the
    trainer's log-probabilities when the batch was generated (TRL's old_per_token_logps); `sampled`: the sampler's
    (TRL's sampling_per_token_logps: the rollout correction, the off-policy mask and the mismatch read them; default
    `old`). `scale`: the runtime's factor for a mean over the global batch's items
    (hybrid.model.objectives.GroupPolicy.count); None takes the micro-batch's own mean. `fresh` [b] bool: the rows the
    sampler made with the trainer's current weights, where the mismatch is measured (default all rows). `entropy_mask`
    [b, s] bool: --grpo-top-entropy-quantile's tokens (high_entropy_mask), the only ones the policy term trains."""
    o = options
    sampled = old if sampled is None else sampled
    mask_f = mask.float()
    a = advantage[:, None]
    log_ratio = logps - old
    if o.importance_sampling_level == "sequence":  # GSPO: one ratio per sequence, its tokens' mean log-ratio
        log_weight = ((log_ratio * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1.0))[:, None]
    else:
        log_weight = log_ratio
    ratio = torch.exp(log_weight)
    correction = rollout_correction(old, sampled, mask_f, o)
    if o.loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=o.clip_high).detach() * a * logps
        clipped = (ratio > o.clip_high) & (a > 0)
    elif o.loss_type == "sapo":
        temperature = torch.where(a > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)
        per_token = -torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * a
        clipped = torch.zeros_like(ratio, dtype=torch.bool)
    elif o.loss_type == "vespo":
        per_token = -gamma_weights(a, log_ratio, mask_f, correction, o) * a * logps
        clipped = torch.zeros_like(ratio, dtype=torch.bool)
    else:  # grpo, dapo, dr_grpo, bnpo, luspo: the clipped surrogate
        bounded = torch.clamp(ratio, 1 - o.epsilon, 1 + o.clip_high)
        unbounded = ratio if o.delta is None else torch.clamp(ratio, max=o.delta)
        per_token = -torch.min(unbounded * a, bounded * a)
        clipped = ((ratio < 1 - o.epsilon) & (a < 0)) | ((ratio > 1 + o.clip_high) & (a > 0))
    if o.off_policy_mask_threshold is not None:
        per_token = per_token * off_policy_mask(a, logps, sampled, mask_f, o.off_policy_mask_threshold)
    if entropy_mask is not None:
        per_token = per_token * entropy_mask
    if correction is not None and o.loss_type != "vespo":  # (VESPO's weights hold it already)
        per_token = per_token * correction
    kl = None
    if o.beta != 0.0:
        # k3's estimate, times the importance ratio (TRL's use_bias_correction_kl, its default: the unbiased
        # reverse-KL gradient of DeepSeek-V3.2)
        kl = (torch.exp(reference - logps) - (reference - logps) - 1) * ratio
        per_token = per_token + o.beta * kl
    summed = per_token * mask_f
    if o.loss_type in ("grpo", "sapo"):
        items = summed.sum(-1) / mask_f.sum(-1).clamp(min=1.0)
    elif o.loss_type == "dr_grpo":
        items = summed.sum(-1) / o.max_new_tokens
    else:  # luspo: each sequence's sum; dapo, bnpo, cispo, vespo: a mean over tokens
        items = summed.sum(-1)
    if scale is not None:
        loss = items.sum() * scale
    elif o.loss_type in TOKEN_MEAN_LOSSES or o.loss_type == "bnpo":
        loss = items.sum() / mask_f.sum().clamp(min=1.0)
    else:
        loss = items.sum() / len(items)
    with torch.no_grad():
        measured = mask if fresh is None else mask & fresh[:, None]
        zero = torch.zeros((), device=logps.device)
        is_sum = is_count = zero
        is_low = is_high = torch.full((), -math.inf, device=logps.device)  # (maxima: -inf is none)
        if correction is not None:  # the correction's ratios: every token's (token modes) or every sequence's
            seen = mask if correction.size(1) > 1 else torch.ones_like(correction, dtype=torch.bool)
            values = correction.expand_as(seen)[seen]
            is_sum, is_count = values.sum(), seen.float().sum()
            if values.numel():
                is_low, is_high = -values.min(), values.max()
        stats = torch.stack([mask_f.sum(), (clipped.float() * mask_f).sum(),
                             (kl * mask_f).sum() if kl is not None else zero, measured.float().sum(),
                             is_sum, is_count,
                             ((logps - sampled).abs() * measured).amax(), is_low, is_high])
    return loss, stats


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, threshold: float, axis=None) -> torch.Tensor:
    """TRL's get_high_entropy_mask: the tokens whose entropy is at least the `threshold` quantile (torch.quantile's
    linear rule) of every valid token's entropy in this micro-batch over the ranks of `axis` (the data-parallel
    ranks: TRL gathers over its processes). Each rank's values travel padded to its micro-batch's size (no host
    read of the counts); the quantile is computed on the sorted values as torch.quantile computes it."""
    pad = -1e9  # TRL's sentinel: entropies are >= 0
    local = torch.where(mask, entropies.float(), torch.full((), pad, device=entropies.device)).flatten()
    if axis is not None and axis.size > 1:
        parts = [torch.empty_like(local) for _ in range(axis.size)]
        dist.all_gather(parts, local, group=axis.group)
        local = torch.cat(parts)
    values = local.sort().values
    valid = (values != pad).sum()
    first = values.numel() - valid  # the sentinels sort first
    ranks = torch.full((), threshold, dtype=values.dtype, device=values.device) * \
        (valid - 1).clamp(min=0).to(values.dtype)
    below, above = ranks.long(), ranks.ceil().long()
    last = values.numel() - 1  # (gather, not indexing by a 0-d tensor: that reads the index on the host)
    low = values.gather(0, (first + below).clamp(max=last).view(1))[0]
    high = values.gather(0, (first + above).clamp(max=last).view(1))[0]
    value = torch.lerp(low, high, ranks - below.to(values.dtype))
    keep = ((entropies * mask.float()) >= value) & mask
    return keep & (valid > 0)


def rollout_correction(old, sampled, mask_f, o: GRPOOptions) -> Optional[torch.Tensor]:
    """--grpo-rollout-correction: exp(trainer - sampler) log-probabilities per token [b, s] (token_*) or summed
    per sequence [b, 1] (sequence_*), truncated to or masked outside [clip_min, clip_max] (TRL's vLLM importance
    sampling correction, verl's TIS / MIS); None when off."""
    if o.rollout_correction is None:
        return None
    diff = ((old - sampled) * mask_f).nan_to_num(0.0)
    if o.rollout_correction.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff).detach()
    if o.rollout_correction.endswith("truncate"):
        return torch.clamp(ratio, min=o.correction_clip_min, max=o.correction_clip_max)
    low = -math.inf if o.correction_clip_min is None else o.correction_clip_min
    high = math.inf if o.correction_clip_max is None else o.correction_clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def off_policy_mask(a, logps, sampled, mask_f, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's get_off_policy_mask) [b, 1]: a sequence is kept when its
    advantage is not negative or its mean KL(sampler || trainer) over its tokens is at most `threshold`."""
    kl = (sampled - logps.detach()).nan_to_num(0.0)
    mean = (kl * mask_f).sum(-1, keepdim=True) / mask_f.sum(-1, keepdim=True).clamp(min=1.0)
    return ((a >= 0) | (mean <= threshold)).to(mask_f.dtype)


@torch.no_grad()
def gamma_weights(a, log_ratio, mask_f, correction, o: GRPOOptions) -> torch.Tensor:
    """VESPO's weight per sequence [b, 1] (TRL's get_gamma_weights): phi(w) = e^lambda w^k e^(-lambda w) of the
    sequence's importance ratio w (the product of its tokens' ratios, times the rollout correction's), k and lambda
    by the advantage's sign; a gradient-free factor."""
    floor = math.log(1e-8)
    log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask_f).sum(-1, keepdim=True)
    if correction is not None:
        log_w = log_w + (torch.clamp(torch.log(correction), floor, 20.0) * mask_f).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, floor, 20.0)
    positive = a >= 0
    k = torch.where(positive, o.vespo_k_pos, o.vespo_k_neg)
    lam = torch.where(positive, o.vespo_lambda_pos, o.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@dataclass
class PolicyStats:
    """The loss's statistics of the micro-batches since the last log line: tokens, clipped tokens, KL sum, tokens
    fresh from the sampler and their largest |trainer - sampler| log-probability (the train-inference mismatch,
    measured on the first pass over a generation batch)."""

    pending: list = field(default_factory=list)
    # per generation batch on this DP rank: completions, reward sum, reward square sum, completion tokens,
    # generation seconds, generated tokens, completions with a reward, the KV cache's bytes, the generation's peak
    # accelerator bytes (CUDA; 0 elsewhere), the model's turns, the environment's replies, episodes of an environment,
    # groups whose rewards all agree, groups, sampling rounds, groups sampled (--grpo-dynamic-sampling; else 0) (fp64)
    rollouts: list = field(default_factory=list)
    columns: list = field(default_factory=list)  # the reward columns' names (functions', then the environment's)
    column_sums: list = field(default_factory=list)  # per generation batch: [3, columns] sums, squares, counts

    def add(self, stats: torch.Tensor) -> None:
        self.pending.append(stats.detach())

    def add_rollout(self, values: torch.Tensor) -> None:
        self.rollouts.append(values)

    def add_columns(self, sums: torch.Tensor) -> None:
        self.column_sums.append(sums)

    def metrics(self, dp=None, pp=None, device=None) -> dict:
        """The interval's statistics over every DP rank (one host read)."""
        if not self.pending and not self.rollouts and (pp is None or pp.size == 1):
            return {}
        device = self.pending[0].device if self.pending else device
        # policy_loss's statistics: 6 sums, then 3 maxima (the mismatch, the correction's -min and max)
        stacked = torch.stack(self.pending) if self.pending else \
            torch.tensor([[0.0] * 7 + [-math.inf] * 2], device=device)
        rollouts = torch.stack(self.rollouts) if self.rollouts else torch.zeros(1, 16, device=device,
                                                                                dtype=torch.float64)
        rolled, generations = torch.cat([rollouts[:, :8], rollouts[:, 9:]], 1).sum(0), len(self.rollouts)
        columns = torch.stack(self.column_sums).sum(0) if self.column_sums else None
        self.pending, self.rollouts, self.column_sums = [], [], []
        columns = columns.flatten() if columns is not None else \
            torch.zeros(3 * len(self.columns), device=device, dtype=torch.float64)
        sums = torch.cat([stacked[:, :6].sum(0).double(), rolled, columns])
        worst = torch.cat([stacked[:, 6:].amax(0).double(), rollouts[:, 8].amax().reshape(1)])
        if pp is not None and pp.size > 1:  # the loss's statistics live on the last stage
            dist.all_reduce(sums[:6], group=pp.group)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=pp.group)
        if dp is not None and dp.size > 1:
            dist.all_reduce(sums, group=dp.group)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=dp.group)
        host = sums.tolist()
        tokens, clipped, kl, fresh, is_sum, is_count, rows, reward, square, length, seconds, new, scored, cache, \
            turns, replies, episodes, flat, groups, rounds, sampled = host[:21]
        out = {"clip_fraction": clipped / max(tokens, 1.0), "kl": kl / max(tokens, 1.0)}
        mismatch, is_low, is_high, peak = worst.tolist()
        if fresh:  # measured on the first pass over a generation batch only (--grpo-iterations)
            out["logprob_mismatch"] = mismatch
        if is_count:  # --grpo-rollout-correction's ratios
            out.update(is_ratio_mean=is_sum / is_count, is_ratio_min=-is_low, is_ratio_max=is_high)
        if peak:
            out["generate_peak_gib"] = peak / 2 ** 30
        if rows:
            mean = reward / max(scored, 1.0)
            ranks = dp.size if dp is not None else 1
            out.update(reward_mean=mean, reward_std=math.sqrt(max(square / max(scored, 1.0) - mean * mean, 0.0)),
                       completion_length=length / rows, generate_tokens_per_s=new / max(seconds / ranks, 1e-9),
                       generate_s=seconds / ranks / max(generations, 1),
                       kv_cache_mib=cache / ranks / max(generations, 1) / 2 ** 20)
        k = len(self.columns)
        columns = zip(self.columns, host[21:21 + k], host[21 + k:21 + 2 * k], host[21 + 2 * k:])
        for name, total, square, count in columns:
            if count:  # TRL's rewards/NAME/mean and std (nanstd: over the scored completions, Bessel-corrected)
                mean = total / count
                out[f"rewards/{name}/mean"] = mean
                if count > 1:
                    out[f"rewards/{name}/std"] = math.sqrt(max(square / count - mean * mean, 0.0) * count / (count - 1))
        if groups:  # TRL's frac_reward_zero_std: the trained groups whose rewards all agree
            out["frac_reward_zero_std"] = flat / groups
        if sampled:  # --grpo-dynamic-sampling: rounds per batch, the share of sampled groups left out
            out.update(sampling_rounds=rounds / max(generations, 1) / (dp.size if dp is not None else 1),
                       groups_dropped=1.0 - groups / sampled)
        if episodes:  # --grpo-environment: the model's turns and the environment's replies per episode
            out.update(turns_per_episode=turns / episodes, replies_per_episode=replies / episodes)
        return out


class Value(IntEnum):
    """The planes of the per-token values a GRPO row carries beside its ids and labels ([n, 5, s] fp32): its
    advantage (the same at every position), the sampler's log-probability of each label, the reference model's (zeros
    at beta 0), 1 where the row is fresh from the sampler (the same at every position), and the trainer's own
    log-probability of each label when the batch was generated (TRL's old_per_token_logps; with --grpo-iterations > 1
    only, zeros otherwise: a first pass takes its own, detached)."""

    ADVANTAGE = 0
    OLD = 1
    REFERENCE = 2
    FRESH = 3
    TRAINER = 4


def completion_rows(prompts: list, completions: list, logprobs: list, advantage: torch.Tensor, seq_length: int,
                    pad: int):
    """Training rows of one completion each: ids = prompt + completion (right-padded with `pad`) [n, s], labels =
    the completion's tokens at the positions that predict them, IGNORE_INDEX elsewhere [n, s], values [n, 5, s]
    fp32 = the advantage, the sampler's log-probability of each label, then zeros (the reference's, fresh, the
    trainer's: Value)."""
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

