"""Mixture of experts: a router picks k of E expert MLPs for each token; the tokens travel to the ranks
holding their experts (expert parallelism: an all-to-all inside the EP group) and their weighted
outputs come back; optional shared experts see every token.

Semantics are Megatron-LM's (megatron/core/transformer/moe: router.py, moe_utils.py), flag for flag:
softmax (top-k of the logits then softmax, or softmax then top-k with --moe-router-pre-softmax) or
sigmoid scores (normalised over the top k) with an optional score bias updated after each step
(DeepSeek-V3's auxiliary-loss-free balancing); the load-balancing loss per micro-batch (`aux_loss`) or
per sequence (`seq_aux_loss`) and the z-loss reach the router's gradient through
`AuxLossBackward` (no change to the loss the schedules see, so every pipeline schedule carries them);
dropless routing, or a capacity per expert with the lowest-probability (or latest) tokens dropped.

Layout: global expert e lives on EP rank e // (E / EP) as its local expert e % (E / EP). Under TP,
which needs --sequence-parallel (as in Megatron-LM), each TP rank routes its own sequence shard and
holds its EP rank's experts whole: experts are replicated over TP, not split, and their gradients
and the router's are summed over TP as the norms' are under SP. Shared experts are a dense MLP, TP
split like any other.

Names follow DeepSpeed's MoE convention (`deepspeed_moe.experts.deepspeed_experts.{local}`, expert
parameters marked `allreduce = False` with `group_name = "ep_size_{EP}"`): DeepSpeed's engine reduces
those over the expert-data-parallel group, gives them their own optimizer groups and writes each
expert to its own checkpoint file (hybrid.training.deepspeed_fixes.register_moe_layers).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.model.init import normal_init, output_layer_std
from hybrid.parallel import collectives as C
from hybrid.parallel.groups import as_groups
from hybrid.parallel.mappings import all_to_all_rows, sync_replicated_grad



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
            probs, indices = torch.softmax(logits, dim=-1).topk(k, dim=-1)
        else:
            top, indices = logits.topk(k, dim=-1)
            probs = torch.softmax(top, dim=-1)
    else:  # sigmoid: the bias chooses, the unbiased scores weigh
        scores = torch.sigmoid(logits)
        choice = scores if score_bias is None else scores + score_bias
        indices = choice.topk(k, dim=-1).indices
        probs = scores.gather(1, indices)
        if k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if config.moe_router_topk_scaling_factor:
        probs = probs * config.moe_router_topk_scaling_factor
    return probs, indices


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
    """[E] (int64) the pairs routed to each expert, from indices or kept_choices (dropped pairs not counted)."""
    return torch.bincount(chosen.flatten(), minlength=num_experts + 1)[:num_experts]


def switch_balancing_loss(scores, counts, total_tokens: int, topk: int, num_experts: int,
                          coeff: float) -> torch.Tensor:
    """Megatron's switch_load_balancing_loss_func: E * coeff / (k T^2) * sum_e (sum_t p_te) * c_e, with the
    counts c and T over every rank holding part of the tokens (the sums of p over this rank's)."""
    return (scores.sum(dim=0) * counts).sum() * (num_experts * coeff / (topk * total_tokens * total_tokens))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: coeff x mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits, dim=-1).square().mean() * coeff


def capacity_keep(probs, indices, num_experts: int, capacity_factor: float, policy: str) -> Optional[torch.Tensor]:
    """[T, k] bool: the (token, expert) pairs within each expert's capacity ceil(T k / E x factor), the
    highest-probability ones (policy "probs") or the earliest ("position"), as Megatron's
    apply_router_token_dropping; None when nothing can be dropped."""
    tokens, k = indices.shape
    capacity = math.ceil(tokens * k / num_experts * capacity_factor)
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
        if config.moe_router_enable_expert_bias:
            self.register_buffer("score_bias", torch.zeros(config.num_experts))
        else:
            self.score_bias = None
        # kept (token, expert) pairs since the last bias update (not saved: an update empties it)
        self.register_buffer("tokens_per_expert", torch.zeros(config.num_experts), persistent=False)
        self.aux_loss_scale = 1.0  # set by the step (hybrid.model.moe.set_aux_loss_scale)
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

    def forward(self, x: torch.Tensor, seq_length: int):
        """x [T, h] (T = s x b, sequence-major) -> (probs [T, k] fp32, indices [T, k], logits [T, E])."""
        weight = sync_replicated_grad(self.weight, self.groups.tp_group) if self.config.sequence_parallel \
            else self.weight
        logits = F.linear(x, weight).float()  # in the input's dtype, scored in fp32 (as transformers, Megatron)
        probs, indices = route(logits, self.config, self.score_bias)
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


