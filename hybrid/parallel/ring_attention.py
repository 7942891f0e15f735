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
With packed documents a block is further masked to same-document pairs; with a sliding window
(`window`, transformers' sliding_window: a query sees itself and the window - 1 keys before it) to the
pairs within it (`allowed_keys`, the one rule every attention path uses), and a block whose keys all lie
before every local query's window is not computed (decided from the chunk positions on the host, no sync):
its K/V still travel the ring; a block the window cuts runs in bands of query rows, each against the keys its
window reaches, so a windowed layer costs s x (band + window), not s^2.

Attention dropout (`dropout` > 0) runs on the math kernel: whether query i keeps key j is a function
of (a seed drawn once per call from the rank's RNG stream, batch row, head, i's and j's positions in
the full sequence) (`keep_mask`), so each rank draws the mask of its own queries against every key
without communication, backward regenerates it, and the masked probabilities are scaled by 1 / (1 - p) before
the blocks are merged (the merge is linear in each block's output, so this equals dropout on the whole
sequence's softmax).

Block kernels (`block_kernel`): on CPU aten's fused flash-attention for CPU (forward and backward, masks
and GQA); on CUDA in fp16/bf16 aten's fused flash-attention (`_scaled_dot_product_flash_attention` and its
backward, called as torch's own context parallelism calls them: the log-sum-exp out, the merged one back
in; GQA's K/V not repeated, the kernel shares each KV head); elsewhere, and on CUDA with document masks,
a window's bands, dropout or fp32, an exact math kernel in query tiles (fp32 scores of at most MATH_TILE_BYTES at a
time,
recomputed in backward). Every kernel has one contract: a block's output and fp32 log-sum-exp
[b, nq, sq] from (q, k, v, causal, scale), and the gradients from the merged output and log-sum-exp, so
the merge and the ring are the same code whichever runs (the CPU suite runs the CUDA wrapper against
stand-ins that keep those ops' contracts). Written here because torch's own context parallel
(torch.distributed.tensor.experimental) runs on DTensor with CUDA kernels only and has no document masks,
and DeepSpeed has no ring attention.
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


# -- block kernels: q [b, nq, sq, d], k/v [b, ng, sk, d] (GQA: each KV head serves nq/ng consecutive query
# heads), mask None or bool [b or 1, 1, sq, sk] -----------------------------------------------------------

MATH_TILE_BYTES = 64 * 2**20  # the math kernel's fp32 scores per query tile, [b, nq, tile, sk], never [sq, sk]


_PRIME = 2147483647  # 2^31 - 1: the hash below multiplies numbers below it, so int64 never overflows
_MIX = (1103515245, 69069, 48271, 16807, 1664525)


def keep_mask(seed: torch.Tensor, batch: int, heads: int, query_pos: torch.Tensor, key_pos: torch.Tensor,
              p: float) -> torch.Tensor:
    """bool [batch, heads, queries, keys]: which attention probabilities dropout keeps (probability 1 - p),
    a hash of (seed, batch row, head, query position, key position): the same pair gets the same answer on
    whichever rank computes it, in forward and in backward. `seed` an int64 tensor on the device (no host
    sync); positions are those of the full sequence."""
    device = query_pos.device
    x = seed.remainder(_PRIME) + torch.arange(batch, device=device).view(-1, 1, 1, 1) * 7919
    x = (x * _MIX[0] + torch.arange(heads, device=device).view(1, -1, 1, 1) * 104729).remainder(_PRIME)
    x = (x * _MIX[1] + query_pos.view(1, 1, -1, 1)).remainder(_PRIME)
    x = (x * _MIX[2] + key_pos.view(1, 1, 1, -1)).remainder(_PRIME)
    for a in _MIX[3:]:  # nonlinear rounds (xor-shift, multiply) so nearby pairs are independent
        x = ((x ^ (x >> 13)) * a).remainder(_PRIME)
    return x.float().div_(_PRIME) >= p


class BlockDropout:
    """Attention dropout of one block (of the ring, or of a rank's whole sequences with sinks): its probability
    and the full-sequence positions of its queries and keys; `keep(rows)` the mask of those query rows."""

    def __init__(self, p: float, seed: torch.Tensor, batch: int, heads: int, query_pos, key_pos):
        self.p, self.seed, self.batch, self.heads = p, seed, batch, heads
        self.query_pos, self.key_pos = query_pos, key_pos

    def keep(self, rows: slice) -> torch.Tensor:
        return keep_mask(self.seed, self.batch, self.heads, self.query_pos[rows], self.key_pos, self.p)

    def apply(self, probs: torch.Tensor, rows: slice) -> torch.Tensor:
        return torch.where(self.keep(rows), probs * (1.0 / (1.0 - self.p)), 0.0)


def allowed_keys(query_pos: torch.Tensor, key_pos: torch.Tensor, window) -> torch.Tensor:
    """[queries, keys] bool: causal, and within the last `window` positions (the token itself included,
    transformers' sliding_window) when a window is set."""
    allowed = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        allowed &= key_pos[None, :] > query_pos[:, None] - window
    return allowed


def _additive(mask, dtype):
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


# aten's fused CUDA kernels, looked up when a block runs (tests substitute CPU stand-ins keeping their contracts)
FUSED_OPS = {"flash": lambda: torch.ops.aten._scaled_dot_product_flash_attention,
             "flash_backward": lambda: torch.ops.aten._scaled_dot_product_flash_attention_backward,
             "efficient": lambda: torch.ops.aten._scaled_dot_product_efficient_attention,
             "efficient_backward": lambda: torch.ops.aten._scaled_dot_product_efficient_attention_backward}
FLASH_CAPABILITY = (8, 0)  # aten's CUDA flash-attention runs on Ampere and newer
EFFICIENT_LSE_BLOCK = 32  # the efficient kernel's log-sum-exp has its query rows padded to a multiple of this


def _capability(device: torch.device) -> tuple:
    return torch.cuda.get_device_capability(device)


def block_kernel(q: torch.Tensor, mask, dropout, math: bool = False) -> str:
    """The kernel of a block: "cpu" (aten's fused CPU kernel: masks, GQA), on CUDA in fp16/bf16 without a mask
    "flash" (aten's flash-attention: compute capability 8.0+, head dim <= 256) or else "efficient" (aten's
    memory-efficient kernel, which runs on the GPUs flash-attention does not), or "math" (masks, dropout, fp32)."""
    if math or dropout is not None:
        return "math"
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type == "cuda" and mask is None and q.dtype in (torch.float16, torch.bfloat16):
        return "flash" if _capability(q.device) >= FLASH_CAPABILITY and q.size(-1) <= 256 else "efficient"
    return "math"


def kernel_note(device_type: str, dtype: torch.dtype, documents: bool, dropout: bool,
                capability: tuple = FLASH_CAPABILITY, head_dim: int = 128, window: bool = False) -> str:
    """Which kernel the ring's blocks run, and why (for the run's log)."""
    if device_type == "cpu" and not dropout:
        return "aten's fused CPU flash-attention kernel"
    if device_type == "cuda" and not (documents or dropout) and dtype in (torch.float16, torch.bfloat16):
        banded = "; in windowed layers the bands of the blocks the window cuts run the exact tiled math kernel " \
            "(masks)" if window else ""
        if capability >= FLASH_CAPABILITY and head_dim <= 256:
            return "aten's fused CUDA flash-attention kernel (GQA without K/V copies)" + banded
        why = (f"compute capability {capability[0]}.{capability[1]} (flash-attention needs 8.0)"
               if capability < FLASH_CAPABILITY else f"head dim {head_dim} (flash-attention takes up to 256)")
        return f"aten's fused CUDA memory-efficient kernel (K/V heads repeated under GQA), because of {why}" + banded
    why = ("attention dropout (its masks hashed from full-sequence positions)" if dropout else
           "packed documents (masks)" if documents else f"{dtype} (the fused kernel takes fp16/bf16)")
    return f"the exact tiled math kernel, because of {why}"


def block_forward(q, k, v, mask, causal: bool, scale: float, math: bool = False, dropout: "BlockDropout" = None):
    """One block's attention output [b, nq, sq, d], log-sum-exp [b, nq, sq] (fp32; -inf where a query may
    see no key of the block) and the kernel's state for its backward; with `dropout` the output of the kept
    probabilities (scaled), the log-sum-exp of all of them (the merge's weights)."""
    kernel, state = block_kernel(q, mask, dropout, math), None
    if kernel == "cpu":  # aten's fused CPU kernel (GQA included)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None if mask is None else _additive(mask, q.dtype), scale=scale)
        lse = lse.float()
    elif kernel == "flash":  # its other results (sequence offsets, RNG state) are its backward's arguments
        out, lse, *state = FUSED_OPS["flash"]()(q, k, v, 0.0, causal, False, scale=scale)
        state = tuple(state[:6])  # cum_seq_q, cum_seq_k, max_q, max_k, philox seed, philox offset
        lse = lse.float()
    elif kernel == "efficient":  # equal head counts only: GQA's K/V heads repeated (a copy per block)
        out, lse, seed, offset = FUSED_OPS["efficient"]()(q, _expand(k, q), _expand(v, q), None, True, 0.0, causal,
                                                          scale=scale)
        state = (seed, offset)
        lse = lse[..., :q.size(2)].float()  # its rows padded to EFFICIENT_LSE_BLOCK
    else:
        k, v = _expand(k, q), _expand(v, q)
        outs, lses = [], []
        for rows in _tiles(q, k, dropout):
            scores = _scores(q[:, :, rows], k, _rows(mask, rows), causal, scale, rows.start)
            lse_tile = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - lse_tile[..., None]).nan_to_num(0.0)
            if dropout is not None:
                probs = dropout.apply(probs, rows)
            outs.append(torch.matmul(probs.to(v.dtype), v))
            lses.append(lse_tile)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
    if mask is not None:
        seen = mask.any(dim=-1)  # [b, 1, sq]
        lse = lse.masked_fill(~seen, float("-inf"))
        out = out.masked_fill(~seen[..., None], 0.0)
    return out, lse, state


