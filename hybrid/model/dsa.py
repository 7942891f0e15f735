"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5; transformers' DeepseekV32Indexer, megatron-core's
experimental_attention_variant 'dsa'): beside multi-latent attention a lightning indexer scores every earlier key t
for each query s,

    score(s, t) = sum_h w_h(s) relu(q_h(s) . k(t) / sqrt(D)) / sqrt(H)
    q = wq_b(the MLA query latent) [H x D],  k = LayerNorm(wk(x)) [D],  w = weights_proj(x) [H] (in fp32),

rope rotating the first qk_pos_emb_head_dim features of q and k (halves, with MLA's tables), and each query
attends only the `dsa_indexer_topk` keys that score highest (every key while it has fewer).

The indexer runs without gradient and its weights are frozen: transformers' forward runs it under no_grad, and
DeepSeek's KL training of it (megatron-core's dsa_indexer_loss_coeff) is not built here, so the LM loss trains
everything else exactly as transformers' backward does.

Layouts: the indexer is replicated over TP (each rank masks its own heads with the same selection); under sequence
parallelism its three small projections run on the rank's tokens and are all-gathered. Queries are taken in blocks
(DSA_BLOCK rows): the scores are [block, H, keys] and the mask [block, keys] at a time, never [s, s] whole (each
block's attention is recomputed in backward, so no mask is kept for it), and each row's selection is the one the
whole row gives. Context parallelism and Ulysses (its keys on other ranks) are refused by name (capabilities'
dsa-sequence-split), and so is a sliding window with it. Decoding caches each token's indexer key beside MLA's
latents (hybrid.model.kv_cache) and scores a prompt's queries in the same blocks. The attention is SDPA with a mask:
the FLOPs of dense attention (DeepSeek's sparse kernels are not used)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hybrid.model.init import normal_init
from hybrid.model.rotary import apply_rotary
from hybrid.parallel import collectives as C

DSA_BLOCK = 512  # query rows scored and attended at a time
INDEXER_NORM_EPS = 1e-6  # the indexer's key LayerNorm (transformers' and DeepSeek's, whatever rms_norm_eps says)


class Indexer(nn.Module):
    """The lightning indexer of one layer (frozen; see the module docstring): wq_b [H D, q_lora_rank], wk [D, h],
    k_norm (LayerNorm of D, weight and bias), weights_proj [H, h]."""

    def __init__(self, config, name: str):
        super().__init__()
        self.heads, self.dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        self.topk, std, h = config.dsa_indexer_topk, config.init_method_std, config.hidden_size
        self.wq_b = nn.Parameter(torch.empty(self.heads * self.dim, config.q_lora_rank), requires_grad=False)
        self.wk = nn.Parameter(torch.empty(self.dim, h), requires_grad=False)
        self.k_norm_weight = nn.Parameter(torch.ones(self.dim), requires_grad=False)
        self.k_norm_bias = nn.Parameter(torch.zeros(self.dim), requires_grad=False)
        self.weights_proj = nn.Parameter(torch.empty(self.heads, h), requires_grad=False)
        for part in ("wq_b", "wk", "weights_proj"):
            normal_init(config.seed, f"{name}.indexer.{part}", std)(getattr(self, part))

    @torch.no_grad()
    def project(self, x, q_latent, cos, sin, tp_group=None):
        """The indexer's queries [s, b, H, D] (roped), keys [s, b, D] (roped) and head weights [s, b, H] (fp32,
        x 1/sqrt(H)) of x [s(/tp), b, h] and the query latent [s(/tp), b, r]; all-gathered over `tp_group` (sequence
        parallelism) when given."""
        q = F.linear(q_latent, self.wq_b)
        k = F.layer_norm(F.linear(x, self.wk), (self.dim,), self.k_norm_weight, self.k_norm_bias, INDEXER_NORM_EPS)
        w = F.linear(x.float(), self.weights_proj.float()) * self.heads ** -0.5
        if tp_group is not None and C.group_size(tp_group) > 1:
            q, k, w = (C.all_gather_along_dim(t.contiguous(), 0, tp_group) for t in (q, k, w))
        s, b = q.shape[:2]
        q = apply_rotary(q.view(s, b, self.heads, self.dim), cos, sin)
        k = apply_rotary(k.view(s, b, 1, self.dim), cos, sin)[:, :, 0]
        return q, k, w

    @torch.no_grad()
    def select(self, q, k, w, allowed) -> torch.Tensor:
        """[b, rows, keys] bool: the keys each query row may attend, its top-k of the allowed ones. q [rows, b, H, D],
        k [keys, b, D], w [rows, b, H] (project's), allowed [b, rows, keys] bool (causal, documents, filled slots).
        The scores as transformers computes them: [b, rows, H, keys] products in fp32, then the heads' weighted sum."""
        scores = torch.matmul(q.transpose(0, 1).float(), k.transpose(0, 1).transpose(-1, -2).float().unsqueeze(1))
        scores = F.relu(scores * self.dim ** -0.5)
        index = torch.matmul(w.transpose(0, 1).unsqueeze(-2), scores).squeeze(-2)  # [b, rows, keys]
        index = index.masked_fill(~allowed, float("-inf"))
        chosen = index.topk(min(self.topk, index.size(-1)), dim=-1).indices
        return torch.zeros_like(allowed).scatter_(-1, chosen, True) & allowed


def allowed_keys_of(rows: torch.Tensor, keys: int, documents=None) -> torch.Tensor:
    """[b or 1, rows, keys] bool: causal (a key at or before the query), within the query's document."""
    allowed = (torch.arange(keys, device=rows.device)[None, :] <= rows[:, None])[None]
    if documents is not None:
        allowed = allowed & (documents[:, rows, None] == documents[:, None, :keys])
    return allowed


def sparse_attention(q, k, v, indexer: Indexer, index, scale: float, dropout: float = 0.0, documents=None):
    """MLA's attention with DSA: q, k [s, b, heads/tp, d], v [s, b, heads/tp, dv], `index` = indexer.project's
    (q, k, w) for the same s tokens -> context [s, b, heads/tp * dv]; queries in blocks of DSA_BLOCK, each block
    recomputed in backward (torch.utils.checkpoint, its RNG state kept for dropout) so that no block's mask
    [rows, keys] outlives it: the layer keeps q, k, v and the indexer's outputs, memory linear in s."""
    s, b = q.size(0), q.size(1)
    iq, ik, iw = index
    v_dim = v.size(-1)
    if torch.compiler.is_compiling():  # TorchInductor's SDPA pattern needs one head size (as CoreAttention pads)
        v = F.pad(v, (0, q.size(-1) - v_dim))
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]

    def block(q_rows, k, v, start: int):
        end = start + q_rows.size(2)
        rows = torch.arange(start, end, device=q_rows.device)
        allowed = allowed_keys_of(rows, s, documents).expand(b, -1, -1)
        keep = indexer.select(iq[start:end], ik, iw[start:end], allowed)
        return F.scaled_dot_product_attention(q_rows, k, v, attn_mask=keep[:, None], dropout_p=dropout, scale=scale)
    recompute = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    outs = [checkpoint(block, q[:, :, start:start + DSA_BLOCK], k, v, start, use_reentrant=False) if recompute
            else block(q[:, :, start:start + DSA_BLOCK], k, v, start) for start in range(0, s, DSA_BLOCK)]
    out = torch.cat(outs, dim=2)[..., :v_dim]
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)
