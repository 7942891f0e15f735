"""Activation bytes: what one micro-batch through one layer keeps for backward (attention, MLA, Gated DeltaNet, MoE,
windows, FP8's copies), the embedding and head, the sequence split's buffers, and how many micro-batches a pipeline
stage holds at once. `korthikanti_layer_bytes` is Korthikanti et al. 2022 (Table 2), which
`layer_activation_bytes(..., style="megatron")` reproduces term by term."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from hybrid.model.attention import window_blocks
from hybrid.model.config import ModelConfig
from hybrid.parallel.ring_attention import tile_rows

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes per element of each training precision


@dataclass
class ActivationSettings:
    """What one micro-batch through one transformer layer keeps for backward."""

    micro_batch: int
    seq_length: int
    tp: int = 1
    sequence_parallel: bool = False
    precision: str = "bf16"
    recompute: Optional[str] = None  # None | selective | full
    attention_kernel: str = "flash"  # flash: SDPA flash/efficient kernels or flash-attn; math: s x s scores
    mask_bytes: int = 1  # a dropout mask element: bool on CUDA; CPU keeps it in the activation dtype
    cp: int = 1  # --context-parallel-size: this rank holds seq_length / cp tokens (ring attention)
    ulysses: int = 1  # --ds-sequence-parallel-size: seq_length / ulysses tokens, all-to-all around attention


def attention_kernel_for(device_type: str, precision: str, dropout: float, config: ModelConfig) -> str:
    """Which SDPA path torch takes: on CUDA the flash/efficient kernels (dropout included); on CPU
    the flash kernel without dropout and the math path (s x s scores) with it or with MLA's value heads; Megatron's
    query-key layer scaling under fp16 is an explicit math path."""
    if config.apply_query_key_layer_scaling and precision == "fp16":
        return "math"
    if device_type == "cpu" and (dropout > 0 or config.value_head_dim != config.head_dim):
        return "math"  # (CPU's fused kernel takes one head size for Q, K and V; MLA's values differ)
    return "flash"


def layer_activation_bytes(config: ModelConfig, act: ActivationSettings, style: str = "hybrid",
                           layer: int = 0) -> int:
    """Bytes transformer layer `layer` keeps for backward for one micro-batch on one TP rank.

    style "hybrid": the tensors this code base's layer saves (LayerNorm inputs, the gathered
    input of each column-parallel linear, the QKV output, attention output, MLP activations,
    dropout masks); style "megatron": Korthikanti et al.'s accounting (every tensor a shard
    under SP, Q and K saved apart from the QKV input)."""
    config = config.layer_config(layer)  # (Gemma 4: a full layer's own head size and KV heads, a wider MLP)
    s, b, h, t = act.seq_length // (act.cp * act.ulysses), act.micro_batch, config.hidden_size, act.tp
    e, m = BYTES[act.precision], act.mask_bytes
    sp = act.sequence_parallel and t > 1
    sbh = s * b * h
    shard = sbh // t if sp else sbh  # the residual stream: a sequence shard under SP
    heads, d = config.num_attention_heads // t, config.head_dim
    groups = config.num_query_groups // t
    f = config.ffn_hidden_size // t
    dropout = config.hidden_dropout > 0
    attn_dropout = config.attention_dropout > 0
    if act.recompute == "full":
        return e * shard  # the layer's input; the rest is recomputed in backward
    if style == "megatron":
        return _megatron_layer_bytes(s, b, h, config.num_attention_heads, t, sp, act.recompute == "selective")
    if config.normalization == "LayerNorm":  # its input, mean and rstd (fp32)
        norm = e * shard + 2 * 4 * (shard // h)
    else:  # RMSNorm in transformers' numerics: the fp32 input, rstd, and the normalised output
        norm = 4 * shard + 4 * (shard // h) + e * shard
    total = (4 if config.sandwich_norms else 2) * norm  # the input and post-attention norms (and the output norms)
    moe = config.mlp_type_of(layer) == "moe"
    linear = config.linear_attention(layer)
    if config.multi_latent_attention:  # the MLP's input; the attention's tensors (hybrid.model.mla)
        total += (0 if moe else 1) * e * sbh + _mla_bytes(config, s, b, t, sp, e, heads)
    elif linear:  # the input projection's and the MLP's inputs; Gated DeltaNet's tensors
        total += (1 if moe else 2) * e * sbh + gated_delta_net_bytes(config, s * act.cp * act.ulysses, b, t, e,
                                                                     act.cp * act.ulysses)
    else:
        total += (1 if moe else 2) * e * sbh  # each column-parallel linear's (all-gathered) input: the norms' outputs
        total += _qkv_bytes(config, act, s, b, e, heads, groups, d)
    if act.recompute != "selective" and not linear:
        window = config.layer_window(layer)
        total += _core_attention_bytes(s, b, heads, d, e, m, act.attention_kernel, attn_dropout,
                                       _attended_keys(s, window))
        if window is not None and s > window:
            total += _window_extra_bytes(s, b, heads, d, e, window)
    if moe:
        total += moe_block_bytes(config, s, b, t, sp, e)
    else:
        # GeLU: input, output; gated: fc1 out, product
        total += e * s * b * (3 * f if config.gated_linear_unit else 2 * f)
    if dropout:
        total += 2 * m * shard  # the two residual dropout masks
    if config.per_layer_input_size and layer < config.num_layers:  # Gemma 4's per-layer gate (hybrid.model.per_layer):
        total += e * (shard // h) * 3 * config.per_layer_input_size + norm  # gate out, GeLU out, product; its norm
    return total


def gated_delta_net_bytes(config: ModelConfig, s: int, b: int, t: int, e: int, split: int = 1) -> int:
    """What a Gated DeltaNet layer (hybrid.model.gated_delta_net) keeps for backward on one TP rank, for a whole
    sequence of `s` tokens (under a sequence split of `split` ranks: 1/split of the heads each): its projection's
    and conv's outputs, the normalised q and k, each chunk's decays, triangular system and scores (fp32, chunk x
    chunk), the states between chunks, the output, its gated norm, and the output projection's input. Within 10% of
    the saved tensors (tests/test_memory.py)."""
    keys, heads = config.linear_num_key_heads // t // split, config.linear_num_value_heads // t // split
    dk, dv, chunk = config.linear_key_head_dim, config.linear_value_head_dim, config.linear_attention_chunk_size
    chunks = -(-s // chunk)
    padded = chunks * chunk  # (the sequence padded to whole chunks)
    conv = keys * (2 * dk + heads // keys * dv)
    total = e * b * conv * (2 * s + config.linear_conv_kernel_dim - 1)  # the conv's padded input and its output
    # per token and value head: q and k normalised and their norms, beta, a and the decay, the output, its norm
    # and gate (fp32)
    total += 4 * s * b * heads * (2 * dk + 6 + 4 * dv)
    # per padded token and value head: the chunks' pair decays, triangular system and scores (chunk x chunk), the
    # padded q, k, v, k beta, v beta and the solved u and w, the scan's fresh values and output (fp32)
    total += 4 * b * heads * padded * (5 * chunk + 6 * dk + 4 * dv + 3)
    total += 4 * b * heads * chunks * dk * dv  # the state entering each chunk
    return total + e * s * b * heads * dv  # the output projection's input


def _mla_bytes(config: ModelConfig, s: int, b: int, t: int, sp: bool, e: int, heads: int) -> int:
    """What multi-latent attention keeps for backward on one TP rank: the norm's output its down projections take
    (a sequence shard under SP), the query and key-value latents and their norms (fp32 input, rstd, output; a
    shard under SP), the up projections' gathered inputs, the rotated query, the key (its rope part expanded to
    every head, a new tensor), the values made contiguous, and the attention's output."""
    local = s // t if sp and t > 1 else s
    q_rank, kv_rank = config.q_lora_rank or 0, config.kv_lora_rank
    d, v = config.head_dim, config.v_head_dim
    latents = local * b * (q_rank + kv_rank)
    total = e * local * b * config.hidden_size  # the down projections' input
    total += 4 * latents + 4 * local * b * (2 if q_rank else 1) + e * latents  # the latents' norms
    total += e * s * b * (q_rank + kv_rank + config.qk_pos_emb_head_dim)  # the up projections' inputs, the rope key
    # (the up projections' outputs are split and copied into q, k and v, not kept)
    total += e * s * b * heads * (d + d + v + v) + 8 * s * config.qk_pos_emb_head_dim  # q, k, v, output; tables
    return total


