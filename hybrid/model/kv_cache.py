"""The key/value cache of decoding: the model's own attention layers run over new tokens only, attending the
keys and values every earlier step wrote (hybrid.model.generate drives it).

A batch of prompts of different lengths is left-padded to one width, so every row's new token fills the same
slot: slot j holds the j-th token of the padded row; `valid` marks the slots that hold a real token. A query
attends the slots up to its own that are valid (and, with a sliding window, the last `window` of them by slot:
padding only precedes a row's tokens, so slot distances are position distances). A padding slot's query attends
itself only, so its (unused) keys and values stay finite and never reach a real token through a zero weight.

Multi-latent attention (hybrid.model.mla) caches what its keys and values are made from, the normed latent and
the shared rope key of each token (kv_lora_rank + qk_pos_emb_head_dim numbers, against heads x (qk + v head
sizes) for its keys and values: 576 against 40,960 for DeepSeek-V3). A step of one new token per row attends
them as DeepSeek-V2 describes (the up projection absorbed into the queries and the output, `attend_latent`); the
prompt's step (compute-bound, many queries) makes the keys and values of its slots from their latents and attends
them as any attention, without keeping them.

Gated DeltaNet layers cache a fixed-size state and their conv's last inputs instead (hybrid.model.gated_delta_net).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from hybrid.model.dsa import DSA_BLOCK
from hybrid.model.sequence import SequenceLayout


class KVCache:
    """Every layer's keys and values of one batch of rows, [b, kv heads/tp, slots, d] each, preallocated (MLA:
    its latents and rope keys, as one head each)."""

    def __init__(self, rows: int, slots: int, valid: torch.Tensor):
        self.rows, self.slots = rows, slots
        self.valid = valid  # [b, slots] bool: which slots hold a real token (written as they fill)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}  # DSA: each layer's indexer keys [b, slots, D]
        # Gated DeltaNet layers (hybrid.model.gated_delta_net) keep no keys: their recurrent state [b, v heads/tp,
        # dk, dv] and their conv's last K - 1 inputs [K - 1, b, channels/tp], the same size at every step
        self.linear_states: dict[int, torch.Tensor] = {}
        self.conv_tails: dict[int, torch.Tensor] = {}

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [s, b, kv heads, d] at slots start .. start+s; the layer's filled slots [b, heads, end, d]."""
        s, b, heads, d = k.shape
        if layer not in self.keys:
            self.keys[layer] = k.new_zeros(b, heads, self.slots, d)
            self.values[layer] = v.new_zeros(b, heads, self.slots, v.size(-1))  # (MLA: its own head size)
        end = start + s
        self.keys[layer][:, :, start:end] = k.permute(1, 2, 0, 3)
        self.values[layer][:, :, start:end] = v.permute(1, 2, 0, 3)
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def write_index(self, layer: int, start: int, k: torch.Tensor) -> torch.Tensor:
        """Store DSA's indexer keys k [s, b, D] at slots start .. start+s; the layer's filled slots [end, b, D]."""
        s, b, d = k.shape
        if layer not in self.index_keys:
            self.index_keys[layer] = k.new_zeros(self.slots, b, d)
        self.index_keys[layer][start:start + s] = k
        return self.index_keys[layer][:start + s]

    def select(self, index: torch.Tensor) -> None:
        """Keep rows `index` [n] of every tensor, in that order (a row twice: copied; generate's shared prefill and
        its ended rows leaving the batch)."""
        for rows_first in (self.keys, self.values, self.linear_states):
            for layer, t in rows_first.items():
                rows_first[layer] = t.index_select(0, index)
        for rows_second in (self.index_keys, self.conv_tails):
            for layer, t in rows_second.items():
                rows_second[layer] = t.index_select(1, index)
        self.valid = self.valid.index_select(0, index)
        self.rows = index.numel()

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (*self.keys.values(), *self.values.values(), *self.index_keys.values(),
                             *self.linear_states.values(), *self.conv_tails.values()))