# --- the experts -----------------------------------------------------------------------------------

class _Weight(nn.Module):
    """A bias-free projection's weight, [out, in], drawn by its canonical name."""

    def __init__(self, out_features: int, in_features: int, init):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        init(self.weight)


class ExpertMLP(nn.Module):
    """One expert: fc1 [up, h] (up = 2 f for SwiGLU/GeGLU, [gate; up]), fc2 [h, f]; no biases."""

    def __init__(self, config, name: str):
        super().__init__()
        f, h = config.moe_ffn_hidden_size, config.hidden_size
        up = 2 * f if config.gated_linear_unit else f
        self.fc1 = _Weight(up, h, normal_init(config.seed, f"{name}.fc1.weight", config.init_method_std))
        self.fc2 = _Weight(h, f, normal_init(config.seed, f"{name}.fc2.weight",
                                             output_layer_std(config.init_method_std, config.num_layers)))


class _Experts(nn.Module):
    """DeepSpeed's `Experts` layout (`experts.deepspeed_experts.{local}`), its parameters marked as
    DeepSpeed marks expert parameters."""

    def __init__(self, config, name: str, first: int, count: int, ep_size: int):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(ExpertMLP(config, f"{name}.experts.{first + j}") for j in range(count))
        for param in self.deepspeed_experts.parameters():
            param.allreduce = False  # reduced over the expert-data-parallel group, not DP
            param.group_name = f"ep_size_{ep_size}"


class _ExpertsHolder(nn.Module):
    """`deepspeed_moe`: holds the local experts under DeepSpeed's names."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts


def grouped_gemm_fits(x: torch.Tensor, *sizes: int) -> bool:
    """torch._grouped_mm runs here: rows of 16-byte multiples, a float dtype its kernels take."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    return all(s * x.element_size() % 16 == 0 for s in sizes)


