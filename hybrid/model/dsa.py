"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5; transformers' DeepseekV32Indexer, megatron-core's
experimental_attention_variant 'dsa'): beside multi-latent attention a lightning indexer scores every earlier key t
for each query s,

    score(s, t) = sum_h w_h(s) relu(q_h(s) . k(t) / sqrt(D)) / sqrt(H)
    q = wq_b(the MLA query latent) [H x D],  k = LayerNorm(wk(x)) [D],  w = weights_proj(x) [H] (in fp32),

rope rotating the first qk_pos_emb_head_dim features of q and k (halves, with MLA's tables), and each query
attends only the `dsa_indexer_topk` keys that score highest (every key while it has fewer).

The indexer runs without gradient and its weights are frozen, as transformers' forward runs it (under no_grad), so the
LM loss trains everything else exactly as transformers' backward does. With --dsa-indexer-loss-coeff C > 0 it trains
as megatron-core trains it (compute_dsa_indexer_loss): its inputs detached, so the LM loss never reaches it, and a KL
divergence to the main attention added per layer: for each query the target is the main attention's probabilities
(of its detached queries and keys, per head, summed over the heads and over TP, L1-normalised), the prediction the
softmax of the index scores, both over the causal keys (--dsa-indexer-use-sparse-loss: over the chosen top-k only);
KL(target || prediction) averaged over the micro-batch's queries, times C, reaches the indexer through its output's
backward (as MoE's auxiliary losses do), computed in the same query blocks, recomputed in backward.

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
from hybrid.parallel import mappings as M

DSA_BLOCK = 512  # query rows scored and attended at a time
INDEXER_NORM_EPS = 1e-6  # the indexer's key LayerNorm (transformers' and DeepSeek's, whatever rms_norm_eps says)


class Indexer(nn.Module):
    """The lightning indexer of one layer (frozen, or trained by its KL loss alone; see the module docstring):
    wq_b [H D, q_lora_rank], wk [D, h], k_norm (LayerNorm of D, weight and bias), weights_proj [H, h]."""

    def __init__(self, config, name: str):
        super().__init__()
        self.heads, self.dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        self.topk, std, h = config.dsa_indexer_topk, config.init_method_std, config.hidden_size
        # --dsa-indexer-loss-coeff: trained by its KL loss alone (see the module docstring); else frozen
        self.loss_coeff, self.sparse_loss = config.dsa_indexer_loss_coeff, config.dsa_indexer_use_sparse_loss
        self.trains = self.loss_coeff > 0
        self.aux_loss_scale = 1.0  # the LM loss's backward factor, set before each step (training's MoE hooks)
        self.logged: dict = {}  # the detached KL losses since the last log line
        trains = self.trains
        self.wq_b = nn.Parameter(torch.empty(self.heads * self.dim, config.q_lora_rank), requires_grad=trains)
        self.wk = nn.Parameter(torch.empty(self.dim, h), requires_grad=trains)
        self.k_norm_weight = nn.Parameter(torch.ones(self.dim), requires_grad=trains)
        self.k_norm_bias = nn.Parameter(torch.zeros(self.dim), requires_grad=trains)
        self.weights_proj = nn.Parameter(torch.empty(self.heads, h), requires_grad=trains)
        for part in ("wq_b", "wk", "weights_proj"):
            normal_init(config.seed, f"{name}.indexer.{part}", std)(getattr(self, part))

    def project(self, x, q_latent, cos, sin, tp_group=None):
        """The indexer's queries [s, b, H, D] (roped), keys [s, b, D] (roped) and head weights [s, b, H] (fp32,
        x 1/sqrt(H)) of x [s(/tp), b, h] and the query latent [s(/tp), b, r] (both detached); all-gathered over
        `tp_group` (sequence parallelism) when given. With gradient only where the indexer trains (its KL loss)."""
        trains = self.trains and torch.is_grad_enabled()
        with torch.set_grad_enabled(trains):
            params = [self.wq_b, self.wk, self.k_norm_weight, self.k_norm_bias, self.weights_proj]
            if trains and tp_group is not None:  # each TP rank projects its tokens: the gradients summed over TP
                params = [M.sync_replicated_grad(p, tp_group) for p in params]
            wq_b, wk, k_norm_weight, k_norm_bias, weights_proj = params
            q = F.linear(q_latent, wq_b)
            k = F.layer_norm(F.linear(x, wk), (self.dim,), k_norm_weight, k_norm_bias, INDEXER_NORM_EPS)
            w = F.linear(x.float(), weights_proj.float()) * self.heads ** -0.5
            if tp_group is not None and C.group_size(tp_group) > 1:
                if trains:  # (every TP rank's loss is the whole sequence's: its gradient is complete on each)
                    q, k, w = (M.gather_from_sequence_parallel_region(t, tp_group, grad_is_partial=False)
                               for t in (q, k, w))
                else:
                    q, k, w = (C.all_gather_along_dim(t.contiguous(), 0, tp_group) for t in (q, k, w))
            s, b = q.shape[:2]
            q = apply_rotary(q.view(s, b, self.heads, self.dim), cos, sin)
            k = apply_rotary(k.view(s, b, 1, self.dim), cos, sin)[:, :, 0]
            return q, k, w

    def scores(self, q, k, w) -> torch.Tensor:
        """[b, rows, keys] fp32: the index scores of q [rows, b, H, D], k [keys, b, D], w [rows, b, H] (project's), as
        transformers computes them: [b, rows, H, keys] products in fp32, then the heads' weighted sum."""
        scores = torch.matmul(q.transpose(0, 1).float(), k.transpose(0, 1).transpose(-1, -2).float().unsqueeze(1))
        scores = F.relu(scores * self.dim ** -0.5)
        return torch.matmul(w.transpose(0, 1).unsqueeze(-2), scores).squeeze(-2)

    @torch.no_grad()
    def choose(self, index: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """[b, rows, keys] bool: the top-k of the allowed keys by the index scores [b, rows, keys]."""
        index = index.masked_fill(~allowed, float("-inf"))
        chosen = index.topk(min(self.topk, index.size(-1)), dim=-1).indices
        return torch.zeros_like(allowed).scatter_(-1, chosen, True) & allowed

    @torch.no_grad()
    def select(self, q, k, w, allowed) -> torch.Tensor:
        """[b, rows, keys] bool: the keys each query row may attend, its top-k of the allowed ones (scores's
        inputs; allowed [b, rows, keys] bool: causal, documents, filled slots)."""
        return self.choose(self.scores(q, k, w), allowed)


def indexer_kl(index, keep, allowed, q, k, scale: float, sparse: bool, tp_group=None) -> torch.Tensor:
    """[b, rows]: each query's KL(main attention || indexer) (megatron-core's compute_dsa_indexer_loss, per row):
    index [b, rows, keys] the index scores (with gradient), keep / allowed [b, rows, keys] the chosen / causal keys,
    q [b, heads, rows, d] and k [b, heads, keys, d] the main attention's (detached) with its `scale`; the heads'
    probabilities summed over `tp_group` (the heads split over TP)."""
    mask = keep if sparse else allowed
    with torch.no_grad():
        attention = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        target = attention.masked_fill(~mask[:, None], float("-inf")).softmax(dim=-1).sum(dim=1)
        if tp_group is not None:
            C.all_reduce(target, tp_group)
        target = target / target.sum(dim=-1, keepdim=True)
    predicted = index.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (target * (torch.log(target + 1e-10) - torch.log(predicted + 1e-10))).sum(dim=-1)


def allowed_keys_of(rows: torch.Tensor, keys: int, documents=None) -> torch.Tensor:
    """[b or 1, rows, keys] bool: causal (a key at or before the query), within the query's document."""
    allowed = (torch.arange(keys, device=rows.device)[None, :] <= rows[:, None])[None]
    if documents is not None:
        allowed = allowed & (documents[:, rows, None] == documents[:, None, :keys])
    return allowed


def sparse_attention(q, k, v, indexer: Indexer, index, scale: float, dropout: float = 0.0, documents=None,
                     kl_group=False):
    """MLA's attention with DSA: q, k [s, b, heads/tp, d], v [s, b, heads/tp, dv], `index` = indexer.project's
    (q, k, w) for the same s tokens -> (context [s, b, heads/tp * dv], the indexer's KL loss or None); queries in
    blocks of DSA_BLOCK, each block recomputed in backward (torch.utils.checkpoint, its RNG state kept for dropout)
    so that no block's mask [rows, keys] outlives it: the layer keeps q, k, v and the indexer's outputs, memory
    linear in s. `kl_group` (not False): this layer's indexer trains (indexer_kl; the group its heads split over, or
    None), its loss computed per block."""
    s, b = q.size(0), q.size(1)
    iq, ik, iw = index
    kl = kl_group is not False
    v_dim = v.size(-1)
    if torch.compiler.is_compiling():  # TorchInductor's SDPA pattern needs one head size (as CoreAttention pads)
        v = F.pad(v, (0, q.size(-1) - v_dim))
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]

    def block(q_rows, k, v, start: int, iq_rows, ik, iw_rows):
        end = start + q_rows.size(2)
        rows = torch.arange(start, end, device=q_rows.device)
        allowed = allowed_keys_of(rows, s, documents).expand(b, -1, -1)
        index_rows = indexer.scores(iq_rows, ik, iw_rows) if kl else None
        keep = indexer.choose(index_rows, allowed) if kl else indexer.select(iq_rows, ik, iw_rows, allowed)
        out = F.scaled_dot_product_attention(q_rows, k, v, attn_mask=keep[:, None], dropout_p=dropout, scale=scale)
        if not kl:
            return out, None
        loss = indexer_kl(index_rows, keep, allowed, q_rows.detach(), k.detach(), scale, indexer.sparse_loss,
                          kl_group).sum()
        return out, loss
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, iq, ik, iw))
    parts = [(q[:, :, start:start + DSA_BLOCK], k, v, start, iq[start:start + DSA_BLOCK], ik,
              iw[start:start + DSA_BLOCK]) for start in range(0, s, DSA_BLOCK)]
    results = [checkpoint(block, *part, use_reentrant=False) if recompute else block(*part) for part in parts]
    out = torch.cat([r[0] for r in results], dim=2)[..., :v_dim]
    loss = sum(r[1] for r in results) * (indexer.loss_coeff / (b * s)) if kl else None
    return out.permute(2, 0, 1, 3).reshape(s, b, -1), loss