def block_backward(grad_out, q, k, v, out, lse, mask, causal: bool, scale: float, math: bool = False,
                   dropout: "BlockDropout" = None, state=None):
    """Gradients of one block's q, k, v (k, v compact under GQA) given the merged output and
    log-sum-exp of these queries (with `dropout`: the same kept probabilities as forward; `state`: what the
    block's forward kernel returned for its backward)."""
    kernel = block_kernel(q, mask, dropout, math)
    if kernel == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal,
            attn_mask=None if mask is None else _additive(mask, q.dtype), scale=scale)
    if kernel == "flash":
        cum_q, cum_k, max_q, max_k, seed, offset = state
        return FUSED_OPS["flash_backward"]()(grad_out.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), cum_q,
                                             cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    groups = k.size(1)
    if kernel == "efficient":
        seed, offset = state
        rows = -(-q.size(2) // EFFICIENT_LSE_BLOCK) * EFFICIENT_LSE_BLOCK
        padded = torch.nn.functional.pad(lse.contiguous(), (0, rows - q.size(2)))
        grad_q, grad_k, grad_v, _ = FUSED_OPS["efficient_backward"]()(
            grad_out.contiguous(), q, _expand(k, q), _expand(v, q), None, out.contiguous(), padded, seed, offset, 0.0,
            [True, True, True, False], causal, scale=scale)
        b, heads, sk, d = grad_k.shape  # the repeated heads' gradients summed back per KV head
        return (grad_q, grad_k.view(b, groups, heads // groups, sk, d).sum(2),
                grad_v.view(b, groups, heads // groups, sk, d).sum(2))
    k32, v32 = _expand(k, q).float(), _expand(v, q).float()
    grad_q = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    grad_k, grad_v = torch.zeros_like(k32), torch.zeros_like(v32)
    for rows in _tiles(q, k32, dropout):
        q_tile, dout = q[:, :, rows].float(), grad_out[:, :, rows].float()
        # masked pairs: exp(-inf) = 0
        probs = torch.exp(_scores(q_tile, k32, _rows(mask, rows), causal, scale, rows.start) - lse[:, :, rows, None])
        grad_probs = torch.matmul(dout, v32.transpose(-1, -2))
        if dropout is not None:  # out = dropped(P) v: v's gradient sees the kept ones, P's through the mask
            grad_v += torch.matmul(dropout.apply(probs, rows).transpose(-1, -2), dout)
            grad_probs = dropout.apply(grad_probs, rows)
        else:
            grad_v += torch.matmul(probs.transpose(-1, -2), dout)
        delta = (dout * out[:, :, rows].float()).sum(dim=-1, keepdim=True)  # = sum_j P_ij dP_ij with dropout too
        grad_scores = probs * (grad_probs - delta) * scale
        grad_q[:, :, rows] = torch.matmul(grad_scores, k32)
        grad_k += torch.matmul(grad_scores.transpose(-1, -2), q_tile)
    b, heads, sk, d = grad_k.shape
    grad_k = grad_k.view(b, groups, heads // groups, sk, d).sum(2)
    grad_v = grad_v.view(b, groups, heads // groups, sk, d).sum(2)
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


def _expand(kv, q):
    """GQA: each KV head repeated for its group's query heads (the math and memory-efficient kernels)."""
    repeat = q.size(1) // kv.size(1)
    return kv if repeat == 1 else kv.repeat_interleave(repeat, dim=1)


def tile_rows(batch: int, heads: int, keys: int, dropout: bool = False) -> int:
    """Query rows per tile of the math kernel: as many as keep a tile's fp32 scores (and with dropout its
    int64 hash) within MATH_TILE_BYTES."""
    return max(1, MATH_TILE_BYTES // ((12 if dropout else 4) * batch * heads * keys))


def _tiles(q, k, dropout=None):
    n, rows = q.size(2), tile_rows(q.size(0), q.size(1), k.size(2), dropout is not None)
    return [slice(start, min(start + rows, n)) for start in range(0, n, rows)]


def _rows(mask, rows):
    return None if mask is None else mask[:, :, rows]


def _scores(q, k, mask, causal, scale, first_row: int = 0):
    """fp32 scores of query rows first_row.. against every key, masked (causal: key index <= row)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        rows = torch.arange(first_row, first_row + sq, device=q.device)
        scores = scores.masked_fill(torch.arange(sk, device=q.device)[None, :] > rows[:, None], float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Attention over the keys seen so far (fp32 `out`, `lse`) and over one more block's: the softmax
    statistics combined exactly (queries that saw no key yet have lse -inf)."""
    merged = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - merged).nan_to_num(0.0)[..., None]
            + block_out.float() * torch.exp(block_lse - merged).nan_to_num(0.0)[..., None]), merged


# -- the ring -------------------------------------------------------------------------------------------

class _Ring:
    """Send to the next CP rank, receive from the previous one, asynchronously (gloo and NCCL)."""

    def __init__(self, group, size: int, rank: int):
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)
        self.group = group

    def shift(self, tensor: torch.Tensor):
        """Post the exchange; returns a function that waits for it and gives the received tensor."""
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
    """(source rank, query rows, key columns, causal) of step `step`: the block of rank (rank - step) mod size."""
    source = (rank - step) % size
    if step == 0:
        return source, slice(None), slice(None), True
    if source < rank:
        return source, slice(None), slice(0, chunk), False
    return source, slice(chunk, None), slice(None), False


# attention sinks (hybrid.model.sinks): a learned logit per head in each query's softmax denominator
def sink_weights(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """sigmoid(lse - s): [b, heads, sq] fp32, the share of each query's softmax the keys keep."""
    return torch.sigmoid(lse - sinks.float()[None, :, None])


def sink_gradient(grad: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """d loss / d s [heads] from the output's gradient and the output y (both [b, heads, sq, d])."""
    return -((grad.float() * out.float()).sum(-1) * (1 - weights)).sum(dim=(0, 2))


class RingAttention(torch.autograd.Function):
    """q [b, nq, s_local, d], k/v [b, ng, s_local, d] -> attention of the full sequence for the local
    queries [b, nq, s_local, d]. `documents` [b, s] (the full sequence's, or None); `window` a sliding window
    (or None)."""

    @staticmethod
    def forward(ctx, q, k, v, axis, documents, scale, math, p, seed, sinks, window):
        size, rank = axis.size, axis.rank
        ring = _Ring(axis.group, size, rank)
        chunk = q.size(2) // 2
        masks = _Masks(documents, window, q.size(2) * size, size, rank, q.device, bool(p))
        dropouts = _block_dropouts(p, seed, q, masks)
        kv = torch.stack([k, v]).contiguous()
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        states = []  # each block's kernel state, for its backward
        for step in range(size):
            wait = ring.shift(kv) if step < size - 1 else None
            source, rows, cols, causal = _step_plan(step, rank, size, chunk)
            states.append([])
            for rows, cols, mask, causal in masks.bands(source, rows, cols, causal):
                o, l_, state = block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], mask, causal, scale,
                                             math, dropouts and dropouts(source, rows, cols))
                states[-1].append(state)
                out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, l_)
            if wait is not None:
                kv = wait()
        if sinks is not None:  # the sinks' share of each query's softmax (hybrid.model.sinks)
            out = out * sink_weights(lse, sinks)[..., None]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, documents if documents is not None else torch.empty(0),
                              seed if seed is not None else torch.empty(0),
                              sinks if sinks is not None else torch.empty(0))
        ctx.has_sinks = sinks is not None
        ctx.axis, ctx.scale, ctx.math, ctx.has_documents, ctx.p = axis, scale, math, documents is not None, p
        ctx.window = window
        ctx.states = states
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, documents, seed, sinks = ctx.saved_tensors
        axis, scale, math = ctx.axis, ctx.scale, ctx.math
        grad_sinks = None
        if ctx.has_sinks:  # the blocks' backward from sigma dy and the output y (hybrid.model.sinks)
            weights = sink_weights(lse, sinks)
            grad_sinks = sink_gradient(grad_out, out, weights).to(sinks.dtype)
            grad_out = (grad_out.float() * weights[..., None]).to(grad_out.dtype)
        size, rank = axis.size, axis.rank
        ring = _Ring(axis.group, size, rank)
        chunk = q.size(2) // 2
        masks = _Masks(documents if ctx.has_documents else None, ctx.window, q.size(2) * size, size, rank, q.device,
                       bool(ctx.p))
        dropouts = _block_dropouts(ctx.p, seed, q, masks)
        grad_out = grad_out.contiguous()
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with its block
        pending = None
        for step in range(size):
            wait = ring.shift(kv) if step < size - 1 else None
            source, rows, cols, causal = _step_plan(step, rank, size, chunk)
            grads = []
            for (rows, cols, mask, causal), state in zip(masks.bands(source, rows, cols, causal), ctx.states[step]):
                dq, dk, dv = block_backward(grad_out[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                            out[:, :, rows], lse[:, :, rows], mask, causal, scale, math,
                                            dropouts and dropouts(source, rows, cols), state)
                grad_q[:, :, rows] += dq.float()
                grads.append((cols, dk, dv))
            if pending is not None:  # the accumulated gradient of this block, from the previous rank
                grad_kv = pending()
            for cols, dk, dv in grads:
                grad_kv[0][:, :, cols] += dk.float()
                grad_kv[1][:, :, cols] += dv.float()
            pending = ring.shift(grad_kv)  # to the rank that takes this block next (finally its owner)
            if wait is not None:
                kv = wait()
        grad_kv = pending()
        return (grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None, None, None, None,
                grad_sinks, None)


def _block_dropouts(p: float, seed, q, masks: "_Masks"):
    """None without dropout; else (source rank, query rows, key columns) -> that block's BlockDropout."""
    if not p:
        return None
    positions = masks.positions
    return lambda source, rows, cols: BlockDropout(p, seed, q.size(0), q.size(1), positions[masks.rank][rows],
                                                   positions[source][cols])


BAND_ROWS = 256  # query rows per band of a block the window cuts (at least the window)


class _Masks:
    """The parts of each block this rank computes and the pairs they may attend beyond the block plan's causality
    (same document; within the sliding window), decided from the chunks' positions on the host (no sync)."""

    def __init__(self, documents, window, seq_len: int, size: int, rank: int, device, dropout: bool = False):
        self.window, self.rank, self.chunk = window, rank, seq_len // (2 * size)
        self.host = [local_index(seq_len, size, r) for r in range(size)]  # positions held by each rank (decisions)
        self.positions = None  # the same made on the device (no copy from the host: no sync), where masks or
        if window is not None or documents is not None or dropout:  # dropout's hash need them
            self.positions = [local_index(seq_len, size, r, device) for r in range(size)]
        self.doc_of = None if documents is None else [documents[:, p] for p in self.positions]

    def bands(self, source: int, rows: slice, cols: slice, causal: bool) -> list:
        """(query rows, key columns, mask or None, causal) of each part of the block: the block whole, or, where
        the window cuts it, bands of at most max(BAND_ROWS, window) rows of one chunk, each against the keys its
        window reaches (none where it reaches no key): sliding-window attention costs s x (band + window)."""
        rows, cols = _span(rows, 2 * self.chunk), _span(cols, 2 * self.chunk)
        queries, keys = self.host[self.rank], self.host[source]
        if self.window is None or int(queries[rows].max()) - int(keys[cols].min()) < self.window:
            mask = self._documents(source, rows, cols, causal)
            return [(rows, cols, mask, causal and mask is None)]
        band, parts = max(BAND_ROWS, self.window), []
        for first in range(rows.start, rows.stop, self.chunk):  # each chunk's rows (positions contiguous)
            for start in range(first, min(first + self.chunk, rows.stop), band):
                tile = slice(start, min(start + band, first + self.chunk, rows.stop))
                low = int(queries[tile.start]) - self.window + 1  # the keys its window reaches: contiguous columns
                lo = cols.start + int(torch.searchsorted(keys[cols], low))
                hi = cols.start + int(torch.searchsorted(keys[cols], int(queries[tile.stop - 1]), right=True))
                if lo < hi:
                    span = slice(lo, hi)
                    mask = allowed_keys(self.positions[self.rank][tile], self.positions[source][span],
                                        self.window)[None, None]
                    same = self._documents(source, tile, span, False)
                    parts.append((tile, span, mask if same is None else mask & same, False))
        return parts

    def _documents(self, source: int, rows: slice, cols: slice, causal: bool):
        """bool [b, 1, rows, cols] same-document pairs (causal on the own block), or None without documents."""
        if self.doc_of is None:
            return None
        same = (self.doc_of[self.rank][:, rows, None] == self.doc_of[source][:, None, cols])[:, None]
        if causal:
            n = same.size(-1)
            same = same & torch.ones(n, n, dtype=torch.bool, device=same.device).tril()
        return same


def _span(part: slice, length: int) -> slice:
    """`part` with explicit start and stop."""
    start, stop, _ = part.indices(length)
    return slice(start, stop)


def ring_attention(q, k, v, axis, scale: float, documents=None, math: bool = False, dropout: float = 0.0,
                   seed: torch.Tensor = None, sinks: torch.Tensor = None, window: int = None):
    """Context-parallel causal attention on this rank's [b, heads, s_local, d] (see the module docstring);
    `dropout` > 0 needs `seed`, an int64 tensor (keep_mask): the masks of this rank's queries (against every
    key) are drawn from it, in forward and again in backward, so ranks may use different seeds. `sinks` [heads]:
    each head's sink logit (hybrid.model.sinks), applied to the merged output; `window` a sliding window
    (allowed_keys)."""
    if dropout and seed is None:
        raise ValueError("ring_attention with dropout needs the seed its masks are drawn from")
    return RingAttention.apply(q, k, v, axis, documents, scale, math, float(dropout), seed if dropout else None, sinks,
                               window)
