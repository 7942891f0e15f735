"""Context parallelism's attention: a ring over K/V blocks (Megatron-LM's --cp-comm-type p2p).

The sequence is cut into 2 x CP chunks and CP rank r holds chunks r and 2CP-1-r (Megatron's causal
load balancing: every rank gets as many query-key pairs). Each rank keeps its queries; the K/V
blocks travel around the CP ring, CP - 1 hops, the next block's send/recv posted before the current
block is computed so the two overlap. Per block the attention kernel returns its output and the
log-sum-exp of its scores; the outputs are merged exactly (softmax statistics), so the result is
the full sequence's attention. Backward runs the ring again with the merged output and log-sum-exp
(the flash-attention backward gives each block's exact share), and each block's K/V gradient
travels with it back to its owner.

Which part of a block can attend what follows from the chunk order (no mask needed without
documents): the own block is causal; a block from an earlier rank is seen whole by all local queries
through its first chunk only; one from a later rank is seen whole by the local second chunk only.
With packed documents a block is further masked to same-document pairs.

Block kernels: on CPU aten's fused flash-attention for CPU (forward and backward, with masks); on
other devices an exact math kernel (scores of one block at a time, recomputed in backward). Written
here because torch's own context parallel (torch.distributed.tensor.experimental) runs on DTensor
with CUDA kernels only and has no document masks, and DeepSpeed has no ring attention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def local_index(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions of the full sequence held by `cp_rank`: chunks r and 2CP-1-r of 2CP chunks."""
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


# -- block kernels: q [b, h, sq, d], k/v [b, h, sk, d], mask None or bool [b or 1, 1, sq, sk] -------------

def _additive(mask, dtype):
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def block_forward(q, k, v, mask, causal: bool, scale: float, math: bool = False):
    """One block's attention output [b, h, sq, d] and log-sum-exp [b, h, sq] (fp32; -inf where a
    query may see no key of the block)."""
    if q.device.type == "cpu" and not math:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None if mask is None else _additive(mask, q.dtype), scale=scale)
        lse = lse.float()
    else:
        scores = _scores(q, k, mask, causal, scale)
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.exp(scores - lse[..., None]).nan_to_num(0.0).to(v.dtype), v)
    if mask is not None:
        seen = mask.any(dim=-1)  # [b, 1, sq]
        lse = lse.masked_fill(~seen, float("-inf"))
        out = out.masked_fill(~seen[..., None], 0.0)
    return out, lse


def block_backward(grad_out, q, k, v, out, lse, mask, causal: bool, scale: float, math: bool = False):
    """Gradients of one block's q, k, v given the merged output and log-sum-exp of these queries."""
    if q.device.type == "cpu" and not math:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal,
            attn_mask=None if mask is None else _additive(mask, q.dtype), scale=scale)
    probs = torch.exp(_scores(q, k, mask, causal, scale) - lse[..., None])  # masked pairs: exp(-inf) = 0
    grad_out32, v32 = grad_out.float(), v.float()
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out32)
    delta = (grad_out32 * out.float()).sum(dim=-1, keepdim=True)
    grad_scores = probs * (torch.matmul(grad_out32, v32.transpose(-1, -2)) - delta) * scale
    grad_q = torch.matmul(grad_scores, k.float())
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q.float())
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


def _scores(q, k, mask, causal, scale):
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


# -- the ring -------------------------------------------------------------------------------------------

class _Ring:
    """Send to the next CP rank, receive from the previous one, asynchronously (gloo and NCCL)."""

    def __init__(self, group, size: int, rank: int):
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)
        self.group = group

    def shift(self, tensor: torch.Tensor):
        """Post the exchange; returns (received buffer, wait function)."""
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group),
               dist.P2POp(dist.irecv, received, self.prev, self.group)]
        requests = dist.batch_isend_irecv(ops)

        def wait():
            for request in requests:
                request.wait()
            return received
        return wait


def _step_plan(step: int, rank: int, size: int, chunk: int):
    """(query rows, key columns, causal) of the block from rank (rank - step) mod size."""
    source = (rank - step) % size
    if step == 0:
        return source, slice(None), slice(None), True
    if source < rank:
        return source, slice(None), slice(0, chunk), False
    return source, slice(chunk, None), slice(None), False