@dataclass
class DecodeLayout(SequenceLayout):
    """The layout of a decoding step: the new tokens' positions [s, b] (rotary and learned position tables),
    the slot the first of them fills, and the cache their attention reads and writes."""

    cache: Optional[KVCache] = field(default=None)
    start: int = 0
    memo: dict = field(default_factory=dict)  # what every layer of the step shares: masks, rotary tables

    def routes_of(self, slot: int, groups, sequence_parallel: bool):
        return None  # (decoding records the routing, SequenceLayout.routes; it replays none)

    def record_routes(self, slot: int, indices: torch.Tensor, groups=None, sequence_parallel: bool = False) -> None:
        """MoE layer `slot`'s experts [s x b, k] (sequence-major) for the step's new positions, into the routing
        record [b, slots, layers, k] where the generation keeps one (--grpo: hybrid.model.generate)."""
        if self.routes is not None:
            b = self.routes.size(0)
            self.routes[:, self.start:self.start + indices.size(0) // b, slot] = \
                indices.view(-1, b, indices.size(-1)).transpose(0, 1).to(self.routes.dtype)

    def shared(self, key, make):
        """`make()` once per step for `key` (the layers of a step share their masks and rotary tables)."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def mask(self, s: int, window: Optional[int], device) -> torch.Tensor:
        """[b, 1, s, end] bool: the filled slots each new position attends (see the module docstring)."""
        end = self.start + s
        query_slot = torch.arange(self.start, end, device=device)[:, None]
        key_slot = torch.arange(end, device=device)[None, :]
        allowed = key_slot <= query_slot  # [s, end]
        if window is not None:
            allowed = allowed & (key_slot > query_slot - window)
        return ((allowed & self.cache.valid[:, None, :end]) | (key_slot == query_slot))[:, None]

    def index_keep(self, layer: int, indexer, q, k, w) -> torch.Tensor:
        """DSA (hybrid.model.dsa): [b, s, end] bool, the filled slots each new position's indexer chooses among those
        it attends, from its queries q [s, b, H, D], head weights w [s, b, H] and the new keys k [s, b, D] (cached)."""
        keys = self.cache.write_index(layer, self.start, k)
        allowed = self.shared(("mask", q.size(0), None), lambda: self.mask(q.size(0), None, q.device))[:, 0]
        return torch.cat([indexer.select(q[i:i + DSA_BLOCK], keys, w[i:i + DSA_BLOCK], allowed[:, i:i + DSA_BLOCK])
                          for i in range(0, q.size(0), DSA_BLOCK)], dim=1)  # (a prompt's queries in blocks)

    def _kept(self, mask: torch.Tensor, keep) -> torch.Tensor:
        """The step's mask [b, 1, s, end] narrowed to DSA's chosen slots `keep` [b, s, end] (a padding position,
        which attends itself only and may have chosen nothing, keeps its own)."""
        if keep is None:
            return mask
        narrowed = mask & keep[:, None]
        return torch.where(narrowed.any(-1, keepdim=True), narrowed, mask)

    def attend(self, layer: int, q, k, v, scale: float, window: Optional[int], sinks=None) -> torch.Tensor:
        """q [s, b, nq, d], the new k, v [s, b, ng, d] -> context [s, b, nq*d] over every filled slot; `sinks`
        [nq]: each head's sink logit (hybrid.model.sinks)."""
        keys, values = self.cache.write(layer, self.start, k, v)
        return self.attend_slots(q, keys, values, scale, window, sinks)

    def attend_cached(self, layer: int, q, scale: float, window: Optional[int], sinks=None) -> torch.Tensor:
        """q [s, b, nq, d] against layer `layer`'s filled slots, this step's written by that layer before (a layer
        reading another's keys and values: --num-kv-shared-layers) -> context [s, b, nq*d]."""
        end = self.start + q.size(0)
        return self.attend_slots(q, self.cache.keys[layer][:, :, :end], self.cache.values[layer][:, :, :end], scale,
                                 window, sinks)

    def attend_slots(self, q, keys, values, scale: float, window: Optional[int], sinks=None,
                     keep=None) -> torch.Tensor:
        """q [s, b, nq, d] against the filled slots' keys and values [b, ng, end, d] -> context [s, b, nq*d];
        `keep`: DSA's chosen slots (index_keep)."""
        s, b, nq, d = q.shape
        mask = self._kept(self.shared(("mask", s, window), lambda: self.mask(s, window, q.device)), keep)
        q = q.permute(1, 2, 0, 3)
        if sinks is not None:  # the few new positions' scores, a sink column in their softmax (transformers' eager)
            group = nq // keys.size(1)
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
            scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
            scores = scores.masked_fill(~mask, float("-inf"))
            sink = sinks.float()[None, :, None, None].expand(b, nq, s, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
            out = torch.matmul(probs.to(values.dtype), values)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                                 enable_gqa=keys.size(1) != nq)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def attend_latent(self, q_nope, q_pos, latents, rope_keys, up_key, up_value, scale: float,
                      window: Optional[int], keep=None) -> torch.Tensor:
        """MLA's decoding step over its cached latents: q_nope [s, b, h, n] and q_pos [s, b, h, p] (roped), the
        filled slots' normed latents [b, 1, end, c] and roped keys [b, 1, end, p]; up_key [h, n, c] and up_value
        [h, v, c] the up projection's blocks of each head -> context [s, b, h*v]. A head's score
        q_nope . (W_k c) + q_pos . k_pos is (W_k^T q_nope) . c + q_pos . k_pos and its output W_v (P c): one
        attention with a single key [c | k_pos] and value c, every head's queries as its rows (no copy of the
        key per head; the mask, [b, h*s, end], is small for the step's few rows), no head's keys or values made."""
        s, b, h, _ = q_nope.shape
        end = latents.size(2)
        mask = self._kept(self.shared(("mask", s, window), lambda: self.mask(s, window, q_nope.device)),
                          keep)  # [b, 1, s, end]
        q = torch.cat((torch.einsum("sbhn,hnc->bhsc", q_nope, up_key), q_pos.permute(1, 2, 0, 3)), dim=-1)
        out = F.scaled_dot_product_attention(q.reshape(b, 1, h * s, -1), torch.cat((latents, rope_keys), dim=-1),
                                             latents, attn_mask=mask.expand(b, h, s, end).reshape(b, 1, h * s, end),
                                             scale=scale)
        return torch.einsum("bhsc,hvc->sbhv", out.view(b, h, s, -1), up_value).reshape(s, b, -1)