def _qkv_bytes(config: ModelConfig, act, s: int, b: int, e: int, heads: int, groups: int, d: int) -> int:
    """The fused QKV projection's output and what the attention derives from it (Q/K norms, rope, GQA copies, the
    ring's and Ulysses' own tensors) and its output."""
    total = e * s * b * (heads + 2 * groups) * d  # QKV output (K and V are views of it)
    if config.qk_layernorm:  # an RMSNorm over each Q and K head, as the layer norms (fp32 input, rstd, output)
        qk = s * b * (heads + groups) * d
        total += 4 * qk + 4 * (qk // d) + e * qk
    if config.position_embedding_type == "rope":  # rotated Q and K are new tensors; cos/sin tables
        total += e * s * b * (heads + groups) * d + 8 * s * d
    elif heads != groups:  # GQA: the query heads are copied out of the per-group layout
        total += e * s * b * heads * d
    total += e * s * b * heads * d  # attention output = the dense layer's input
    if config.attention_output_gate:  # the gate's sigmoid and the gated output (hybrid.model.attention)
        total += 2 * e * s * b * heads * d
    if act.cp > 1 and act.recompute != "selective":  # the ring keeps its merged output (and q, k, v views)
        total += e * s * b * heads * d
    if act.ulysses > 1 and act.recompute != "selective":
        # attention keeps the all-to-all'd q, k, v (whole sequences of heads / N, as many elements) and
        # its own output instead of views of the QKV output and the rotated (or copied) Q and K
        total -= e * s * b * (heads + 2 * groups) * d  # the QKV output: no longer saved
        if config.position_embedding_type == "rope":
            total -= e * s * b * (heads + groups) * d
        elif heads != groups:
            total -= e * s * b * heads * d
        total += e * s * b * (heads + 2 * groups) * d + e * s * b * heads * d
    return total


def moe_block_bytes(config: ModelConfig, s: int, b: int, t: int, sp: bool, e: int) -> int:
    """What an MoE layer's feed-forward block keeps for backward (hybrid.model.moe), its T tokens on this
    rank (a sequence shard under SP) and N = T x k dispatched rows (balanced routing; at most the
    capacity): the router's input, the rows, each expert's activations and output, the weighted output;
    the choices, sort order and probabilities; the balancing losses' scores; the shared experts (a dense
    MLP on the gathered input) and their gate. Measured against saved-tensor hooks (tests/test_memory.py)."""
    h, k, experts = config.hidden_size, config.moe_router_topk, config.num_experts
    tokens = s * b // t if sp else s * b
    rows = tokens * k
    if config.moe_expert_capacity_factor is not None:
        rows = min(rows, experts * math.ceil(rows / experts * config.moe_expert_capacity_factor))
    f, gated = config.moe_ffn_hidden_size, config.gated_linear_unit
    total = e * tokens * h  # the router's input (the norm's output, this rank's tokens)
    total += e * rows * (3 * h + (3 * f if gated else 2 * f))  # rows, fc1 out (+ product), fc2 out, weighted
    total += 8 * tokens * k + 16 * rows + 4 * tokens * k + e * rows  # choices, order, probabilities, per row
    if config.moe_router_score_function == "sigmoid":
        total += 4 * tokens * experts + 4 * tokens  # the sigmoid scores and their top-k sum
    if config.moe_router_load_balancing_type != "none" and config.moe_aux_loss_coeff:
        total += 4 * tokens * experts  # the scores over every expert
    if config.moe_z_loss_coeff:
        total += (4 * tokens * experts if e != 4 else 0) + 8 * tokens  # fp32 logits, logsumexp and its square
    shared = config.moe_shared_expert_intermediate_size
    if shared:
        fs = shared // t
        total += (e * s * b * h if sp else 0) + e * s * b * (3 * fs if gated else 2 * fs)
        if config.moe_shared_expert_gate:
            total += e * tokens * h + e * tokens  # the shared output and the gate's sigmoid
    return total


def sequence_split_buffer_bytes(config: ModelConfig, act: ActivationSettings, device_type: str = "cuda") -> int:
    """Transient buffers of one attention layer's backward (the larger pass), per rank: the ring's K/V
    block in flight (sent and received), its fp32 K/V gradient in flight and the fp32 query gradient,
    and off the CPU or with attention dropout its math kernel's GQA-expanded fp32 K/V, three fp32 score
    tiles and with dropout the tile's int64 hash (of at most
    hybrid.parallel.ring_attention.MATH_TILEBYTES each); Ulysses' all-to-all inputs and outputs of q, k, v.
    Zero without a sequence split."""
    s, b, t = act.seq_length // (act.cp * act.ulysses), act.micro_batch, act.tp
    e, d = BYTES[act.precision], config.head_dim
    heads, groups = config.num_attention_heads // t, config.num_query_groups // t
    if act.cp > 1:
        kv = 2 * b * groups * s * d
        total = 2 * e * kv + 2 * 4 * kv + 4 * b * heads * s * d
        dropout = config.attention_dropout > 0
        if device_type != "cpu" or dropout:  # the math kernel (with dropout: and its int64 hash per tile)
            tile = b * heads * min(tile_rows(b, heads, s, dropout), s) * s
            total += 2 * 4 * b * heads * s * d + 3 * 4 * tile + (8 * tile if dropout else 0)
        return total
    if act.ulysses > 1:
        return 2 * e * b * s * (heads + 2 * groups) * d
    return 0


def _window_scores(s: int, window: int) -> int:
    """(query, key) pairs of windowed attention's query blocks (hybrid.model.attention.window_blocks)."""
    return sum((end - start) * (end - first) for start, end, first in window_blocks(s, window))


def _attended_keys(s: int, window) -> float:
    """Keys scored per query on average: all s, or those of a window's query blocks."""
    if window is None or s <= window:
        return s
    return _window_scores(s, window) / s


def _window_extra_bytes(s, b, heads, d, e, window) -> int:
    """Windowed attention's blocks: each block's mask (as SDPA keeps it, in the compute dtype) and
    output (the concatenated output is another tensor)."""
    return e * _window_scores(s, window) + e * s * b * heads * d


def _core_attention_bytes(s, b, heads, d, e, m, kernel, dropout, keys=None) -> int:
    if kernel == "flash":
        return 4 * b * heads * s  # log-sum-exp per query (fp32); the output is counted by the caller
    scores = int(b * heads * s * (keys or s))
    # math path: softmax output, dropout mask and dropped probabilities; a scaled Q copy
    return (e + m + e) * scores + e * s * b * heads * d if dropout else e * scores + e * s * b * heads * d


def _megatron_layer_bytes(s, b, h, a, t, sp, selective) -> int:
    """Korthikanti et al.'s per-layer terms, fp16 (2 bytes) with 1-byte dropout masks."""
    sbh = s * b * h
    par = sbh // t  # tensors split over TP (heads / ffn), always
    rep = par if sp else sbh  # tensors replicated over TP without SP, split with it
    attention = 2 * rep + 4 * par + 2 * par + 2 * par + 1 * rep  # QKV in; Q, K; V; dense in; dropout mask
    if not selective:
        attention += (2 + 1 + 2) * a * s * s * b // t  # softmax out, its dropout mask, dropout out
    mlp = 2 * rep + 8 * par + 8 * par + 1 * rep  # fc1 in; GeLU in; fc2 in; dropout mask
    norms = 2 * 2 * rep
    return attention + mlp + norms


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: Optional[str] = None) -> float:
    """Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
    Models"), Table 2: activation bytes per transformer layer, in closed form."""
    if recompute == "full":  # the layer's input (Table 2: 2sbh; a sequence shard under SP)
        return 2 * s * b * h / (t if sp else 1)
    if recompute == "selective":
        return s * b * h * (34 / t if sp else 10 + 24 / t)
    if sp:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def in_flight_micro_batches(stage: int, pp: int, num_micro_batches: int, schedule: str = "1f1b",
                            virtual: int = 1) -> float:
    """Micro-batches (through all of a rank's layers) whose activations pipeline rank `stage` holds
    at its peak. 1F1B warms up pp - stage. Interleaved 1F1B (torch's, as Megatron's) warms up
    (v-1) pp + 2 (pp-1-stage) virtual-stage micro-batches, each 1/v of the rank's layers: rank 0 holds
    pp + (pp-1)/v (Narayanan et al. 2021). Zero-bubble keeps each activation until its weight gradient:
    torch's interleaved zero-bubble and ZB-V hold pp (Qi et al. 2024), DualPipeV pp + 1/2 (DeepSeek-V3's
    PP + 1 half-size chunks), on every rank once there are as many micro-batches. Each figure equals the
    peak measured by benchmarks/pipeline_bubble.py and the peak of the schedule's own action order."""
    if pp == 1:
        return 1
    m = num_micro_batches
    if schedule == "interleaved-1f1b":
        return min(virtual * m, (virtual - 1) * pp + 2 * (pp - 1 - stage) + 1) / virtual
    if schedule in ("zero-bubble", "zbv"):
        return min(pp, m)
    if schedule == "dualpipev":
        return min(pp + 0.5, m)
    return min(pp - stage, m)


