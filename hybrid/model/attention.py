"""Causal self-attention: fused QKV (column-parallel, layout in hybrid.model.qkv), optional Q/K norms
and RoPE, core attention backends (causal or sliding-window), output (row-parallel).
"""

from __future__ import annotations

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.sequence.layer import DistributedAttention

from hybrid.model import gated_delta_net
from hybrid.model.flash import flash_attn_func
from hybrid.model.init import normal_init, output_layer_std
from hybrid.model.norms import HeadsRMSNorm, build_norm, rms_normalize
from hybrid.model.qkv import split_qkv
from hybrid.model.rotary import RotaryEmbedding, apply_rotary, llama_4_query_scale
from hybrid.model.sinks import sink_attention
from hybrid.parallel.fp8 import gemm_for
from hybrid.parallel.groups import as_groups
from hybrid.parallel.layers import ColumnParallelLinear, RowParallelLinear, make_parallel_param
from hybrid.parallel.random import fork_tp_rng
from hybrid.parallel.ring_attention import BlockDropout, allowed_keys, kernel_note, ring_attention


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v with a causal mask and attention dropout; no parameters.

    Backends: flash-attn (with `use_flash_attn`, when importable, on CUDA, fp16/bf16);
    an explicit fp32-softmax path for `apply_query_key_layer_scaling` under fp16 (Megatron's
    numerics: scores divided by an extra layer-number factor, restored inside the fp32 softmax);
    otherwise torch's scaled_dot_product_attention.
    """

    def __init__(self, config, layer_number: int):
        super().__init__()
        self.dropout = config.attention_dropout
        self.use_flash_attn = config.use_flash_attn
        self.query_key_layer_scaling = config.apply_query_key_layer_scaling
        self.layer_number = max(1, layer_number + 1)  # Megatron counts layers from 1
        self.scale = config.attention_scale
        self.window = config.layer_window(layer_number)  # None: plain causal

    def backend(self, q: torch.Tensor) -> str:
        if (self.use_flash_attn and flash_attn_func is not None and q.is_cuda
                and q.dtype in (torch.float16, torch.bfloat16)):
            return "flash"
        if self.query_key_layer_scaling and q.dtype == torch.float16:
            return "scaled_math"
        return "sdpa"

    def forward(self, q, k, v, documents=None, cp=None, ulysses=None, sinks=None):
        """q [s, b, nq, d], k/v [s, b, ng, d] -> context [s, b, nq*d]; `documents` [b, s]: each query
        attends keys of its own document only (hybrid.model.sequence). This rank may hold part of the
        sequence: `cp` (the context-parallel Axis): chunks, attention is the K/V ring; `ulysses` (its
        Axis): a contiguous part, DeepSpeed's all-to-all attention gives each rank whole sequences of
        heads / N for the local backends. `sinks` [nq]: each head's learned sink logit (hybrid.model.sinks)."""
        if cp is not None:
            v, v_dim = _pad_values(v, q.size(-1))  # the ring passes K and V as one tensor
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # -> [b, heads, s_local, d]
            dropout = self.dropout if self.training else 0.0
            seed = self.dropout_seed(q) if dropout else None
            out = ring_attention(q, k, v, cp, self.scale, documents, dropout=dropout, seed=seed,
                                 sinks=sinks, window=self.window)[..., :v_dim]
            s, b = out.size(2), out.size(0)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        if ulysses is not None:

            # the all-to-all gives Ulysses rank r heads r * n/N .. (r + 1) * n/N of this TP rank's
            local_sinks = None if sinks is None else sinks.view(ulysses.size, -1)[ulysses.rank]

            def whole_sequences(q, k, v):  # [s, b, heads/N, d] -> [s, b, heads/N, value d]
                return self.local(q, k, v, documents, local_sinks).view(v.shape[:-2] + (q.size(2), v.size(-1)))
            attention = DistributedAttention(whole_sequences, ulysses.group, scatter_idx=2, gather_idx=0)
            out = attention(q, k, v, 1)  # batch dim 1; [s/N, b, nq, d]
            return out.reshape(out.size(0), out.size(1), -1)
        return self.local(q, k, v, documents, sinks)

    def dropout_seed(self, q) -> torch.Tensor:
        """The seed of one call's hashed dropout masks (ring_attention.keep_mask), drawn from the per-TP-rank
        stream (its own on each CP / Ulysses rank), as masks are drawn from it otherwise; selective recompute
        redraws the same."""
        with fork_tp_rng():
            return torch.randint(0, 2**62, (), dtype=torch.int64, device=q.device)

    def local(self, q, k, v, documents=None, sinks=None):
        """Attention over whole sequences held on this rank (every backend)."""
        dropout = self.dropout if self.training else 0.0
        if sinks is not None:
            return self._with_sinks(q, k, v, sinks, documents, dropout)
        if dropout == 0.0:  # no randomness: no RNG fork (it copies generator states on every call)
            return self._attend(q, k, v, 0.0, documents)
        with fork_tp_rng():  # heads are TP-sharded: dropout masks must differ per TP rank
            return self._attend(q, k, v, dropout, documents)

    def _with_sinks(self, q, k, v, sinks, documents=None, dropout: float = 0.0):
        """Attention with sinks (hybrid.model.sinks): causal in one call, or in query blocks where a window or
        documents mask keys (as blocked_attention); attention dropout on the math kernel, its keep mask hashed
        from the positions (BlockDropout)."""
        s, b = q.size(0), q.size(1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # -> [b, heads, s, d]
        seed = self.dropout_seed(q) if dropout else None

        def drop(start: int, end: int, first_key: int):  # the dropout of queries start..end against keys first_key..
            if seed is None:
                return None
            return BlockDropout(dropout, seed, b, q.size(1), torch.arange(start, end, device=q.device),
                                torch.arange(first_key, end, device=q.device))
        if documents is None and (self.window is None or s <= self.window):
            out = sink_attention(q, k, v, sinks, self.scale, dropout=drop(0, s, 0))
        else:
            outs = []
            for start, end, first_key in window_blocks(s, self.window):
                positions = torch.arange(first_key, end, device=q.device)
                mask = allowed_keys(positions[start - first_key:], positions, self.window)[None, None]
                if documents is not None:
                    mask = mask & (documents[:, start:end, None] == documents[:, None, first_key:end])[:, None]
                outs.append(sink_attention(q[:, :, start:end], k[:, :, first_key:end], v[:, :, first_key:end],
                                           sinks, self.scale, mask, causal=False, dropout=drop(start, end, first_key)))
            out = torch.cat(outs, dim=2)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _attend(self, q, k, v, dropout, documents=None):
        s, b, nq, d = q.shape
        backend = self.backend(q)
        if documents is not None and backend == "flash":
            backend = "sdpa"  # flash-attn's varlen form needs host-side document lengths (a host sync)
        if backend == "flash":  # flash-attn takes [b, s, heads, d] and handles GQA itself
            window = (-1, -1) if self.window is None else (self.window - 1, 0)  # (left, right) keys
            v, v_dim = _pad_values(v, d)  # one head size for Q, K and V
            out = flash_attn_func(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                  dropout_p=dropout, softmax_scale=self.scale, causal=True, window_size=window)
            return out[..., :v_dim].transpose(0, 1).reshape(s, b, -1)
        v_dim = v.size(-1)
        if torch.compiler.is_compiling():  # torch 2.13's TorchInductor fails on SDPA with values of their own head
            v, v_dim = _pad_values(v, d)  # size (MLA; its fuse_attention pattern check): padded as for flash-attn
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # -> [b, heads, s, d]
        if backend == "scaled_math":
            if k.size(1) != nq:  # GQA: each KV head serves its group's consecutive query heads
                k = k.repeat_interleave(nq // k.size(1), dim=1)
                v = v.repeat_interleave(nq // v.size(1), dim=1)
            out = self._scaled_math(q, k, v, dropout, documents)
        elif documents is not None:
            out = blocked_attention(q, k, v, self.window, dropout, self.scale, documents=documents)
        elif self.window is not None and s > self.window:
            out = windowed_attention(q, k, v, self.window, dropout, self.scale)
        else:  # SDPA shares each KV head with its group's query heads itself (no K/V copies)
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=self.scale,
                                                 enable_gqa=k.size(1) != nq)
        return out[..., :v_dim].permute(2, 0, 1, 3).reshape(s, b, -1)  # [b, n, s, d] -> [s, b, n*d]

    def _scaled_math(self, q, k, v, dropout, documents=None):
        coeff = float(self.layer_number)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (self.scale / coeff)  # fp16, kept small
        positions = torch.arange(scores.size(-1), device=q.device)
        hidden = ~allowed_keys(positions, positions, self.window)
        if documents is not None:  # [b, 1, s, s]
            hidden = hidden | (documents[:, None, :, None] != documents[:, None, None, :])
        probs = torch.softmax((scores.float() * coeff).masked_fill(hidden, float("-inf")), dim=-1)
        probs = F.dropout(probs, dropout).to(q.dtype)
        return torch.matmul(probs, v)


def _pad_values(v: torch.Tensor, d: int) -> tuple:
    """V [..., value d] zero-padded to the query/key head size d where it is smaller (MLA), for the kernels that
    take one head size; (padded V, value d) -- the output's first value d features are the attention's."""
    v_dim = v.size(-1)
    return (v if v_dim == d else F.pad(v, (0, d - v_dim))), v_dim


def backend_notes(config, context_parallel: int, device_type: str = "cpu", dtype=torch.float32) -> list[str]:
    """Which attention kernels run where a choice is made for the run: one line each, for the run's log."""
    notes = [note for note in [gated_delta_net.backend_note(config, device_type)] if note]
    if context_parallel > 1:
        # (a CUDA run on this machine reads its GPU; a plan made elsewhere assumes one with flash-attention)
        capability = torch.cuda.get_device_capability() if device_type == "cuda" and torch.cuda.is_available() \
            else (9, 0)
        note = kernel_note(device_type, dtype, config.splits_documents, config.attention_dropout > 0, capability,
                           config.head_dim, config.sliding_window is not None)
        notes.append(f"--context-parallel-size {context_parallel}: the ring's blocks run {note}")
    if not config.use_flash_attn:
        return notes
    if context_parallel > 1:
        return notes + [f"--use-flash-attn with --context-parallel-size {context_parallel}: the ring attention runs "
                        f"its own block kernels (above), not flash-attn"]
    if config.reset_attention_mask:
        return notes + ["--use-flash-attn with --reset-attention-mask: packed documents run SDPA over document "
                        "blocks (flash-attn's variable-length form would read the document lengths on the host every "
                        "step)"]
    return notes


WINDOW_BLOCK = 256  # the least query block of windowed_attention (small windows would mean many tiny blocks)
DOCUMENT_BLOCK = 512  # query block of document-masked attention: masks are [block, keys], never [s, s]


def window_blocks(s: int, window, block: int = None) -> list[tuple[int, int, int]]:
    """(first query, end, first key) of each query block of blocked_attention (window None: every
    earlier key, in blocks of DOCUMENT_BLOCK)."""
    if window is None:
        block = block or DOCUMENT_BLOCK
        return [(start, min(start + block, s), 0) for start in range(0, s, block)]
    block = block or max(window, WINDOW_BLOCK)
    return [(start, min(start + block, s), max(0, start - window + 1)) for start in range(0, s, block)]


def blocked_attention(q, k, v, window, dropout: float, scale: float, block: int = None, documents=None):
    """Causal attention on [b, heads, s, d] by query blocks, without an s x s mask: each block of
    queries attends the keys it may see (from `window - 1` before the block with a sliding window,
    else from the start) to its end, masked by position and, with `documents` [b, s], to the
    query's own document; masks and scores are [block, keys], memory linear in s."""
    gqa = k.size(1) != q.size(1)
    outs = []
    for start, end, first_key in window_blocks(q.size(2), window, block):
        positions = torch.arange(first_key, end, device=q.device)
        mask = allowed_keys(positions[start - first_key:], positions, window)  # [block, keys]
        if documents is not None:  # [b, 1, block, keys]: same document only
            mask = (mask & (documents[:, start:end, None] == documents[:, None, first_key:end]))[:, None]
        outs.append(F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, first_key:end], v[:, :, first_key:end],
                                                   attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


def windowed_attention(q, k, v, window: int, dropout: float, scale: float, block: int = None):
    """Sliding-window causal attention on [b, heads, s, d] (blocked_attention with a window)."""
    return blocked_attention(q, k, v, window, dropout, scale, block)


class SelfAttention(nn.Module):
    """Fused QKV projection, optional RoPE, core attention, output projection: one TP all-reduce."""

    def __init__(self, config, groups, layer_number: int, name: str):
        super().__init__()
        groups = as_groups(groups)
        tp = groups.tp_size
        config = config.layer_config(layer_number)  # (Gemma 4: the full layers' own head size and KV heads)
        self.config = config
        self.layer_number = layer_number
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.head_dim = config.head_dim
        self.values = not config.attention_k_eq_v  # --attention-k-eq-v: the keys serve as values
        # --num-kv-shared-layers (Gemma 4): a sharing layer attends with the keys and values its source layer computed
        # in the same pass (linked by hybrid.model.virtual_stages), and projects queries only
        self.reads_kv = config.kv_source(layer_number) is not None
        self.kv_readers, self.last_reader, self.shared_kv = 0, False, None
        keys = 0 if self.reads_kv else 2 if self.values else 1
        qkv_size = (config.num_attention_heads + keys * config.num_query_groups) * config.head_dim
        d = config.head_dim  # a rank's QKV rows: per KV group its query heads (q), its key (k), its value (v)
        projections = ([(0, self.heads_per_group * d)] + [(1, d)] * (keys > 0) + [(2, d)] * (keys > 1)) * \
            (config.num_query_groups // tp)
        self.qkv = ColumnParallelLinear(
            config.hidden_size, qkv_size, groups,
            normal_init(config.seed, f"{name}.qkv.weight", config.init_method_std),
            bias=config.qkv_bias, sequence_parallel=config.sequence_parallel,
            overlap=config.async_tensor_model_parallel_allreduce,
            fp8=gemm_for(config, groups, name, "column", projections))
        # per-head norms of Q and K (Qwen3): each TP rank normalises its own heads, so their
        # replicated weights get partial gradients, summed over TP
        self.q_norm = build_norm(config, groups, config.head_dim, tp > 1) if config.qk_layernorm else None
        self.k_norm = build_norm(config, groups, config.head_dim, tp > 1) \
            if config.qk_layernorm and not self.reads_kv else None
        if config.qk_norm_across_heads:  # MiniMax-M2: one norm over all of Q's heads, one over K's (split over TP)
            self.q_norm = HeadsRMSNorm(config.num_attention_heads, config.head_dim, config.norm_epsilon, groups)
            self.k_norm = HeadsRMSNorm(config.num_query_groups, config.head_dim, config.norm_epsilon, groups)
        self.core = CoreAttention(config, layer_number)
        self.dense = RowParallelLinear(
            config.num_attention_heads * config.head_dim, config.hidden_size, groups,
            normal_init(config.seed, f"{name}.dense.weight",
                        output_layer_std(config.init_method_std, config.num_layers)),
            bias=config.add_bias_linear, input_is_parallel=True, sequence_parallel=config.sequence_parallel,
            fp8=gemm_for(config, groups, name, "row"))
        self.rotary = (RotaryEmbedding(config.rotary_dim, *config.layer_rope(layer_number))
                       if config.position_embedding_type == "rope" else None)
        # --attention-output-gate (Qwen3.5, Qwen3-Next): each head's output x sigmoid(x W_gate), the gate a projection
        # of its own beside the fused QKV (transformers stores it inside q_proj, interleaved per head)
        self.gate = ColumnParallelLinear(
            config.hidden_size, config.num_attention_heads * config.head_dim, groups,
            normal_init(config.seed, f"{name}.gate.weight", config.init_method_std), bias=False,
            sequence_parallel=config.sequence_parallel, overlap=config.async_tensor_model_parallel_allreduce,
            fp8=gemm_for(config, groups, name, "column")) if config.attention_output_gate else None
        self.recompute_core = config.recompute_granularity == "selective"
        # --softmax-type learnable (GPT-OSS): each head's sink logit, split over TP with the heads
        self.sinks = make_parallel_param((config.num_attention_heads,), 0, 1, groups, nn.init.zeros_,
                                          torch.float32, None) if config.attention_sinks else None

    def forward(self, x, layout=None):
        """x [s(/tp), b, h]; `layout` (hybrid.model.sequence.SequenceLayout): documents and positions."""
        gate = None if self.gate is None else torch.sigmoid(self.gate(x))  # [s, b, nq/tp * d]
        qkv = self.qkv(x)  # [s(/tp), b, h] -> [s, b, groups/tp * (heads_per_group + 2, 1 or 0) * d]
        s = qkv.size(0)
        decoding = getattr(layout, "cache", None) is not None  # hybrid.model.kv_cache: the cached keys too
        if self.reads_kv:
            q, k, v = qkv.view(*qkv.shape[:-1], -1, self.head_dim), None, None  # [s, b, nq/tp, d]
        else:  # [s, b, nq/tp, d], [s, b, ng/tp, d]
            q, k, v = split_qkv(qkv, self.heads_per_group, self.head_dim, -1, self.values)
            if v is None:  # --attention-k-eq-v: the keys as projected (before their norm and rope) are the values
                v = k
            if self.config.v_norm:
                v = rms_normalize(v, self.config.norm_epsilon)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = None if k is None else self.k_norm(k)
        if self.rotary is not None:
            if decoding:  # every layer of the step uses the same tables
                cos, sin = layout.shared(self.rotary.key, lambda: self.rotary(s, x.device, layout.positions))
            else:
                cos, sin = self.rotary(s, x.device, None if layout is None else layout.positions)
            q = apply_rotary(q, cos, sin)
            k = None if k is None else apply_rotary(k, cos, sin)
        scale = llama_4_query_scale(self.config, s, x.device, None if layout is None else layout.positions)
        if scale is not None:  # (after rope, as transformers applies it)
            q = q * scale.to(q.dtype)
        if decoding:
            if self.reads_kv:  # the source layer's cached keys and values, this step's included
                return self.output(layout.attend_cached(self.kv_source.layer_number, q, self.core.scale,
                                                        self.core.window, self.sinks), gate)
            return self.output(layout.attend(self.layer_number, q, k, v, self.core.scale, self.core.window,
                                             self.sinks), gate)
        if self.reads_kv:
            k, v = self.kv_source.shared_kv
            if self.last_reader:  # (no later layer reads them: not kept past this pass)
                self.kv_source.shared_kv = None
        elif self.kv_readers:
            self.shared_kv = (k, v)
        split = (None, None, None) if layout is None else (layout.documents, layout.cp, layout.ulysses)
        if self.recompute_core and self.training and torch.is_grad_enabled():
            # Selective recompute (Korthikanti et al. 2022): keep q, k, v; recompute the
            # s x s scores, softmax and dropout in backward. DeepSpeed restores the RNG states.
            context = deepspeed.checkpointing.checkpoint(self.core, q, k, v, *split, self.sinks)
        else:
            context = self.core(q, k, v, *split, self.sinks)
        return self.output(context, gate)

    def output(self, context, gate=None):
        """The output projection of the heads' context [s, b, nq/tp * d] (gated: --attention-output-gate)
        -> [s(/tp), b, h]."""
        return self.dense(context if gate is None else context * gate)
