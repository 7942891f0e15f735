"""Multi-head latent attention (DeepSeek-V2/V3; megatron-core's MultiLatentAttention, transformers'
DeepseekV3Attention): each token's keys and values come from one low-rank latent, its queries from another
(or from one projection), and rope acts on a part of each query head and on one key part shared by all heads.

    q        = q_up(norm(q_down(x)))       (or q(x))                      [s, b, heads, qk_head + pos_emb]
    latent   = kv_down(x) = [c (kv_lora_rank) | k_pos (pos_emb)]
    k, v     = kv_up(norm(c)) split per head into [qk_head | v_head];  k = [k | rope(k_pos) for every head]
    out      = dense(attention(q with rope on its last pos_emb features, k, v))

TP: the up projections are column-parallel (heads split) and the output row-parallel, as in Megatron; the down
projections and their norms are replicated (a rank computes every latent of its tokens). Under sequence
parallelism the down projections see this rank's tokens only (their gradients are summed over TP) and the up
projections all-gather the latents, which are smaller than the hidden states. The shared rope key is used by
every rank's heads: its gradient is summed over TP (all-reduced, or reduce-scattered with its gather under SP).

Rope rotates halves (rotate_half), as the rest of the model: checkpoints whose rope features are stored
interleaved (DeepSeek's, `rope_interleave`; megatron-core's MLA) are permuted on import and export
(hybrid.conversion.families), which gives the same attention to the bit.
"""

from __future__ import annotations

import contextlib

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.model.attention import CoreAttention
from hybrid.model.dsa import Indexer, sparse_attention
from hybrid.model.moe.router import AuxLossBackward
from hybrid.model.init import normal_init, output_layer_std
from hybrid.model.norms import build_norm
from hybrid.model.rotary import RotaryEmbedding, apply_rotary, llama_4_query_scale
from hybrid.parallel.groups import as_groups
from hybrid.parallel.layers import ColumnParallelLinear, RowParallelLinear
from hybrid.parallel.mappings import copy_to_tp_region, gather_from_sequence_parallel_region, sync_replicated_grad
from hybrid.parallel.random import fork_tp_rng


class ReplicatedLinear(nn.Module):
    """y = x W^T with W whole on every TP rank (a down projection); under sequence parallelism each rank sees
    its own tokens, so W's gradient is summed over TP."""

    def __init__(self, input_size: int, output_size: int, groups, init_method, sequence_parallel: bool):
        super().__init__()
        self.tp_group, self.sequence_parallel = as_groups(groups).tp_group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        init_method(self.weight)

    def forward(self, x):
        weight = sync_replicated_grad(self.weight, self.tp_group) if self.sequence_parallel else self.weight
        return F.linear(x, weight)


