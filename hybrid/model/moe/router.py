"""The router: h -> E scores (fp32), each token's top-k experts and their weights, Megatron-LM's
balancing losses attached to the probabilities (router.py and moe_utils.py of megatron-core), and
the capacity that drops (token, expert) pairs beyond each expert's share."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.model.init import normal_init
from hybrid.model.norms import rms_normalize
from hybrid.parallel import collectives as C
from hybrid.parallel.groups import as_groups
from hybrid.parallel.mappings import sync_replicated_grad


class AuxLossBackward(torch.autograd.Function):
    """forward: `output` unchanged; backward: also `scale` as the gradient of `aux_loss` (Megatron's
    MoEAuxLossAutoScaler). `scale` is the factor the LM loss's own backward gets (1 / accumulation
    steps, x the sequence split), so the auxiliary loss counts as if it were added to each micro-batch's loss."""

    @staticmethod
    def forward(ctx, output, aux_loss, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


# --- routing, pure functions on [tokens, experts] ------------------------------------------------

def route(logits: torch.Tensor, config, score_bias: Optional[torch.Tensor] = None):
    """logits [T, E] (fp32) -> (probs [T, k], expert indices [T, k]), Megatron's
    topk_routing_with_score_function."""
    k = config.moe_router_topk
    if config.moe_router_score_function == "softmax":
        if config.moe_router_pre_softmax:
            probs, indices = top_experts(torch.softmax(logits, dim=-1), config)
        else:
            top, indices = top_experts(logits, config)
            probs = torch.softmax(top, dim=-1)
    else:  # sigmoid: the bias chooses, the unbiased scores weigh
        scores = torch.sigmoid(logits)
        choice = scores if score_bias is None else scores + score_bias
        indices = top_experts(choice, config)[1]
        probs = scores.gather(1, indices)
        if k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if config.moe_router_topk_scaling_factor:
        probs = probs * config.moe_router_topk_scaling_factor
    return probs, indices


def weights_of(logits: torch.Tensor, indices: torch.Tensor, config):
    """logits [T, E] (fp32), chosen experts [T, k] -> their weights [T, k], as `route` weighs its own choice (for
    that choice, bitwise its probs): routing replay (--moe-routing-replay) takes the experts from the generator and
    the weights from the live scores, so the router keeps learning (megatron-core's RouterReplay, verl's R3)."""
    if config.moe_router_score_function == "softmax":
        if config.moe_router_pre_softmax:
            probs = torch.softmax(logits, dim=-1).gather(1, indices)
        else:
            probs = torch.softmax(logits.gather(1, indices), dim=-1)
    else:
        probs = torch.sigmoid(logits).gather(1, indices)
        if config.moe_router_topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if config.moe_router_topk_scaling_factor:
        probs = probs * config.moe_router_topk_scaling_factor
    return probs


def replayed(logits: torch.Tensor, live: tuple, replay: torch.Tensor, config, weigh: bool = True):
    """(probs, indices) of the live routing `live`, with each token's experts replaced by `replay` [T, k]'s where
    that row holds a recorded choice (>= 0; -1: none recorded, the live choice stays) and weighed from the live
    logits (weights_of; probs None without `weigh`); and [T] bool each, the recorded tokens and those whose live
    choice was another set of experts."""
    recorded = replay[:, 0] >= 0
    indices = torch.where(recorded[:, None], replay.to(live[1].dtype), live[1])
    differ = recorded & (live[1].sort(dim=-1).values != indices.sort(dim=-1).values).any(dim=-1)
    return weights_of(logits, indices, config) if weigh else None, indices, recorded, differ


def top_experts(scores: torch.Tensor, config):
    """scores [T, E] -> (top-k scores, their experts) [T, k]; with --moe-router-num-groups G and
    --moe-router-group-topk g, from the g groups (of E / G consecutive experts) whose top k // g scores sum
    highest, the others masked (Megatron-LM's group_limited_topk; DeepSeek-V3's node-limited routing)."""
    k, groups = config.moe_router_topk, config.moe_router_num_groups
    if not groups:
        return scores.topk(k, dim=-1)
    chosen = config.moe_router_group_topk
    tokens = scores.size(0)
    group_scores = scores.view(tokens, groups, -1).topk(k // chosen, dim=-1).values.sum(dim=-1)  # [T, G]
    group_mask = torch.zeros_like(group_scores).scatter(1, group_scores.topk(chosen, dim=-1).indices, 1.0)
    expert_mask = group_mask.bool()[:, :, None].expand(tokens, groups, scores.size(1) // groups).reshape_as(scores)
    return scores.masked_fill(~expert_mask, float("-inf")).topk(k, dim=-1)


def aux_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """The per-expert probabilities the balancing losses use: softmax over every expert, or the
    sigmoid scores normalised per token."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = torch.sigmoid(logits)
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def kept_choices(indices: torch.Tensor, keep: Optional[torch.Tensor], num_experts: int) -> torch.Tensor:
    """[T k] the expert of each (token, choice) pair, row r being token r // k's choice r % k;
    `num_experts` where the capacity dropped the pair (`keep` False), so dropped pairs sort last."""
    chosen = indices.flatten()
    return chosen if keep is None else chosen.masked_fill(~keep.flatten(), num_experts)


def routing_counts(chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] (int64) the pairs routed to each expert, from indices or kept_choices (dropped pairs not counted).
    An index_add, not torch.bincount: bincount reads the largest index on the host first (a sync on CUDA)."""
    chosen = chosen.flatten()
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=chosen.device)
    return counts.index_add_(0, chosen, torch.ones_like(chosen, dtype=torch.long))[:num_experts]


def switch_balancing_loss(scores, counts, total_tokens: int, topk: int, num_experts: int,
                          coeff: float) -> torch.Tensor:
    """Megatron's switch_load_balancing_loss_func: E * coeff / (k T^2) * sum_e (sum_t p_te) * c_e, with the
    counts c and T over every rank holding part of the tokens (the sums of p over this rank's)."""
    return (scores.sum(dim=0) * counts).sum() * (num_experts * coeff / (topk * total_tokens * total_tokens))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: coeff x mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits, dim=-1).square().mean() * coeff


def expert_capacity(tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """Each expert's capacity: ceil(T k / E x factor) pairs (Megatron's get_capacity)."""
    return math.ceil(tokens * k / num_experts * capacity_factor)


def capacity_keep(probs, indices, num_experts: int, capacity_factor: float, policy: str) -> Optional[torch.Tensor]:
    """[T, k] bool: the (token, expert) pairs within each expert's capacity (expert_capacity), the
    highest-probability ones (policy "probs") or the earliest ("position"), as Megatron's
    apply_router_token_dropping; None when nothing can be dropped."""
    tokens, k = indices.shape
    capacity = expert_capacity(tokens, k, num_experts, capacity_factor)
    if capacity >= tokens:
        return None
    routed = torch.zeros(tokens, num_experts, dtype=torch.bool, device=indices.device).scatter(1, indices, True)
    if policy == "probs":
        dense = torch.zeros(tokens, num_experts, dtype=probs.dtype, device=probs.device)
        order = dense.scatter(1, indices, probs.detach()).topk(capacity, dim=0).indices  # [capacity, E]
    else:
        order = torch.argsort(routed.int(), dim=0, descending=True, stable=True)[:capacity]
    kept = torch.zeros_like(routed).scatter(0, order, True) & routed
    return kept.gather(1, indices)


# --- the router ------------------------------------------------------------------------------------

class Router(nn.Module):
    """h -> E logits (fp32 scores), top-k choice, balancing losses attached to the probabilities."""

    def __init__(self, config, groups, name: str):
        super().__init__()
        self.config, self.groups = config, as_groups(groups)
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        normal_init(config.seed, f"{name}.router.weight", config.init_method_std)(self.weight)
        # a bias on the logits with --add-bias-linear (megatron-core's router; GPT-OSS's)
        self.bias = nn.Parameter(torch.zeros(config.num_experts)) if config.add_bias_linear else None
        if config.moe_router_enable_expert_bias:
            self.register_buffer("score_bias", torch.zeros(config.num_experts))
        else:
            self.score_bias = None
        # Gemma 4's router (--moe-gemma4-block): its input RMS-normalised without a weight, times a learned per-feature
        # scale and 1/sqrt(h); its renormalised top-k weights times a learned per-expert scale
        self.input_scale = self.output_scale = None
        if config.moe_gemma4_block:
            self.input_scale = nn.Parameter(torch.ones(config.hidden_size))
            self.output_scale = nn.Parameter(torch.ones(config.num_experts))
        # kept (token, expert) pairs since the last bias update (not saved: an update empties it)
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts), persistent=False)
        self.aux_loss_scale = 1.0  # the LM loss's backward factor, set before each step (training's MoE hooks)
        self.logged: dict = {}  # detached sums of each auxiliary loss and of the counts, for the log

    @property
    def token_split(self) -> int:
        """Ranks holding parts of the same tokens: TP under SP, times the sequence split (CP / Ulysses)."""
        c, g = self.config, self.groups
        return (g.tp_size if c.sequence_parallel else 1) * g.sequence_split

    def _sum_over_token_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.config.sequence_parallel:
            C.all_reduce(tensor, self.groups.tp_group)
        C.all_reduce(tensor, self.groups.cp.group)
        C.all_reduce(tensor, self.groups.ulysses.group)
        return tensor

    def forward(self, x: torch.Tensor, seq_length: int, replay: Optional[torch.Tensor] = None):
        """x [T, h] (T = s x b, sequence-major) -> (probs [T, k] fp32, indices [T, k], logits [T, E]). `replay`
        [T, k]: the experts the generator chose for these tokens (-1 where it recorded none): with
        --moe-routing-replay they are the choice (weighed from the live scores), without it they are compared
        with the live choice only; the share that differs is logged (routing_mismatch)."""
        sync = self.config.sequence_parallel
        weight = sync_replicated_grad(self.weight, self.groups.tp_group) if sync else self.weight
        bias = sync_replicated_grad(self.bias, self.groups.tp_group) if sync and self.bias is not None else self.bias
        if self.input_scale is not None:  # (transformers' Gemma4TextRouter)
            scale = sync_replicated_grad(self.input_scale, self.groups.tp_group) if sync else self.input_scale
            x = rms_normalize(x, self.config.norm_epsilon) * scale * self.config.hidden_size ** -0.5
        if self.config.moe_router_dtype == "fp32":  # the GEMM in fp32 (megatron-core's --moe-router-dtype fp32)
            logits = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        else:  # in the input's dtype, scored in fp32 (as transformers' Mixtral / Qwen / GPT-OSS)
            logits = F.linear(x, weight, bias).float()
        probs, indices = route(logits, self.config, self.score_bias)
        if replay is not None:
            on = self.config.moe_routing_replay
            weights, chosen, recorded, differ = replayed(logits, (probs, indices), replay, self.config, weigh=on)
            if self.training and torch.is_grad_enabled():  # (not a forward for old log-probabilities)
                # the decisions used that differ from the generator's (none with replay), and those replay changed
                changed = differ.sum()
                self._log("routing_differ", changed * 0 if on else changed)
                self._log("routing_replayed", changed if on else changed * 0)
                self._log("routing_recorded", recorded.sum())
            if on:
                probs, indices = weights, chosen
        if self.output_scale is not None:
            scale = sync_replicated_grad(self.output_scale, self.groups.tp_group) if sync else self.output_scale
            probs = probs * scale[indices]
        if self.training and torch.is_grad_enabled():  # once per micro-batch, in the recomputed pass under recompute
            probs = self._attach_losses(probs, indices, logits, seq_length)
        return probs, indices, logits

    def _attach_losses(self, probs, indices, logits, seq_length: int):
        c = self.config
        total = None
        kind = c.moe_router_load_balancing_type
        if kind != "none" and c.moe_aux_loss_coeff:
            scores = aux_scores(logits, c.moe_router_score_function)
            if kind == "aux_loss":
                counts = self._sum_over_token_ranks(routing_counts(indices, c.num_experts).float())
                total = switch_balancing_loss(scores, counts, logits.size(0) * self.token_split, c.moe_router_topk,
                                              c.num_experts, c.moe_aux_loss_coeff)
            else:  # seq_aux_loss: per sequence, averaged over the batch
                batch = logits.size(0) // seq_length
                routed = torch.zeros_like(scores).scatter(1, indices, 1.0)
                counts = self._sum_over_token_ranks(routed.view(seq_length, batch * c.num_experts).sum(0))
                total = switch_balancing_loss(scores.reshape(seq_length, -1), counts, seq_length * self.token_split,
                                              c.moe_router_topk, c.num_experts, c.moe_aux_loss_coeff) / batch
            self._log("load_balancing_loss", total)
        if c.moe_z_loss_coeff:
            z = z_loss(logits, c.moe_z_loss_coeff / self.token_split)
            self._log("z_loss", z)
            total = z if total is None else total + z
        if total is None:
            return probs
        return AuxLossBackward.apply(probs, total, self.aux_loss_scale)

    def _log(self, name: str, value: torch.Tensor) -> None:
        value = value.detach()
        self.logged[name] = value if name not in self.logged else self.logged[name] + value

    def count(self, indices: torch.Tensor, keep: Optional[torch.Tensor]) -> None:
        """Add this micro-batch's kept routing to the counts (the bias update's and the log's)."""
        if not (self.training and torch.is_grad_enabled()):
            return
        with torch.no_grad():
            experts = self.config.num_experts
            counts = routing_counts(kept_choices(indices, keep, experts), experts).float()
            self.tokens_per_expert += counts
            self.logged["tokens_per_expert"] = counts + self.logged.get("tokens_per_expert", 0)