class GroupedLinear(torch.autograd.Function):
    """rows [N, in] grouped by expert (`offsets`: cumulative rows per expert) times each expert's weight
    [out, in] -> [N, out], one torch._grouped_mm; backward: the input gradient and every expert's weight
    gradient as two more grouped GEMMs. The experts' weights are stacked only while a GEMM runs: autograd
    keeps the parameters themselves, not a stacked copy of every expert per micro-batch."""

    @staticmethod
    def forward(ctx, rows, offsets, *weights):
        ctx.save_for_backward(rows, offsets, *weights)
        return torch._grouped_mm(rows, torch.stack(weights).transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        rows, offsets, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        try:
            grad_rows = torch._grouped_mm(grad, torch.stack(weights), offs=offsets) if ctx.needs_input_grad[0] \
                else None
            grad_weights = torch._grouped_mm(grad.t(), rows, offs=offsets).unbind(0)  # grad_e^T rows_e
        except RuntimeError:  # a kernel without this layout: per expert (the offsets read on the host)
            ends = offsets.tolist()
            starts = [0] + ends[:-1]
            grad_rows = torch.cat([grad[a:b] @ w for a, b, w in zip(starts, ends, weights)]) \
                if ctx.needs_input_grad[0] else None
            grad_weights = [grad[a:b].t() @ rows[a:b] for a, b in zip(starts, ends)]
        return (grad_rows, None, *grad_weights)


class MoELayer(nn.Module):
    """The feed-forward block of an MoE layer: `[s(/tp), b, h] -> [s(/tp), b, h]`."""

    def __init__(self, config, groups, name: str, dense_mlp, activation):
        """`dense_mlp`: the dense MLP class (the shared experts); `activation`: the experts' activation
        on fc1's output (both from hybrid.model.mlp, which builds this layer)."""
        super().__init__()
        self.groups = groups = as_groups(groups)
        self.config = config
        ep = groups.ep.size
        self.num_experts, self.ep_size = config.num_experts, ep
        self.num_local_experts = config.num_experts // ep
        self.expert_offset = groups.ep.rank * self.num_local_experts  # global index of local expert 0
        self.expert_group_name = f"ep_size_{ep}"  # DeepSpeed's name of the expert groups
        self.activation = activation
        self.router = Router(config, groups, name)
        self.deepspeed_moe = _ExpertsHolder(_Experts(config, name, self.expert_offset, self.num_local_experts, ep))
        self.shared_mlp = None
        if config.moe_shared_expert_intermediate_size:
            self.shared_mlp = dense_mlp(config, groups, f"{name}.shared_mlp", config.moe_shared_expert_intermediate_size)
        self.shared_gate = None
        if config.moe_shared_expert_gate:
            self.shared_gate = nn.Parameter(torch.empty(1, config.hidden_size))
            normal_init(config.seed, f"{name}.shared_gate", config.init_method_std)(self.shared_gate)
        self._grouped = config.moe_grouped_gemm

    @property
    def local_experts(self) -> nn.ModuleList:
        return self.deepspeed_moe.experts.deepspeed_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.groups.tp_size > 1 and not self.config.sequence_parallel:
            raise RuntimeError("an MoE layer at TP > 1 needs sequence parallelism (each TP rank routes its shard)")
        s, b, h = x.shape
        flat = x.reshape(s * b, h)
        probs, indices, _ = self.router(flat, s)
        keep = None
        c = self.config
        if c.moe_expert_capacity_factor is not None:
            keep = capacity_keep(probs, indices, self.num_experts, c.moe_expert_capacity_factor,
                                 c.moe_token_drop_policy)
        self.router.count(indices, keep)
        out = self._dispatch(flat, probs.to(x.dtype), indices, keep).view(s, b, h)
        if self.shared_mlp is not None:
            shared = self.shared_mlp(x)
            if self.shared_gate is not None:
                gate = sync_replicated_grad(self.shared_gate, self.groups.tp_group) if c.sequence_parallel \
                    else self.shared_gate
                shared = torch.sigmoid(F.linear(x, gate)) * shared
            out = out + shared
        return out

    def _dispatch(self, x, probs, indices, keep):
        """Tokens sorted by expert, through their experts (on this EP rank or another), weighted, summed back."""
        k, E = indices.size(1), self.num_experts
        chosen = kept_choices(indices, keep, E)  # dropped pairs sort last and are cut off
        order = torch.argsort(chosen, stable=True)
        counts = routing_counts(chosen, E)
        if keep is not None:
            order = order[: int(counts.sum())]  # a host sync, only with a capacity
        tokens = order // k
        routed = x.index_select(0, tokens)  # [N, h], grouped by expert
        if self.ep_size == 1:
            y = self._experts(routed, counts)
        else:
            y = self._across_ranks(routed, counts)
        weights = probs.flatten().index_select(0, order).unsqueeze(1)
        return torch.zeros_like(x).index_add(0, tokens, y * weights)

    def _across_ranks(self, routed, counts):
        """All-to-all to the experts' EP ranks, the local experts, all-to-all back (Megatron's alltoall
        token dispatcher); the split sizes are read on the host (one sync per layer, as Megatron's)."""
        group, ep, local = self.groups.ep.group, self.ep_size, self.num_local_experts
        send_counts = counts.view(ep, local)  # rows for each rank's local experts
        recv_counts = C.all_to_all_variable(send_counts.contiguous(), [1] * ep, [1] * ep, group)  # [source, local]
        sizes = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        send, recv = sizes[:ep], sizes[ep:]
        arrived = all_to_all_rows(routed, send, recv, group)  # [sources x local experts] blocks
        expert_of = torch.repeat_interleave(torch.arange(local, device=routed.device).repeat(ep),
                                            recv_counts.flatten(), output_size=sum(recv))
        regroup = torch.argsort(expert_of, stable=True)  # by local expert, each source's rows in order
        y = self._experts(arrived.index_select(0, regroup), recv_counts.sum(0))
        back = torch.empty_like(y).index_copy(0, regroup, y) if y.numel() else y  # to arrival order
        return all_to_all_rows(back, recv, send, group)

    def _weights(self, which: str) -> list:
        tp = self.groups.tp_group if self.config.sequence_parallel else C.SINGLE_RANK
        return [sync_replicated_grad(getattr(e, which).weight, tp) for e in self.local_experts]

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [N, h] grouped by local expert (counts [local]) -> their experts' outputs [N, h]."""
        fc1, fc2 = self._weights("fc1"), self._weights("fc2")
        up, f = fc1[0].size(0), fc2[0].size(1)
        if self._grouped and rows.size(0) and grouped_gemm_fits(rows, rows.size(1), up, f):
            offsets = counts.cumsum(0).to(torch.int32)
            try:  # one grouped GEMM per projection, no host sync (torchtitan's and DeepSpeed AutoEP's path)
                hidden = GroupedLinear.apply(rows, offsets, *fc1)
                return GroupedLinear.apply(self.activation(hidden, None), offsets, *fc2)
            except RuntimeError:  # a device without the kernel: the loop below from now on
                self._grouped = False
        outputs = []
        for part, w1, w2 in zip(rows.split(counts.tolist()), fc1, fc2):  # Megatron's SequentialMLP
            outputs.append(F.linear(self.activation(F.linear(part, w1), None), w2))
        return torch.cat(outputs) if outputs else rows


# --- what the steps and the loop call ------------------------------------------------------------

def routers(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, Router)]