class RingAttention(torch.autograd.Function):
    """q [b, nq, s_local, d], k/v [b, ng, s_local, d] -> attention of the full sequence for the local
    queries [b, nq, s_local, d]. `documents` [b, s] (the full sequence's, or None)."""

    @staticmethod
    def forward(ctx, q, k, v, axis, documents, scale, math):
        size, rank = axis.size, axis.rank
        ring = _Ring(axis.group, size, rank)
        chunk = q.size(2) // 2
        repeat = q.size(1) // k.size(1)
        doc_of = _documents_by_rank(documents, q.size(2) * size, size, q.device)
        kv = torch.stack([k, v]).contiguous()
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(size):
            wait = ring.shift(kv) if step < size - 1 else None
            source, rows, cols, causal = _step_plan(step, rank, size, chunk)
            mask = _mask(doc_of, rank, source, rows, cols, causal)
            block_k, block_v = (t.repeat_interleave(repeat, dim=1)[:, :, cols] for t in kv)
            o, l_ = block_forward(q[:, :, rows], block_k, block_v, mask, causal and mask is None, scale, math)
            merged = torch.logaddexp(lse[:, :, rows], l_)
            out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - merged).nan_to_num(0.0)[..., None]
                               + o.float() * torch.exp(l_ - merged).nan_to_num(0.0)[..., None])
            lse[:, :, rows] = merged
            if wait is not None:
                kv = wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, documents if documents is not None else torch.empty(0))
        ctx.axis, ctx.scale, ctx.math, ctx.has_documents = axis, scale, math, documents is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, documents = ctx.saved_tensors
        axis, scale, math = ctx.axis, ctx.scale, ctx.math
        size, rank = axis.size, axis.rank
        ring = _Ring(axis.group, size, rank)
        chunk = q.size(2) // 2
        repeat = q.size(1) // k.size(1)
        groups = k.size(1)
        doc_of = _documents_by_rank(documents if ctx.has_documents else None, q.size(2) * size, size, q.device)
        grad_out = grad_out.contiguous()
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with its block
        pending = None
        for step in range(size):
            wait = ring.shift(kv) if step < size - 1 else None
            source, rows, cols, causal = _step_plan(step, rank, size, chunk)
            mask = _mask(doc_of, rank, source, rows, cols, causal)
            block_k, block_v = (t.repeat_interleave(repeat, dim=1)[:, :, cols] for t in kv)
            dq, dk, dv = block_backward(grad_out[:, :, rows], q[:, :, rows], block_k, block_v, out[:, :, rows],
                                        lse[:, :, rows], mask, causal and mask is None, scale, math)
            grad_q[:, :, rows] += dq.float()
            if pending is not None:  # the accumulated gradient of this block, from the previous rank
                grad_kv = pending()
            b, _, sk, d = dk.shape
            grad_kv[0][:, :, cols] += dk.float().view(b, groups, repeat, sk, d).sum(2)
            grad_kv[1][:, :, cols] += dv.float().view(b, groups, repeat, sk, d).sum(2)
            pending = ring.shift(grad_kv)  # to the rank that takes this block next (finally its owner)
            if wait is not None:
                kv = wait()
        grad_kv = pending()
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None, None


def _documents_by_rank(documents, seq_len, size, device):
    """rank -> [b, s_local] document indices of that rank's positions (None without documents)."""
    if documents is None:
        return None
    return [documents[:, local_index(seq_len, size, r, device)] for r in range(size)]


def _mask(doc_of, rank, source, rows, cols, causal):
    """bool [b, 1, rows, cols] same-document mask (and causal on the own block), or None."""
    if doc_of is None:
        return None
    mask = doc_of[rank][:, rows, None] == doc_of[source][:, None, cols]
    if causal:
        n = mask.size(-1)
        mask = mask & torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
    return mask[:, None]


def ring_attention(q, k, v, axis, scale: float, documents=None, math: bool = False):
    """Context-parallel causal attention on this rank's [b, heads, s_local, d] (see the module docstring)."""
    return RingAttention.apply(q, k, v, axis, documents, scale, math)