class MultiLatentAttention(nn.Module):
    """The attention block of an MLA layer (see the module docstring); SelfAttention's interface."""

    def __init__(self, config, groups, layer_number: int, name: str):
        super().__init__()
        groups = as_groups(groups)
        self.config, self.layer_number, self.groups = config, layer_number, groups
        heads, h, sp = config.num_attention_heads, config.hidden_size, config.sequence_parallel
        self.heads = heads // groups.tp_size
        self.nope, self.pos, self.v_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        std, overlap = config.init_method_std, config.async_tensor_model_parallel_allreduce

        def column(inputs, outputs, part):
            return ColumnParallelLinear(inputs, outputs, groups, normal_init(config.seed, f"{name}.{part}.weight", std),
                                        bias=False, sequence_parallel=sp, overlap=overlap)

        if config.q_lora_rank is None:
            self.q = column(h, heads * config.head_dim, "q")
        else:
            self.q_down = ReplicatedLinear(h, config.q_lora_rank, groups,
                                           normal_init(config.seed, f"{name}.q_down.weight", std), sp)
            self.q_down_norm = build_norm(config, groups, config.q_lora_rank, eps=config.mla_latent_norm_epsilon)
            self.q_up = column(config.q_lora_rank, heads * config.head_dim, "q_up")
        self.kv_down = ReplicatedLinear(h, config.kv_lora_rank + self.pos, groups,
                                        normal_init(config.seed, f"{name}.kv_down.weight", std), sp)
        self.kv_down_norm = build_norm(config, groups, config.kv_lora_rank, eps=config.mla_latent_norm_epsilon)
        self.kv_up = column(config.kv_lora_rank, heads * (self.nope + self.v_dim), "kv_up")
        self.core = CoreAttention(config, layer_number)
        self.dense = RowParallelLinear(
            heads * self.v_dim, h, groups,
            normal_init(config.seed, f"{name}.dense.weight", output_layer_std(std, config.num_layers)),
            bias=config.add_bias_linear, input_is_parallel=True, sequence_parallel=sp)
        self.rotary = RotaryEmbedding(config.rotary_dim, *config.layer_rope(layer_number))
        self.recompute_core = config.recompute_granularity == "selective"
        # DeepSeek sparse attention (hybrid.model.dsa): the lightning indexer choosing each query's keys, or
        # (GLM-5's index sharing) the choice of an earlier layer's, `index_source` (RankModel links it)
        self.dsa = config.dsa_indexer_topk is not None
        shared = self.dsa and config.dsa_source(layer_number) is not None
        self.indexer = Indexer(config, name) if self.dsa and not shared else None
        self.index_source = None  # (a plain attribute: the source layer is not a child of this one)
        self.index_readers = 0  # the layers of this stage that read this one's choice (RankModel links them)
        self.last_reader = False  # this layer is its source's last reader in a pass: it releases what it read
        self.last_index = self.last_keep = None  # what a sharing layer reads of this one's pass (while it is read)

    def forward(self, x, layout=None):
        """x [s(/tp), b, h] -> [s(/tp), b, h]; `layout` as SelfAttention's."""
        tp_group = self.groups.tp_group
        if self.config.q_lora_rank is None:
            q = self.q(x)
        else:
            q_latent = self.q_down_norm(self.q_down(x))
            q = self.q_up(q_latent)  # [s, b, heads/tp * (nope + pos)]
        latent, k_pos = self.kv_down(x).split([self.config.kv_lora_rank, self.pos], dim=-1)
        latent = self.kv_down_norm(latent)  # [s(/tp), b, kv_lora_rank]
        # the rope key serves every rank's heads: its gradient is the sum of theirs
        k_pos = gather_from_sequence_parallel_region(k_pos, tp_group) if self.config.sequence_parallel \
            else copy_to_tp_region(k_pos, tp_group)
        s, b = q.size(0), q.size(1)
        q = q.view(s, b, self.heads, self.nope + self.pos)
        decoding = getattr(layout, "cache", None) is not None
        if decoding:
            cos, sin = layout.shared(self.rotary.key, lambda: self.rotary(s, x.device, layout.positions))
        else:
            cos, sin = self.rotary(s, x.device, None if layout is None else layout.positions)
        q_nope, q_pos = q.split([self.nope, self.pos], dim=-1)
        q_pos = apply_rotary(q_pos, cos, sin)
        scale = llama_4_query_scale(self.config, s, x.device, None if layout is None else layout.positions)
        if scale is not None:  # Mistral 4's query temperature, after rope (as transformers applies it)
            q_nope, q_pos = q_nope * scale.to(q.dtype), q_pos * scale.to(q.dtype)
        k_pos = apply_rotary(k_pos.view(s, b, 1, self.pos), cos, sin)
        index, indexer = None, self.indexer
        if self.indexer is not None:
            index = self.indexer.project(x.detach(), q_latent.detach(), cos, sin,
                                         tp_group if self.config.sequence_parallel else None)
            if self.index_readers:
                self.last_index = index
        elif self.dsa:  # GLM-5's index sharing: the source layer's choice, from its indexer's outputs of this pass
            index, indexer = self.index_source.last_index, self.index_source.indexer
            if self.last_reader and not decoding:
                self.index_source.last_index = None
        if decoding:  # the cache holds latents and rope keys (hybrid.model.kv_cache); sequence parallelism is off
            latents, rope_keys = layout.cache.write(self.layer_number, layout.start, latent[:, :, None], k_pos)
            keep = None
            if self.indexer is not None:
                keep = layout.index_keep(self.layer_number, self.indexer, *index)
                if self.index_readers:
                    self.last_keep = keep
            elif self.dsa:
                keep = self.index_source.last_keep
                if self.last_reader:
                    self.index_source.last_index = self.index_source.last_keep = None
            return self.dense(self._decode(q_nope, q_pos, latents, rope_keys, layout, keep))
        k, v = self._keys_values(latent, k_pos)
        q = torch.cat((q_nope, q_pos), dim=-1)
        if index is not None:  # DSA: each query's top-k keys (layout checks refuse CP and Ulysses with it)
            dropout = self.core.dropout if self.training else 0.0
            documents = None if layout is None else layout.documents
            # --dsa-indexer-loss-coeff: this layer's own indexer trains by its KL loss (hybrid.model.dsa)
            kl = self.indexer is not None and self.indexer.trains and self.training and torch.is_grad_enabled()
            kl_group = (self.groups.tp_group if self.groups.tp_size > 1 else None) if kl else False
            with fork_tp_rng() if dropout else contextlib.nullcontext():  # (heads split over TP: their own masks)
                context, loss = sparse_attention(q, k, v, indexer, index, self.core.scale, dropout, documents, kl_group)
            if loss is not None:  # (its gradient reaches the indexer alone: the LM loss's factor, as MoE's losses)
                self.indexer.logged["dsa_indexer_loss"] = loss.detach() + self.indexer.logged.get("dsa_indexer_loss", 0)
                context = AuxLossBackward.apply(context, loss, self.indexer.aux_loss_scale)
            return self.dense(context)
        split = (None, None, None) if layout is None else (layout.documents, layout.cp, layout.ulysses)
        if self.recompute_core and self.training and torch.is_grad_enabled():
            context = deepspeed.checkpointing.checkpoint(self.core, q, k, v, *split)
        else:
            context = self.core(q, k, v, *split)
        return self.dense(context)  # [s, b, heads/tp * v] -> [s(/tp), b, h]

    def _keys_values(self, latent, k_pos):
        """Each head's keys [s, b, heads/tp, nope + pos] and values [s, b, heads/tp, v] from the normed latents
        [s(/tp), b, c] (the up projection) and the roped shared key [s, b, 1, pos]."""
        kv = self.kv_up(latent)  # [s, b, heads/tp * (nope + v)]
        s, b = kv.shape[:2]
        k_nope, v = kv.view(s, b, self.heads, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
        return torch.cat((k_nope, k_pos.expand(s, b, self.heads, self.pos)), dim=-1), v.contiguous()

    def _decode(self, q_nope, q_pos, latents, rope_keys, layout, keep=None):
        """A decoding step's context [s, b, heads/tp * v] from the filled slots' latents [b, 1, end, c] and rope
        keys [b, 1, end, p]: one new token per row with the up projection absorbed (its weight read here:
        ZeRO-3 gathers it with this module, hybrid.training.engine), the prompt's step through the projection."""
        if q_nope.size(0) == 1:
            up = self.kv_up.weight.view(self.heads, self.nope + self.v_dim, -1)
            return layout.attend_latent(q_nope, q_pos, latents, rope_keys, up[:, :self.nope], up[:, self.nope:],
                                        self.core.scale, self.core.window, keep)
        k, v = self._keys_values(latents[:, 0].transpose(0, 1), rope_keys.permute(2, 0, 1, 3))  # every filled slot
        keys, values = (t.permute(1, 2, 0, 3) for t in (k, v))  # [b, heads/tp, end, d]
        return layout.attend_slots(torch.cat((q_nope, q_pos), dim=-1), keys, values, self.core.scale,
                                   self.core.window, keep=keep)
