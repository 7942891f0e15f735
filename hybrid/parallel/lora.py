"""Low-rank adapters (LoRA) beside a tensor-parallel linear, as PEFT computes them: y = W x + s B A dropout(x),
s = alpha / r (rsLoRA: alpha / sqrt(r)), A [r, in], B [out, r].

Split over TP as PEFT's Megatron path splits them, so no collective is added to the forward:
- beside a column-parallel W (output features split): A whole on every rank, B split by rows with W's rows. The
  adapter reads the same gathered input as W; A's gradient is partial on each rank (each holds a slice of B) and
  is summed over TP inside autograd (mappings.sync_replicated_grad, a [r, in] all-reduce).
- beside a row-parallel W (input features split): A split by columns with W's columns, B whole. B A_i x_i is this
  rank's partial sum of B A x and joins W's partial sum before the one reduction; B's gradient (from the partial
  A_i x_i) is summed over TP the same way.

A fused linear (the QKV projection, a gated fc1 = [gate; up]) carries one adapter per HF projection it fuses
(`pieces`), so what trains is what PEFT trains on the separate projections; each piece's output is placed where
the fused layout keeps that projection's rows (hybrid.model.qkv's groups; fc1's stacked halves).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.parallel import mappings as M
from hybrid.parallel.layers import mark_tensor_parallel, shard
from hybrid.parallel.random import fork_tp_rng

COLUMN, ROW = "column", "row"
SINGLE, STACKED, GROUPED_QKV = "single", "stacked", "grouped_qkv"  # how the pieces' outputs make the fused output


def kaiming_uniform_(tensor: torch.Tensor, generator: torch.Generator) -> None:
    """PEFT's initialisation of A: nn.init.kaiming_uniform_(a=sqrt(5)) (bound 1 / sqrt(fan_in)), from `generator`."""
    nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)


class LoRAPiece(nn.Module):
    """One HF projection's adapter: A [r, in(/tp)] and B [out(/tp), r] as this rank holds them (module docstring).
    `forward(x)`: s B A dropout(x) on this rank's input (column: the gathered input; row: its feature slice)."""

    def __init__(self, kind: str, in_features: int, out_features: int, rank: int, scale: float, dropout: float,
                 groups, seed: int, dtype, device):
        super().__init__()
        self.kind, self.scale, self.dropout, self.groups = kind, scale, dropout, groups
        tp, tp_rank = groups.tp_size, groups.tp_rank
        # on the CPU whatever constructors ZeRO-3's Init redirects (the generator is a CPU one)
        full_a = torch.empty(rank, in_features, dtype=torch.float32, device="cpu")
        kaiming_uniform_(full_a, torch.Generator().manual_seed(seed))
        if kind == COLUMN:  # A whole, B's rows split with the base weight's
            a, b = full_a, torch.zeros(out_features // tp, rank, device="cpu")
        else:  # A's columns split with the base weight's, B whole
            a, b = shard(full_a, 1, tp_rank, tp), torch.zeros(out_features, rank, device="cpu")
        self.A = nn.Parameter(a.to(dtype=dtype, device=device))
        self.B = nn.Parameter(b.to(dtype=dtype, device=device))
        if kind == COLUMN:
            mark_tensor_parallel(self.B, 0)
        else:
            mark_tensor_parallel(self.A, 1)
        self.enabled = True  # False: the base model alone (a reference with the adapters off)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout and self.training:
            if self.kind == ROW:  # each rank drops its own features
                with fork_tp_rng():
                    x = F.dropout(x, self.dropout)
            else:  # every TP rank holds the same input: the same mask (the default stream, equal over TP)
                x = F.dropout(x, self.dropout)
        replicated = self.A if self.kind == COLUMN else self.B
        synced = M.sync_replicated_grad(replicated, self.groups.tp_group)
        a, b = (synced, self.B) if self.kind == COLUMN else (self.A, synced)
        # [s, b, in] -> [s, b, r] -> [s, b, out(/tp)]
        return F.linear(F.linear(x.to(a.dtype), a), b) * self.scale


class LoRA(nn.Module):
    """The adapters of one (possibly fused) linear: a LoRAPiece per adapted HF projection, by name. `layout`: how the
    pieces' outputs make the linear's (SINGLE; STACKED: concatenated, fc1's [gate | up]; GROUPED_QKV: per query
    group its query heads, key and value, `qkv_shape` = (heads_per_group, head_dim)); `widths`: the local output
    width of every piece of the fused layout in order (an unadapted one contributes zeros)."""

    def __init__(self, pieces: dict, widths: dict, layout: str, qkv_shape: Optional[tuple] = None):
        super().__init__()
        for name, piece in pieces.items():
            self.add_module(name, piece)
        self.widths, self.layout, self.qkv_shape = dict(widths), layout, qkv_shape

    def enabled(self) -> bool:
        return any(piece.enabled for piece in self.children())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' output [.., out_local], added to the base linear's (its partial sum, for a row linear)."""
        outs = []
        for name, width in self.widths.items():
            piece = getattr(self, name, None)
            outs.append(piece(x) if piece is not None and piece.enabled
                        else x.new_zeros(x.shape[:-1] + (width,)))
        if self.layout == SINGLE:
            return outs[0]
        if self.layout == STACKED:
            return torch.cat(outs, dim=-1)
        per_group, head_dim = self.qkv_shape  # [.., G*P*d], [.., G*d], [.., G*d] -> [.., G*(P+2)*d]
        q, k, v = outs
        lead = q.shape[:-1]
        grouped = torch.cat([q.view(*lead, -1, per_group * head_dim), k.view(*lead, -1, head_dim),
                             v.view(*lead, -1, head_dim)], dim=-1)
        return grouped.flatten(-2)
