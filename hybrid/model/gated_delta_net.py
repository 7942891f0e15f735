"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5; Yang et al. 2025), the layer and its PyTorch reference.

Per value head, a state S [dk, dv] replaces the growing key/value cache: at each token it decays by exp(g_t), is
corrected toward the token's value along its key (the delta rule, step size beta_t), and is read by the query:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,    o_t = S_t^T q_t

`chunk_gated_delta_rule` computes it a chunk of tokens at a time (the WY form of the chunked delta rule: one
triangular solve per chunk, then one state step per chunk), `recurrent_gated_delta_rule` a token at a time (the
decoding form, and the test of the chunked one). Both are PyTorch in fp32: the CPU path, and the reference a GPU
kernel would be held to.

Packed documents: the state and the conv window restart at each document. Within a chunk the pairs of tokens of
different documents are masked, and a token reads or passes on the state only if it continues the document the
state came from. This is exact (masks multiply; nothing relies on a large negative decay).

Tensor parallelism splits the key heads, each with its value heads (megatron-core's split). The input projection's
rows are grouped per key head, [q | k | v | z | b | a], so a contiguous split keeps whole groups, as the fused QKV
does (hybrid.model.qkv). The conv channels are grouped the same way, [q | k | v] per key head. A_log and dt_bias
follow the value heads. The gated norm's weight is replicated, and its gradient is summed over TP.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.errors import ConfigError
from hybrid.model.init import normal_init, output_layer_std, seeded_init
from hybrid.model.norms import RMSNorm
from hybrid.parallel import mappings as M
from hybrid.parallel import ring_attention
from hybrid.parallel.groups import as_groups
from hybrid.parallel.layers import ColumnParallelLinear, RowParallelLinear, make_parallel_param


# flash-linear-attention's chunked kernel (`fla`, Triton: CUDA only) where it is installed, else None: an optional GPU
# extra, as flash-attn is (hybrid.model.flash), never needed on the CPU
try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as FLA_CHUNK
except Exception:  # (not installed, or its Triton stack unusable here)
    FLA_CHUNK = None


def backend_note(config, device_type: str):
    """The run log's line on which kernel the Gated DeltaNet layers run where it is a choice (CUDA), or None."""
    if config.linear_attention_freq is None or device_type != "cuda":
        return None
    if FLA_CHUNK is None:
        return ("Gated DeltaNet layers: flash-linear-attention is not installed, so they run their PyTorch chunked "
                "form on the GPU (the reference, one kernel per operation; checks/gpu_paths.py gated_delta_net_fla "
                "measures what fla's kernels save): pip install flash-linear-attention")
    if config.reset_attention_mask:
        return ("Gated DeltaNet layers with --reset-attention-mask: packed rows run the PyTorch chunked form (fla's "
                "variable-length form would build its chunk index on the host every step); whole rows run fla's")
    return "Gated DeltaNet layers: flash-linear-attention's chunked kernel"


def fla_applies(tensor: torch.Tensor, documents, cache) -> bool:
    """Whether a pass runs fla's kernel: installed, on CUDA, in bf16 / fp16 (its kernels' types), whole sequences of
    one document each (packed documents would need fla's variable-length form, whose chunk index is built on the
    host every step), no decoding step."""
    return FLA_CHUNK is not None and tensor.is_cuda and tensor.dtype in (torch.bfloat16, torch.float16) and \
        documents is None and cache is None


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (fla's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, chunk_size: int = 64, documents=None, initial_state=None):
    """The gated delta rule by chunks. q, k [b, h, s, dk] (normalised and scaled), v [b, h, s, dv], g (log decay,
    <= 0) and beta [b, h, s], all fp32; `documents` [b, s]: the document of each token (the state restarts at each
    new one), None: one document; `initial_state` [b, h, dk, dv]. -> (o [b, h, s, dv], final state [b, h, dk, dv])."""
    b, h, s, dk = k.shape
    dv = v.size(-1)
    q, k, v = (t.contiguous() for t in (q, k, v))  # (chunked views of them, not copies in every product's backward)
    pad = (-s) % chunk_size
    if pad:  # zero keys, values and decays past the end change no earlier output
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
        if documents is not None:  # (the padding in the last document: it changes no state, so the final one stands)
            documents = torch.cat([documents, documents[:, -1:].expand(-1, pad)], dim=1)
    n, c = (s + pad) // chunk_size, chunk_size
    q, k, v = (t.reshape(b, h, n, c, -1) for t in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)
    decay = g.cumsum(-1)  # [b, h, n, c]: log of the decay from the chunk's start to each token
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    allowed = causal
    continues = None  # [b, 1, n, c]: the token belongs to the document the incoming state carries
    if documents is not None:
        docs = documents.reshape(b, 1, n, c)
        allowed = causal & (docs.unsqueeze(-1) == docs.unsqueeze(-2))  # [b, 1, n, c, c]
        before = torch.cat([docs[..., :1, :1], docs[..., :-1, -1:]], dim=2)  # the token before each chunk
        continues = (docs == before).to(q.dtype)
        continues[..., 0, :] = 0.0  # (the first chunk has no incoming state but `initial_state`)
    pair_decay = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~allowed, float("-inf")).exp()
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    # the chunk's delta-rule updates as one lower-triangular system (I + L) u = v beta, (I + L) w = k beta e^decay
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    read_decay = decay.exp() if continues is None else decay.exp() * continues
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * read_decay.unsqueeze(-1), upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * pair_decay  # [b, h, n, c, c], the diagonal included
    q_read = q * read_decay.unsqueeze(-1)
    last = decay[..., -1:]  # [b, h, n, 1]
    write = (last - decay).exp()
    carry = last.exp()
    if documents is not None:  # only the chunk's last document passes its state on
        last_doc = (docs == docs[..., -1:]).to(q.dtype)
        write = write * last_doc
        carry = carry * continues[..., -1:]
    k_write = k * write.unsqueeze(-1)
    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    out = []
    for i in range(n):
        fresh = u[:, :, i] - w[:, :, i] @ state  # the values less what the incoming state already predicts
        out.append(q_read[:, :, i] @ state + inner[:, :, i] @ fresh)
        state = state * carry[:, :, i].unsqueeze(-1) + k_write[:, :, i].transpose(-1, -2) @ fresh
    o = torch.stack(out, dim=2).reshape(b, h, n * c, dv)[:, :, :s]
    return o, state


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None):
    """The same rule a token at a time (decoding; and the reference the chunked form is tested against).
    Arguments as chunk_gated_delta_rule's, one document."""
    b, h, s, dk = k.shape
    state = q.new_zeros(b, h, dk, v.size(-1)) if initial_state is None else initial_state.to(q.dtype)
    out = []
    for t in range(s):
        state = state * g[:, :, t].exp()[..., None, None]
        predicted = (state * k[:, :, t].unsqueeze(-1)).sum(-2)  # [b, h, dv]
        delta = (v[:, :, t] - predicted) * beta[:, :, t].unsqueeze(-1)
        state = state + k[:, :, t].unsqueeze(-1) * delta.unsqueeze(-2)
        out.append((state * q[:, :, t].unsqueeze(-1)).sum(-2))
    return torch.stack(out, dim=2), state


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, documents=None) -> torch.Tensor:
    """x [s, b, C] through a causal depthwise conv (weight [C, K]: tap K-1 reads the token itself), then SiLU;
    `documents` [b, s]: a tap reads no token of an earlier document (the window restarts at each one)."""
    s, kernel = x.size(0), weight.size(1)
    if documents is None:  # one call of torch's kernel, [b, C, s]
        y = F.conv1d(x.permute(1, 2, 0), weight.unsqueeze(1), padding=kernel - 1, groups=weight.size(0))[..., :s]
        return F.silu(y).permute(2, 0, 1)
    x32, weight32 = x.float(), weight.float()  # (the taps summed in fp32, as the conv kernel accumulates)
    y = x32 * weight32[:, -1]
    docs = documents.t()  # [s, b]
    for back in range(1, min(kernel, s)):  # tap K-1-back reads the token `back` places earlier
        same = (docs[back:] == docs[:-back]).unsqueeze(-1).to(x32.dtype)  # [s - back, b, 1]
        shifted = F.pad(x32[:-back] * same, (0, 0, 0, 0, back, 0))
        y = y + shifted * weight32[:, kernel - 1 - back]
    return F.silu(y.to(x.dtype))