def _fp8_linears(config: ModelConfig, layer: int, tp: int) -> list[tuple[int, int, int]]:
    """(input features, output features on this rank, projections) of a layer's FP8 GEMMs (hybrid.parallel.fp8)."""
    h, heads, groups, d = config.hidden_size, config.num_attention_heads, config.num_query_groups, config.head_dim
    gated = 2 if config.gated_linear_unit else 1
    ffn = config.moe_shared_expert_intermediate_size if config.mlp_type_of(layer) == "moe" else config.ffn_hidden_size
    linears = [(h, (heads + 2 * groups) * d // tp, 3), (heads * d // tp, h, 1)]
    if ffn:
        linears += [(h, gated * ffn // tp, gated), (ffn // tp, h, 1)]
    return linears


def fp8_bytes(config: ModelConfig, layers: list, act: ActivationSettings) -> int:
    """What FP8 GEMMs add on a rank holding `layers`: the FP8 copies of the largest GEMM's operands while it
    runs (its weight, its input and its output gradient, one byte each; the high-precision ones are what is
    saved for backward, as torchao's), and delayed scaling's amax histories (fp32, per linear layer:
    history x (input, output gradient, each projection of the weight))."""
    fp8_layers = [i for i in layers if config.fp8_layer(i)]
    if not fp8_layers:
        return 0
    tokens = act.micro_batch * act.seq_length // (act.cp * act.ulysses)
    linears = [lin for i in fp8_layers for lin in _fp8_linears(config, i, act.tp)]
    transient = max(n_in * n_out + tokens * (n_in + n_out) for n_in, n_out, _ in linears)
    history = 0
    if config.fp8_recipe == "delayed":
        history = sum(4 * config.fp8_amax_history_len * (2 + projections) for _, _, projections in linears)
    return transient + history


def embedding_and_head_bytes(config: ModelConfig, act: ActivationSettings, first: bool, last: bool) -> int:
    """The first stage's embedding output (and its dropout mask); the last stage's final norm input
    and the logits the loss keeps (vocabulary shard, activation dtype plus fp32 softmax)."""
    s, b, h, t = act.seq_length // (act.cp * act.ulysses), act.micro_batch, config.hidden_size, act.tp
    e = BYTES[act.precision]
    shard = s * b * h // (t if act.sequence_parallel and t > 1 else 1)
    total = 0
    if first:
        total += e * shard + (act.mask_bytes * shard if config.hidden_dropout > 0 else 0)
        if config.per_layer_input_size:  # Gemma 4's per-layer inputs, read by every layer, and their projection
            width = config.per_layer_input_size * config.num_layers
            total += e * (shard // h) * width + 2 * e * s * b * width
    if last:
        vocab = config.padded_vocab_size(t) // t
        depths = 1 + (config.mtp_num_layers or 0)  # multi-token prediction: each depth's hidden and logits, and
        total += depths * (e * shard + e * s * b * h + (e + (4 if e != 4 else 0)) * s * b * vocab)
        if depths > 1:  # the objective's copies of the depths' logits; each depth's embeddings, norms, eh_proj input
            total += (depths - 1) * (e * s * b * vocab + (4 * e + 8) * shard)
    return total
