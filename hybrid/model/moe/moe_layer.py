"""The feed-forward block of an MoE layer: the router, the token dispatcher, this rank's experts and
optional shared experts (a dense MLP every token sees, with Qwen2-MoE's sigmoid gate)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.model.init import normal_init
from hybrid.model.moe.experts import Experts, ExpertsHolder
from hybrid.model.moe.router import Router, capacity_keep, expert_capacity
from hybrid.model.moe.token_dispatcher import TokenDispatcher
from hybrid.model.norms import build_norm
from hybrid.parallel import collectives as C
from hybrid.parallel.groups import as_groups
from hybrid.parallel.mappings import sync_replicated_grad


class MoELayer(nn.Module):
    """`[s(/tp), b, h] -> [s(/tp), b, h]`. Under TP (with SP) each TP rank routes its own sequence shard and
    holds its EP rank's experts whole."""

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
        self.dispatcher = TokenDispatcher(config.num_experts, groups.ep)
        self.deepspeed_moe = ExpertsHolder(Experts(config, name, self.expert_offset, self.num_local_experts, ep))
        self.shared_mlp = None
        if config.moe_shared_expert_intermediate_size:
            self.shared_mlp = dense_mlp(config, groups, f"{name}.shared_mlp",
                                        config.moe_shared_expert_intermediate_size)
        # --moe-gemma4-block: the shared experts' output normed; the routed experts' input (the residual) and output
        self.takes_residual = config.moe_gemma4_block  # (the layer passes its residual beside the normed input)
        self.shared_output_norm = self.routed_input_norm = self.routed_output_norm = None
        if config.moe_gemma4_block:
            self.shared_output_norm = build_norm(config, groups)
            self.routed_input_norm = build_norm(config, groups)
            self.routed_output_norm = build_norm(config, groups)
        self.replay_slot = None  # this layer's index among its rank's MoE layers (SequenceLayout.routes)
        self.shared_gate = None
        if config.moe_shared_expert_gate:
            self.shared_gate = nn.Parameter(torch.empty(1, config.hidden_size))
            normal_init(config.seed, f"{name}.shared_gate", config.init_method_std)(self.shared_gate)

    @property
    def local_experts(self) -> nn.ModuleList:
        return self.deepspeed_moe.experts.deepspeed_experts

    @property
    def grouped_gemm(self) -> bool:
        """Whether the experts run as grouped GEMMs (--moe-grouped-gemm, on a device whose kernel ran)."""
        return self.deepspeed_moe.experts.grouped

    def forward(self, x: torch.Tensor, residual: torch.Tensor = None, layout=None) -> torch.Tensor:
        """x: the layer's normed input; `residual` (--moe-gemma4-block): the layer's input itself, which the router
        reads and the routed experts read through their own norm; `layout` (hybrid.model.sequence): where it
        carries --grpo's recorded routing, the router replays or compares it; decoding records it."""
        if self.groups.tp_size > 1 and not self.config.sequence_parallel and torch.is_grad_enabled():
            # training splits the tokens over TP (each rank routes its shard); without gradients (decoding, where a
            # step's one position cannot be split) every TP rank routes all tokens through its replicated experts
            raise RuntimeError("an MoE layer at TP > 1 needs sequence parallelism (each TP rank routes its shard)")
        s, b, h = x.shape
        flat = x.reshape(s * b, h)
        slot = self.replay_slot if layout is not None else None
        replay = None if slot is None else layout.routes_of(slot, self.groups, self.config.sequence_parallel)
        if self.takes_residual:  # (transformers' Gemma4TextDecoderLayer)
            probs, indices, _ = self.router(residual.reshape(s * b, h), s, replay)
            flat = self.routed_input_norm(residual).reshape(s * b, h)
        else:
            probs, indices, _ = self.router(flat, s, replay)
        if slot is not None:
            layout.record_routes(slot, indices, self.groups, self.config.sequence_parallel)
        keep, padded_to = None, None
        c = self.config
        if c.moe_expert_capacity_factor is not None:
            keep = capacity_keep(probs, indices, self.num_experts, c.moe_expert_capacity_factor,
                                 c.moe_token_drop_policy)
            if c.moe_pad_expert_input_to_capacity:
                padded_to = expert_capacity(*indices.shape, self.num_experts, c.moe_expert_capacity_factor)
        self.router.count(indices, keep)
        out = self.dispatcher(flat, probs.to(x.dtype), indices, keep, self._experts, padded_to).view(s, b, h)
        if self.routed_output_norm is not None:
            out = self.routed_output_norm(out)
        if self.shared_mlp is not None:
            shared = self.shared_mlp(x)
            if self.shared_output_norm is not None:
                shared = self.shared_output_norm(shared)
            if self.shared_gate is not None:
                gate = sync_replicated_grad(self.shared_gate, self.groups.tp_group) if c.sequence_parallel \
                    else self.shared_gate
                shared = torch.sigmoid(F.linear(x, gate)) * shared
            out = out + shared
        return out

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor, sizes=None) -> torch.Tensor:
        tp = self.groups.tp_group if self.config.sequence_parallel else C.SINGLE_RANK
        return self.deepspeed_moe.experts.compute(rows, counts, self.activation, tp, sizes)