def parameter_numels(config) -> dict:
    """Full elements of each parameter of a Gated DeltaNet layer, by its name inside the layer's `attention.`
    (what the checkpoint readers and the memory estimate count)."""
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv, h = config.linear_key_head_dim, config.linear_value_head_dim, config.hidden_size
    per_key_head = 2 * dk + 2 * (nv // nk) * dv + 2 * (nv // nk)  # q, k, v, z, b, a
    conv = (2 * nk * dk + nv * dv) * config.linear_conv_kernel_dim
    return {"in_proj.weight": nk * per_key_head * h, "conv_weight": conv, "A_log": nv, "dt_bias": nv,
            "norm.weight": dv, "out_proj.weight": nv * dv * h}


class SequenceSplit:
    """A sequence split over N ranks (CP's two chunks per rank, or Ulysses' one part) turned into a split of heads
    around the token mixing, as megatron-core runs Gated DeltaNet under CP: an all-to-all gives each rank every token
    of 1/N of its key heads (with their value heads), the mixing runs on whole sequences, and the reverse all-to-all
    returns each rank its own tokens of every head. Exact at any N that divides the key heads per TP rank."""

    def __init__(self, axis, chunked: bool, local_len: int, device=None):
        self.axis, n = axis, axis.size
        total = local_len * n
        # every rank's positions of the full sequence, in rank order: a received row -> its position
        self.order = torch.cat([ring_attention.local_index(total, n, r, device) if chunked
                                else torch.arange(r * local_len, (r + 1) * local_len, device=device)
                                for r in range(n)])
        self.inverse = torch.argsort(self.order)
        self.splits = [local_len] * n

    def around(self, mix, proj):
        """mix(whole-sequence proj of this rank's 1/N of the heads) between the two all-to-alls; proj [s/N, b,
        heads, P] -> [s/N, b, value heads x dv]."""
        s, b, heads, width = proj.shape
        n = self.axis.size
        if heads % n:  # (the capability table refuses it first: gdn-sequence-split)
            raise ConfigError(f"Gated DeltaNet under a sequence split of {n}: the {heads} key heads of a TP rank do "
                              f"not split over it.")
        rows = proj.view(s, b, n, heads // n, width).permute(2, 0, 1, 3, 4).reshape(n * s, b, heads // n, width)
        whole = M.all_to_all_rows(rows, self.splits, self.splits, self.axis.group).index_select(0, self.inverse)
        mixed = mix(whole)  # [S, b, my value heads x dv]
        back = M.all_to_all_rows(mixed.index_select(0, self.order), self.splits, self.splits, self.axis.group)
        return back.view(n, s, b, -1).permute(1, 2, 0, 3).reshape(s, b, -1)


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet token mixer on [s(/tp), b, h] -> [s(/tp), b, h] (Qwen3.5's `linear_attn`): a column-parallel
    input projection, the causal conv on q/k/v, the gated delta rule per value head, an RMSNorm gated by SiLU(z),
    and a row-parallel output projection (one TP reduction, as attention)."""

    def __init__(self, config, groups, layer_number: int, name: str):
        super().__init__()
        groups = as_groups(groups)
        tp = groups.tp_size
        self.config, self.layer_number = config, layer_number
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv, self.ratio = config.linear_key_head_dim, config.linear_value_head_dim, nv // nk
        self.key_heads, self.value_heads = nk // tp, nv // tp  # this rank's
        r = self.ratio
        self.group_sizes = [self.dk, self.dk, r * self.dv, r * self.dv, r, r]  # q, k, v, z, b, a per key head
        self.in_proj = ColumnParallelLinear(
            config.hidden_size, nk * sum(self.group_sizes), groups,
            normal_init(config.seed, f"{name}.in_proj.weight", config.init_method_std), bias=False,
            sequence_parallel=config.sequence_parallel, overlap=config.async_tensor_model_parallel_allreduce)
        channels, kernel = nk * (2 * self.dk + r * self.dv), config.linear_conv_kernel_dim
        bound = 1.0 / math.sqrt(kernel)  # torch's Conv1d default for a depthwise kernel
        self.conv_weight = make_parallel_param(
            (channels, kernel), 0, 1, groups,
            seeded_init(config.seed, f"{name}.conv_weight", lambda t, gen: t.uniform_(-bound, bound, generator=gen)),
            torch.float32, None)
        self.A_log = make_parallel_param(  # megatron-core's: A uniform in [1, 16]
            (nv,), 0, 1, groups,
            seeded_init(config.seed, f"{name}.A_log", lambda t, gen: t.copy_(t.uniform_(1, 16, generator=gen).log())),
            torch.float32, None)
        self.dt_bias = make_parallel_param((nv,), 0, 1, groups, nn.init.ones_, torch.float32, None)
        self.norm = RMSNorm(self.dv, config.norm_epsilon, groups, sequence_parallel=tp > 1)  # (heads split: summed)
        self.out_proj = RowParallelLinear(
            nv * self.dv, config.hidden_size, groups,
            normal_init(config.seed, f"{name}.out_proj.weight",
                        output_layer_std(config.init_method_std, config.num_layers)),
            bias=False, input_is_parallel=True, sequence_parallel=config.sequence_parallel)

    def forward(self, x, layout=None):
        """x [s(/tp), b, h]; `layout` (hybrid.model.sequence.SequenceLayout): the documents of packed rows, this
        rank's part of the sequence (CP, Ulysses), or a decoding step's (hybrid.model.kv_cache.DecodeLayout: this
        layer's state and conv tail in its cache)."""
        cache = getattr(layout, "cache", None)
        documents = None if layout is None or cache is not None else layout.documents
        proj = self.in_proj(x)  # [s, b, nk/tp * (2 dk + 2 r dv + 2 r)]
        proj = proj.view(*proj.shape[:2], self.key_heads, -1)
        split = None if layout is None else layout.cp or layout.ulysses
        if split is not None:  # megatron-core's CP for these layers: the whole sequence, for 1/N of the heads
            return self.out_proj(SequenceSplit(split, layout.cp is not None, proj.size(0), proj.device).around(
                partial(self.mix, documents=documents, part=split.rank), proj))
        return self.out_proj(self.mix(proj, documents, cache, layout))

    def mix(self, proj, documents=None, cache=None, layout=None, part: int = 0):
        """The token mixing of whole sequences: proj [s, b, key heads, 2 dk + 2 r dv + 2 r] -> [s, b, their value
        heads x dv] (the gated norm's output, before the output projection). The key heads are this TP rank's, or
        under a sequence split its `part`-th 1/N of them."""
        s, b, key_heads = proj.shape[:3]
        value_heads = key_heads * self.ratio
        keys = slice(part * key_heads, (part + 1) * key_heads)
        heads = slice(part * value_heads, (part + 1) * value_heads)
        if cache is not None:  # a left-padded prompt's padding slots: inputs of zero (transformers' padding mask),
            valid = cache.valid[:, layout.start:layout.start + s].t()[..., None, None]  # so the state stays at 0
            proj = proj * valid.to(proj.dtype)
        q, k, v, z, beta, a = proj.split(self.group_sizes, dim=-1)
        mixed = torch.cat([q, k, v], dim=-1).reshape(s, b, -1)  # the conv's channels, grouped per key head
        weight = self.conv_weight.view(self.key_heads, -1, self.conv_weight.size(1))[keys].flatten(0, 1)
        weight = weight.to(mixed.dtype)
        if cache is None:
            mixed = causal_depthwise_conv(mixed, weight, documents)
        else:  # the conv reads the tokens before the step from the cached tail
            mixed = self._conv_step(cache, mixed, weight)
        q, k, v = mixed.view(s, b, key_heads, -1).split(self.group_sizes[:3], dim=-1)
        g = -self.A_log[heads].float().exp() * F.softplus(a.reshape(s, b, value_heads).float()
                                                          + self.dt_bias[heads].float())  # [s, b, nv/tp]
        beta = beta.reshape(s, b, value_heads).sigmoid().float()  # (in the model's dtype first, as transformers)
        if fla_applies(proj, documents, cache):  # [b, s, heads, d], the L2 norms and the 1/sqrt(dk) scale in the
            # kernel; q and k repeated for their value heads here (as megatron-core does: fla releases before grouped
            # value heads read betas and decays at the key heads' stride)
            q, k = (t.repeat_interleave(self.ratio, dim=2) for t in (q, k))
            out, _ = FLA_CHUNK(*(t.transpose(0, 1) for t in (q, k, v.reshape(s, b, value_heads, self.dv), g, beta)),
                               use_qk_l2norm_in_kernel=True)
            return self._gated_norm(out.transpose(0, 1).to(proj.dtype), z, value_heads)
        # -> [b, heads, s, d] in fp32; each key head serves its `ratio` consecutive value heads
        q, k = (t.float().repeat_interleave(self.ratio, dim=2).permute(1, 2, 0, 3) for t in (q, k))
        v = v.reshape(s, b, value_heads, self.dv).float().permute(1, 2, 0, 3)
        q, k = l2_normalize(q) * self.dk ** -0.5, l2_normalize(k)
        beta, g = beta.permute(1, 2, 0), g.permute(1, 2, 0)  # [b, nv/tp, s]
        if cache is None:
            out, _ = chunk_gated_delta_rule(q, k, v, g, beta, self.config.linear_attention_chunk_size, documents)
        else:  # the prompt by chunks, then a token at a time, from the state the cache holds
            state = cache.linear_states.get(self.layer_number)
            rule = recurrent_gated_delta_rule if state is not None and s == 1 else \
                partial(chunk_gated_delta_rule, chunk_size=self.config.linear_attention_chunk_size)
            out, cache.linear_states[self.layer_number] = rule(q, k, v, g, beta, initial_state=state)
        return self._gated_norm(out.permute(2, 0, 1, 3).to(proj.dtype), z, value_heads)

    def _gated_norm(self, out, z, value_heads: int):
        """transformers' RMSNormGated: out [s, b, heads, dv] normed (this layer's weight), then times SiLU(z) in fp32
        -> [s, b, heads * dv]."""
        s, b = out.shape[:2]
        # (contiguous: with one value head per key head z is a view, and SiLU would keep the whole projection)
        gate = F.silu(z.reshape(s, b, value_heads, self.dv).float().contiguous())
        return (self.norm(out) * gate).to(out.dtype).reshape(s, b, -1)

    def _conv_step(self, cache, mixed, weight):
        """The conv over a decoding step's new inputs mixed [s, b, C], its first taps reading the last K - 1 inputs
        before the step (zeros before the prompt), which the cache then holds for the next step."""
        taps = weight.size(1) - 1
        if taps == 0:
            return causal_depthwise_conv(mixed, weight)
        tail = cache.conv_tails.get(self.layer_number)
        if tail is None:
            tail = mixed.new_zeros(taps, *mixed.shape[1:])
        joined = torch.cat([tail, mixed])
        cache.conv_tails[self.layer_number] = joined[-taps:]
        return causal_depthwise_conv(joined, weight)[taps:]
