"""Attention sinks (GPT-OSS; Megatron-LM's --softmax-type learnable): each head has a learned logit s that joins
the softmax's denominator and no value,

    y_i = sum_j exp(x_ij) v_j / (sum_j exp(x_ij) + exp(s)) = o_i * sigmoid(lse_i - s),

o and lse the plain attention's output and log-sum-exp (transformers' eager GPT-OSS appends s as a last score
column and drops it after the softmax: the same numbers). So any kernel that returns the log-sum-exp gives it:
the fused ones of hybrid.parallel.ring_attention (block_forward / block_backward), here for a rank's whole
sequence (in query blocks where a window or documents mask keys) and inside the ring under context parallelism.

Attention dropout (transformers' eager GPT-OSS drops the key columns of that softmax, and megatron-core drops the
probabilities after its softmax with the offset): y_i = sigma_i sum_j dropped(P_ij) v_j, P the keys' softmax, so the
math kernel's dropout (a block's keep mask hashed from the positions, hybrid.parallel.ring_attention.BlockDropout)
gives it, and the backward below stays exact with the same mask.

Backward: with sigma = sigmoid(lse - s), the kernel's own backward given grad_out' = sigma dy and out' = y yields the
exact gradients of q, k and v (its rowsum(grad_out' * out') is then sigma^2 rowsum(dy o), which is what the
log-sum-exp's own gradient changes it to), and ds = -sum over queries of rowsum(dy y) (1 - sigma).
"""

from __future__ import annotations

import torch

from hybrid.parallel.ring_attention import BlockDropout, block_backward, block_forward, sink_gradient, sink_weights


class _SinkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, mask, causal: bool, scale: float, dropout: BlockDropout):
        out, lse, state = block_forward(q, k, v, mask, causal, scale, dropout=dropout)
        weights = sink_weights(lse, sinks)
        out = (out.float() * weights[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.mask, ctx.causal, ctx.scale, ctx.state, ctx.dropout = mask, causal, scale, state, dropout
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        weights = sink_weights(lse, sinks)
        scaled = (grad.float() * weights[..., None]).to(grad.dtype)
        dq, dk, dv = block_backward(scaled, q, k, v, out, lse, ctx.mask, ctx.causal, ctx.scale, dropout=ctx.dropout,
                                    state=ctx.state)
        return dq, dk, dv, sink_gradient(grad, out, weights).to(sinks.dtype), None, None, None, None


def sink_attention(q, k, v, sinks, scale: float, mask=None, causal: bool = True,
                   dropout: BlockDropout = None) -> torch.Tensor:
    """Attention with sinks on [b, heads, sq, d] queries against [b, kv heads, sk, d] keys and values (GQA: the
    kernels share each KV head); `mask` bool [b or 1, 1, sq, sk] of the pairs that may attend (with `causal`
    False), else causal. `sinks` [heads]; `dropout` the attention dropout of these queries and keys, or None."""
    return _SinkAttention.apply(q, k, v, sinks, mask, causal, scale, dropout)
