"""Rotary position embedding in the rotate-half layout (transformers' Llama, Megatron-core)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from hybrid.model.config import yarn_mscale


def yarn_attention_factor(scaling: dict) -> float:
    """The factor YaRN multiplies the cos/sin tables by (transformers' attention_factor, Megatron's mscale)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dim = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(all_dim))
    return yarn_mscale(factor)


def _yarn_inv_freq(dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN's frequencies (Peng et al. 2023), as transformers' _compute_yarn_parameters: those turning fewer than
    beta_slow times over original_max_position_embeddings divided by `factor`, those turning more than beta_fast
    times kept, a linear ramp between (its ends rounded out to whole dimensions unless `truncate` is False)."""
    factor, old_context = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations):
        return (dim * math.log(old_context / (rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: Optional[dict], base: float = 10000.0) -> torch.Tensor:
    """The inverse frequencies after rope scaling, as transformers' `modeling_rope_utils` computes them.

    linear: every frequency divided by `factor` (Megatron's --rotary-seq-len-interpolation-factor).
    llama3 (Llama 3.1+): wavelengths above original_max_position_embeddings / low_freq_factor are
    divided by `factor`, those below .../ high_freq_factor kept, the band between interpolated smoothly.
    yarn: see _yarn_inv_freq (Megatron's --position-embedding-type yarn / --rope-type yarn).
    proportional (Gemma 4's full-attention layers, --rotary-proportional-percent P): the first int(P x head_dim / 2)
    frequencies kept, the others 0 (those feature pairs pass unrotated), every one divided by `factor`.
    """
    if not scaling:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "proportional":  # (transformers' _compute_proportional_rope_parameters)
        turned = int(float(scaling.get("partial_rotary_factor", 1.0)) * (2 * inv_freq.numel()) // 2)
        return torch.cat([inv_freq[:turned], inv_freq.new_zeros(inv_freq.numel() - turned)]) / factor
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(2 * inv_freq.numel(), base, scaling)
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions 0..s-1, computed in fp32 and cached per length and device."""

    def __init__(self, head_dim: int, base: float = 10000.0, scaling: Optional[dict] = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", scaled_inv_freq(inv_freq, scaling, base), persistent=False)
        # YaRN scales the tables themselves (the attention's temperature); 1 otherwise
        self.table_scale = yarn_attention_factor(scaling) if scaling and scaling["rope_type"] == "yarn" else 1.0
        self._cache = None
        self.key = ("rope", head_dim, base, repr(scaling))  # equal tables have equal keys (decoding shares them)

    def forward(self, seq_len: int, device, positions=None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [s, 1, 1, head_dim] (broadcast over batch and heads); for given `positions`
        [s, b] (documents' own, hybrid.model.sequence) [s, b, 1, head_dim], computed afresh."""
        if positions is not None:
            freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(device)  # [s, b, d/2]
            emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
            return self._scaled(emb.cos()), self._scaled(emb.sin())
        key = (seq_len, str(device))
        if self._cache is None or self._cache[0] != key:
            positions = torch.arange(seq_len, device=device, dtype=torch.float32)
            freqs = torch.outer(positions, self.inv_freq.to(device))  # [s, d/2]
            emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [s, 1, 1, d]
            self._cache = (key, self._scaled(emb.cos()), self._scaled(emb.sin()))
        return self._cache[1], self._cache[2]

    def _scaled(self, table: torch.Tensor) -> torch.Tensor:
        return table if self.table_scale == 1.0 else table * self.table_scale


def llama_4_query_scale(config, seq_len: int, device, positions=None) -> Optional[torch.Tensor]:
    """The queries' factor 1 + beta ln(1 + floor(position / length)) (--llama-4-scaling-beta / -length: Mistral 4's,
    transformers' get_llama_4_attn_scale) as [s, b or 1, 1, 1] for positions 0..s-1 or `positions` [s, b]; None
    without it. Exactly 1 below the length."""
    if config.llama_4_scaling_beta is None:
        return None
    p = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] if positions is None else positions.float()
    scale = 1 + config.llama_4_scaling_beta * torch.log(1 + torch.floor(p / config.llama_4_scaling_length))
    return scale[:, :, None, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    """[x1*c - x2*s | x2*c + x1*s] (sign 1: forward) or its transpose (sign -1: the gradient), c and s
    the tables' first halves (their two halves are equal), written into one new tensor."""
    half = x.size(-1) // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out1, out2 = out[..., :half], out[..., half:]
    torch.mul(x1, c, out=out1)
    torch.mul(x2, c, out=out2)
    if sign > 0:
        out1.sub_(x2 * s)
        out2.add_(x1 * s)
    else:
        out1.add_(x2 * s)
        out2.sub_(x1 * s)
    return out


class _Rotary(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin without rotate_half's negated copy and concatenations (in forward
    and in backward); keeps only the tables, as autograd does. Bitwise the plain expression's values
    and gradient (negation is exact, and the two tables' halves are equal)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [s, b, heads, d] by the tables (no Python loop over positions or heads); tables narrower than
    the head (--rotary-percent) rotate its first features, the rest pass unchanged (Megatron-core, transformers)."""
    rotated = cos.size(-1)
    if rotated < x.size(-1):
        return torch.cat((apply_rotary(x[..., :rotated], cos, sin), x[..., rotated:]), dim=-1)
    if torch.compiler.is_compiling():  # TorchInductor fuses the plain expression into one kernel
        return (x * cos.to(x.dtype)) + (rotate_half(x) * sin.to(x.dtype))
    return _Rotary.apply(x, cos, sin)