def keep_fp32_buffers(model: nn.Module) -> None:
    """The score bias and the counts back in fp32 after an engine cast the model (DeepSpeed's bf16/fp16
    engines cast every floating buffer): steps of 1e-3 on a bf16 bias and counts above 256 in bf16 would
    round away (Megatron keeps them in fp32 too)."""
    for router in routers(model):
        if router.score_bias is not None:
            router.score_bias = router.score_bias.float()
        router.tokens_per_expert = router.tokens_per_expert.float()


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The factor each micro-batch's LM loss gets in backward, for the auxiliary losses (AuxLossBackward)."""
    for router in routers(model):
        router.aux_loss_scale = scale


def update_score_bias(model: nn.Module) -> None:
    """After an optimizer step: each router's score bias moves by the update rate towards balance,
    sign(mean count - count) per expert, counts summed over every rank routing tokens of the step
    (TP under SP, CP, DP: one all-reduce each for all layers), then the counts start again."""
    biased = [r for r in routers(model) if r.score_bias is not None]
    if not biased:
        return
    counts = torch.stack([r.tokens_per_expert for r in biased])
    groups = biased[0].groups
    if biased[0].config.sequence_parallel:
        C.all_reduce(counts, groups.tp_group)
    C.all_reduce(counts, groups.dp.group)  # DeepSpeed's data axis: DP x CP (or Ulysses)
    rate = biased[0].config.moe_router_bias_update_rate
    with torch.no_grad():
        for router, row in zip(biased, counts):
            router.score_bias += torch.sign(row.mean() - row) * rate
            router.tokens_per_expert.zero_()


def take_logged(model: nn.Module) -> dict:
    """The auxiliary losses summed over layers and the tokens-per-expert imbalance (max / mean count,
    worst layer) since the last call, as device tensors; empties the sums."""
    out, worst = {}, None
    for router in routers(model):
        for name, value in router.logged.items():
            if name == "tokens_per_expert":
                ratio = value.max() / value.mean().clamp_min(1e-9)
                worst = ratio if worst is None else torch.maximum(worst, ratio)
            else:
                out[name] = value if name not in out else out[name] + value
        router.logged = {}
    if worst is not None:
        out["expert_imbalance"] = worst
    return out


class MoEStepHooks:
    """What each training iteration does for a model's MoE layers (hybrid.training.loop): before it, the
    auxiliary losses' backward factor (sequence split / micro-batches, as the LM loss gets); after the
    optimizer step, the score-bias update; at a log line, the losses and balance since the last."""

    def __init__(self, model: nn.Module, sequence_split: int):
        self.model, self.sequence_split = model, sequence_split
        self.micro_batches = 0

    @classmethod
    def of(cls, model: nn.Module, sequence_split: int) -> Optional["MoEStepHooks"]:
        return cls(model, sequence_split) if routers(model) else None

    def before(self, micro_batches: int) -> None:
        set_aux_loss_scale(self.model, self.sequence_split / micro_batches)
        self.micro_batches += micro_batches

    def after(self) -> None:
        update_score_bias(self.model)

    def metrics(self) -> dict:
        """Per micro-batch means of the auxiliary losses (summed over this rank's layers) and the worst
        layer's max / mean tokens per expert, of this rank's micro-batches since the last call."""
        values = take_logged(self.model)
        count, self.micro_batches = max(1, self.micro_batches), 0
        return {name: float(v) / (1 if name == "expert_imbalance" else count) for name, v in values.items()}
