"""The transformer's shape and options, named as Megatron-LM's flags."""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from typing import Optional

from hybrid.errors import ConfigError
from hybrid.model import lora

MLP_TYPES = ("dense", "moe")  # the feed-forward blocks hybrid.model.mlp.build_mlp can build
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")  # --moe-router-score-function
MOE_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")  # --moe-router-load-balancing-type
MOE_DROP_POLICIES = ("probs", "position")  # --moe-token-drop-policy
ROPE_SCALING_TYPES = ("llama3", "linear", "yarn", "proportional")  # hybrid.model.rotary.scaled_inv_freq
# Llama 3.1's values, which Megatron-LM's --use-rope-scaling hard-codes besides the factor
LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (its Eq. 21): 0.1 x mscale x ln(factor) + 1, 1 for factor <= 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_scaling(factor: float, original: int, beta_fast: float = 32.0, beta_slow: float = 1.0, mscale: float = 1.0,
                 mscale_all_dim: float = 0.0, round_to_int: bool = True) -> dict:
    """Megatron-LM's YaRN settings (--rotary-scaling-factor, --yarn-*, --mscale, --mscale-all-dim) as transformers'
    rope_parameters, the values meaning what megatron-core computes: its tables' scale is mscale(factor, mscale) /
    mscale(factor, mscale_all_dim), which transformers writes as mscale / mscale_all_dim when both are set, else as
    an explicit attention_factor (it ignores mscale without mscale_all_dim)."""
    scaling = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original),
               "beta_fast": float(beta_fast), "beta_slow": float(beta_slow)}
    if mscale_all_dim:
        scaling.update(mscale=float(mscale), mscale_all_dim=float(mscale_all_dim))
    elif mscale != 1.0:
        scaling["attention_factor"] = yarn_mscale(float(factor), float(mscale))
    if not round_to_int:
        scaling["truncate"] = False
    return scaling


MLA_YARN_ORIGINAL_CONTEXT = 4096  # megatron-core's MLATransformerConfig.original_max_position_embeddings
# Megatron-LM's --enable-gpt-oss (megatron/post_training/model_builder.py sets it on the model's config): GPT-OSS's
# YaRN as
# yarn_scaling's arguments (factor, original context, betas, mscale, mscale_all_dim, the correction range not rounded)
GPT_OSS_YARN = (32.0, 131072, 32.0, 1.0, 1.0, 0.0, False)


MAX_VOCAB_BLOCKS = 8  # ZeRO-3's row blocks of a vocabulary table (ModelConfig.zero3_vocab_block_rows)


@dataclass
class ModelConfig:
    """Decoder-only transformer: GPT-2 style by default, Llama style with the flags noted."""

    num_layers: int = 2  # --num-layers
    hidden_size: int = 64  # --hidden-size
    num_attention_heads: int = 4  # --num-attention-heads
    vocab_size: int = 1024  # tokenizer vocabulary (before padding)
    max_position_embeddings: int = 128  # --max-position-embeddings (learned positions table size)
    ffn_hidden_size: Optional[int] = None  # --ffn-hidden-size; default 4h (SwiGLU: 8h/3 rounded to 64)
    num_query_groups: Optional[int] = None  # --num-query-groups (GQA); None = one group per head
    position_embedding_type: str = "learned_absolute"  # --position-embedding-type learned_absolute|rope
    rotary_base: float = 10000.0  # --rotary-base
    rotary_percent: float = 1.0  # --rotary-percent: rope on the first int(head_dim x this) features of each head
    normalization: str = "LayerNorm"  # --normalization LayerNorm|RMSNorm
    rmsnorm_fp32_scale: bool = False  # --rmsnorm-fp32-scale: RMSNorm scales in fp32, then casts (Gemma 4's numerics)
    norm_epsilon: float = 1e-5  # --norm-epsilon
    swiglu: bool = False  # --swiglu (gated SiLU MLP instead of GeLU)
    add_bias_linear: bool = True  # --disable-bias-linear sets False
    untie_embeddings_and_output_weights: bool = False  # --untie-embeddings-and-output-weights
    hidden_dropout: float = 0.1  # --hidden-dropout
    attention_dropout: float = 0.1  # --attention-dropout
    init_method_std: float = 0.02  # --init-method-std
    make_vocab_size_divisible_by: int = 128  # --make-vocab-size-divisible-by
    apply_query_key_layer_scaling: bool = False  # --apply-query-key-layer-scaling (fp16 numerics)
    use_flash_attn: bool = False  # --use-flash-attn (used when importable on CUDA with fp16/bf16)
    recompute_granularity: Optional[str] = None  # --recompute-granularity full|selective
    recompute_method: str = "uniform"  # --recompute-method uniform|block
    recompute_num_layers: int = 1  # --recompute-num-layers
    sequence_parallel: bool = False  # --sequence-parallel
    async_tensor_model_parallel_allreduce: bool = True  # off: --no-async-tensor-model-parallel-allreduce
    # ZeRO-3 only (RunConfig.model_form, zero3_vocab_block_rows): an untied vocabulary table as separate parameters
    # of this many rows each, so ZeRO-3 gathers one block at a time (DeepSpeed's TiledLinear); 0: the table one
    # parameter. A form of the model, not the model: checkpoints record it in their layout, their model with 0
    vocab_block_rows: int = 0
    seed: int = 1234  # --seed: the full weights depend on it alone, not on the layout
    num_experts: Optional[int] = None  # --num-experts: a mixture of experts on the layers --moe-layer-freq names
    moe_layer_freq: object = 1  # --moe-layer-freq: every N-th layer (from layer 0) is MoE, or a 0/1 list per layer
    moe_ffn_hidden_size: Optional[int] = None  # --moe-ffn-hidden-size: each expert's width; None = --ffn-hidden-size
    moe_router_topk: int = 2  # --moe-router-topk: experts per token
    moe_router_score_function: str = "softmax"  # --moe-router-score-function softmax|sigmoid
    moe_router_pre_softmax: bool = False  # --moe-router-pre-softmax: softmax over all experts, then top-k
    moe_router_topk_scaling_factor: Optional[float] = None  # --moe-router-topk-scaling-factor: probs x factor
    moe_router_num_groups: Optional[int] = None  # --moe-router-num-groups: experts in this many equal groups, and
    moe_router_group_topk: Optional[int] = None  # --moe-router-group-topk: each token's top-k from this many groups
    moe_router_load_balancing_type: str = "aux_loss"  # --moe-router-load-balancing-type aux_loss|seq_aux_loss|none
    moe_aux_loss_coeff: float = 0.0  # --moe-aux-loss-coeff (0: no balancing loss, Megatron's default)
    moe_z_loss_coeff: Optional[float] = None  # --moe-z-loss-coeff: the router z-loss
    moe_router_enable_expert_bias: bool = False  # --moe-router-enable-expert-bias (sigmoid; DeepSeek-V3)
    # --moe-router-dtype fp32: the router's GEMM in fp32 (megatron-core's; transformers' DeepSeek-V3 and GLM-4.5
    # routers); None: in the input's dtype (Mixtral's, Qwen's, GPT-OSS's), its scores in fp32 either way
    moe_router_dtype: Optional[str] = None
    moe_router_bias_update_rate: float = 1e-3  # --moe-router-bias-update-rate: the bias step per iteration
    moe_shared_expert_intermediate_size: Optional[int] = None  # --moe-shared-expert-intermediate-size
    moe_shared_expert_gate: bool = False  # --moe-shared-expert-gate: sigmoid(x w) x shared output (Qwen2-MoE)
    # --moe-gemma4-block: Gemma 4's MoE block (26B-A4B): the shared experts (its dense MLP) normed after, the routed
    # experts reading their own norm of the residual and normed after; the router reading the residual RMS-normalised
    # times a learned per-feature scale and 1/sqrt(h), its renormalised top-k weights times a learned per-expert scale
    moe_gemma4_block: bool = False
    moe_expert_capacity_factor: Optional[float] = None  # --moe-expert-capacity-factor; None = dropless
    moe_token_drop_policy: str = "probs"  # --moe-token-drop-policy probs|position: which tokens over capacity go
    moe_pad_expert_input_to_capacity: bool = False  # --moe-pad-expert-input-to-capacity: fixed rows per expert
    moe_grouped_gemm: bool = False  # --moe-grouped-gemm: torch._grouped_mm where it runs, else a loop
    # --moe-routing-replay R3|R2 (--grpo): the generator's experts (R3) or the trainer's at generation (R2) replayed
    moe_routing_replay: Optional[str] = None
    kv_channels: Optional[int] = None  # --kv-channels: the head dimension; None = hidden / heads
    add_qkv_bias: bool = False  # --add-qkv-bias: a bias on Q, K and V only (Qwen2), with or without others
    qk_layernorm: bool = False  # --qk-layernorm: a norm (--normalization) over each head of Q and K (Qwen3); with
    # --multi-latent-attention the norms of its query and key-value latents, as megatron-core
    qk_norm_across_heads: bool = False  # --qk-norm-across-heads: with --qk-layernorm, one RMSNorm over all of Q's
    # heads together and one over all of K's (MiniMax-M2's, OLMo 2's), not one per head
    llama_4_scaling_beta: Optional[float] = None  # --llama-4-scaling-beta B: each query x (1 + B ln(1 + floor(p / L)))
    # at position p (Mistral 4's and Ministral 3's long-context temperature; transformers' get_llama_4_attn_scale)
    llama_4_scaling_length: Optional[int] = None  # --llama-4-scaling-length L (their original context, 8192)
    sliding_window: Optional[int] = None  # --window-size L,0: each token attends itself and L = window - 1 before
    window_attn_skip_freq: object = None  # --window-attn-skip-freq: every N-th layer (1-based) attends fully, or a
    # 0/1 list per layer (1: windowed), as Megatron-LM; None: the window on every layer
    local_rotary_base: Optional[float] = None  # --local-rotary-base: the windowed layers' rope base, unscaled (Gemma 3)
    softmax_scale: Optional[float] = None  # --softmax-scale: scores x this (Gemma 3: query_pre_attn_scalar^-0.5)
    attention_sinks: bool = False  # --softmax-type learnable: a learned sink logit per head (GPT-OSS)
    sandwich_norms: bool = False  # --sandwich-norms: the attention's and the MLP's outputs normed too (Gemma 2/3)
    rope_scaling: Optional[dict] = None  # {"rope_type": "llama3"|"linear"|"yarn"|"proportional", "factor": ...} (HF's)
    # Gemma 4: the full-attention layers' (those --window-attn-skip-freq names) own head size and KV heads, its
    # global_head_dim and num_global_key_value_heads (--global-kv-channels, --global-num-query-groups)
    global_kv_channels: Optional[int] = None
    global_num_query_groups: Optional[int] = None
    attention_k_eq_v: bool = False  # --attention-k-eq-v: the full-attention layers' keys serve as values (no V)
    v_norm: bool = False  # --v-norm: each value head RMS-normed, without a weight (Gemma 4)
    final_logit_softcapping: Optional[float] = None  # --final-logit-softcapping C: logits -> C tanh(logits / C)
    # each layer's output times a constant (Gemma 4's `layer_scalar` buffers; never trained, as in transformers):
    # --layer-scalars, one per layer; None: 1
    layer_scalars: Optional[tuple] = None
    # --per-layer-input-size P: Gemma 4's per-layer embeddings (E2B/E4B): a table of P features per layer and token,
    # plus a projection of the embeddings, gated into each layer's output (hybrid.model.per_layer); 0: none
    per_layer_input_size: int = 0
    # --num-kv-shared-layers N: the last N layers read the keys and values the last earlier layer of their kind
    # (windowed or full) computed, and have no key or value projection of their own (Gemma 4 E2B/E4B); 0: none
    kv_shared_layers: int = 0
    double_wide_shared_mlp: bool = False  # --double-wide-shared-mlp: those layers' MLPs twice --ffn-hidden-size wide
    mtp_num_layers: Optional[int] = None  # --mtp-num-layers: DeepSeek-V3's multi-token prediction depths (training)
    mtp_loss_scaling_factor: float = 0.1  # --mtp-loss-scaling-factor: their losses' weight (their mean's)
    multi_latent_attention: bool = False  # --multi-latent-attention: DeepSeek-V2/V3's MLA (the fields below)
    q_lora_rank: Optional[int] = None  # --q-lora-rank: queries through a rank-r down projection and norm; None: one
    kv_lora_rank: int = 32  # --kv-lora-rank: keys and values from one rank-r latent per token (normed)
    qk_head_dim: int = 128  # --qk-head-dim: each head's query/key features without rope
    qk_pos_emb_head_dim: int = 64  # --qk-pos-emb-head-dim: those with rope (the key's one part shared by every head)
    v_head_dim: int = 128  # --v-head-dim: each head's value features
    # --experimental-attention-variant dsa --dsa-indexer-topk K: DeepSeek sparse attention beside MLA
    # (hybrid.model.dsa): each query attends the K keys its lightning indexer scores highest (DeepSeek-V3.2: 2048);
    # None: dense MLA
    dsa_indexer_topk: Optional[int] = None
    dsa_indexer_n_heads: int = 64  # --dsa-indexer-n-heads: the indexer's query heads
    dsa_indexer_head_dim: int = 128  # --dsa-indexer-head-dim: its query and key size (rope on the first features)
    # --dsa-indexer-loss-coeff C > 0: the indexer trains by its KL loss to the main attention, times C (megatron-core's;
    # hybrid.model.dsa); 0: frozen, as transformers runs it
    dsa_indexer_loss_coeff: float = 0.0
    dsa_indexer_use_sparse_loss: bool = False  # --dsa-indexer-use-sparse-loss: that KL over the chosen top-k keys only
    # GLM-5's index sharing: a 0/1 list per layer, 1 where the layer attends the keys the previous full layer's indexer
    # chose and has no indexer of its own (--dsa-indexer-topk-freq / --dsa-indexer-skip-topk-offset); None: none
    dsa_index_share: object = None
    # --experimental-attention-variant gated_delta_net --linear-attention-freq N|list: Gated DeltaNet linear attention
    # (hybrid.model.gated_delta_net) on the layers the pattern names and full attention on the others (Qwen3-Next,
    # Qwen3.5); megatron-core's: N, every N-th layer (1-based) attends fully; or a 0/1 list per layer (1: linear).
    # None: no linear attention
    linear_attention_freq: object = None
    linear_conv_kernel_dim: int = 4  # --linear-conv-kernel-dim: the causal depthwise conv's taps on q, k and v
    linear_key_head_dim: int = 128  # --linear-key-head-dim: each query / key head's features
    linear_value_head_dim: int = 128  # --linear-value-head-dim: each value (and output gate) head's features
    linear_num_key_heads: int = 16  # --linear-num-key-heads
    linear_num_value_heads: int = 32  # --linear-num-value-heads: a multiple of the key heads (each serves a group)
    linear_attention_chunk_size: int = 64  # --linear-attention-chunk-size: tokens per chunk of the training form
    attention_output_gate: bool = False  # --attention-output-gate: each head's output x sigmoid(x W_gate) (Qwen3.5)
    # --mla-latent-norm-epsilon: MLA's query and key-value latent norms' epsilon where it is not --norm-epsilon
    # (transformers' DeepSeek-V3 family computes them with 1e-6 whatever rms_norm_eps says: GLM-5's 1e-5)
    mla_latent_norm_epsilon: Optional[float] = None
    apply_layernorm_1p: bool = False  # --apply-layernorm-1p: norms scale by (1 + weight), weights start at 0
    geglu: bool = False  # --geglu: gated tanh-GeLU MLP (Gemma) instead of SwiGLU / GeLU
    quick_geglu: bool = False  # --quick-geglu: gate x sigmoid(1.702 gate) x up (GPT-OSS), gated as --swiglu
    glu_linear_offset: float = 0.0  # --glu-linear-offset: the gated unit's up half + this (GPT-OSS: 1)
    activation_func_clamp_value: Optional[float] = None  # --activation-func-clamp-value: gate <= c, |up| <= c
    scale_embeddings: bool = False  # --scale-embeddings: word embeddings x sqrt(hidden), in their dtype (Gemma)
    reset_attention_mask: bool = False  # --reset-attention-mask: a token attends its own document only (packed data)
    reset_position_ids: bool = False  # --reset-position-ids: positions restart at 0 after each EOD token
    eod_token: Optional[int] = None  # the end-of-document id at which those two split sequences (the tokenizer's)
    # --fp8-recipe when --fp8-format is given: tensorwise|rowwise|delayed; None: no FP8
    fp8_recipe: Optional[str] = None
    fp8_format: str = "hybrid"  # --fp8-format e4m3|hybrid (hybrid: gradients in e5m2)
    fp8_amax_history_len: int = 1  # --fp8-amax-history-len (delayed scaling)
    fp8_amax_compute_algo: str = "most_recent"  # --fp8-amax-compute-algo most_recent|max (delayed scaling)
    fp8_margin: int = 0  # --fp8-margin (delayed scaling)
    fp8_layers_start_high_precision: int = 0  # --first-last-layers-bf16 --num-layers-at-start-in-bf16
    fp8_layers_end_high_precision: int = 0  # --first-last-layers-bf16 --num-layers-at-end-in-bf16
    lora_rank: int = 0  # --lora-rank: low-rank adapters of this rank (hybrid.model.lora), the rest frozen; 0: none
    lora_alpha: float = 8.0  # --lora-alpha (PEFT's default): the adapters' output x alpha / rank
    lora_dropout: float = 0.0  # --lora-dropout: dropout on the adapters' input (PEFT's)
    lora_target_modules: tuple = ()  # --lora-target-modules: the HF projections adapted (PEFT's); (): q_proj v_proj
    lora_use_rslora: bool = False  # --lora-use-rslora: alpha / sqrt(rank) (rank-stabilised LoRA)
    lora_modules_to_save: tuple = ()  # --lora-modules-to-save: embed_tokens / lm_head train whole (PEFT's)
    family: Optional[str] = None  # the HF family (hybrid.conversion.families); None: chosen from the options
    hf_dtype: Optional[str] = None  # the imported HF model's dtype ("bfloat16", ...): export writes it; None: fp32

    def __post_init__(self):
        self.lora_target_modules = tuple(self.lora_target_modules or ())  # (a list, read from a checkpoint's JSON)
        self.lora_modules_to_save = tuple(self.lora_modules_to_save or ())
        if self.layer_scalars is not None:
            self.layer_scalars = tuple(float(x) for x in self.layer_scalars)
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None:
            if self.gated_linear_unit:  # Megatron-LM's default keeps the parameter count of a 4h GeLU MLP
                self.ffn_hidden_size = int((4 * self.hidden_size * 2 / 3) / 64) * 64 or 4 * self.hidden_size
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_experts and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        self.validate()

    def pattern_layer(self, layer: int) -> int:
        """The decoder layer whose kind (MoE, window, rope) layer `layer` takes: itself, or for a multi-token
        prediction layer (numbered after the decoder's) the last decoder layer, as megatron-core builds it."""
        return min(layer, self.num_layers - 1)

    @property
    def mtp_layers(self) -> list:
        """The layer numbers of the multi-token prediction layers (after the decoder's)."""
        return list(range(self.num_layers, self.num_layers + (self.mtp_num_layers or 0)))

    def mlp_type_of(self, layer: int) -> str:
        """The feed-forward block of layer `layer` (0-based): "moe" where --moe-layer-freq puts experts."""
        if not self.num_experts:
            return "dense"
        layer = self.pattern_layer(layer)
        freq = self.moe_layer_freq
        on = freq[layer] if isinstance(freq, (list, tuple)) else layer % int(freq) == 0
        return "moe" if on else "dense"

    def layer_window(self, layer: int) -> Optional[int]:
        """Layer `layer`'s (0-based) attention window, None for full attention (--window-attn-skip-freq)."""
        freq = self.window_attn_skip_freq
        if self.sliding_window is None or freq is None:
            return self.sliding_window
        layer = self.pattern_layer(layer)
        windowed = freq[layer] if isinstance(freq, (list, tuple)) else (layer + 1) % int(freq) != 0
        return self.sliding_window if windowed else None

    def linear_attention(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) mixes tokens by Gated DeltaNet rather than attention
        (--linear-attention-freq)."""
        freq = self.linear_attention_freq
        if freq is None:
            return False
        layer = self.pattern_layer(layer)
        return bool(freq[layer]) if isinstance(freq, (list, tuple)) else (layer + 1) % int(freq) != 0

    def layer_rope(self, layer: int) -> tuple:
        """Layer `layer`'s rope base and scaling: a windowed layer takes --local-rotary-base unscaled where given."""
        if self.local_rotary_base is not None and self.layer_window(layer) is not None:
            return self.local_rotary_base, None
        return self.rotary_base, self.rope_scaling

    def layer_config(self, layer: int) -> "ModelConfig":
        """The config layer `layer`'s attention and MLP are built from: this one, or for a full-attention layer of a
        model with --global-kv-channels / --global-num-query-groups one with those as --kv-channels /
        --num-query-groups, its `attention_k_eq_v` whether this layer's keys serve as values (the full layers'
        only), its --ffn-hidden-size doubled on a KV-sharing layer with --double-wide-shared-mlp (Gemma 4)."""
        full = self.layer_window(layer) is None
        changes = {}
        if full and (self.global_kv_channels or self.global_num_query_groups):
            changes = dict(kv_channels=self.global_kv_channels or self.kv_channels,
                           num_query_groups=self.global_num_query_groups or self.num_query_groups)
        if self.attention_k_eq_v and not full:
            changes["attention_k_eq_v"] = False
        if self.double_wide_shared_mlp and self.kv_source(layer) is not None:
            changes["ffn_hidden_size"] = 2 * self.ffn_hidden_size
        if not changes:
            return self
        return dataclasses.replace(self, global_kv_channels=None, global_num_query_groups=None,
                                   double_wide_shared_mlp=False, **changes)

    def kv_source(self, layer: int) -> Optional[int]:
        """The layer whose keys and values layer `layer` attends with (--num-kv-shared-layers: the last layer before
        the sharing ones of its kind, windowed or full), or None: its own."""
        first_shared = self.num_layers - self.kv_shared_layers
        if not self.kv_shared_layers or not first_shared <= layer < self.num_layers:
            return None
        kind = self.layer_window(layer) is None
        return max(i for i in range(first_shared) if (self.layer_window(i) is None) == kind)

    def fp8_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s linear layers run FP8 GEMMs (--fp8-format, outside the bf16 ends)."""
        return self.fp8_recipe is not None and self.fp8_layers_start_high_precision <= layer < \
            self.num_layers - self.fp8_layers_end_high_precision

    @property
    def moe_layers(self) -> list:
        return [i for i in range(self.num_layers) if self.mlp_type_of(i) == "moe"]

    @property
    def head_dim(self) -> int:
        """Each head's query/key features (MLA: with and without rope)."""
        if self.multi_latent_attention:
            return self.qk_head_dim + self.qk_pos_emb_head_dim
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def common_query_groups(self) -> int:
        """The greatest count dividing every layer's KV groups (--global-num-query-groups: both kinds')."""
        return math.gcd(self.num_query_groups, self.global_num_query_groups or self.num_query_groups)

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def attention_scale(self) -> float:
        """The scores' scale: --softmax-scale, else 1/sqrt(head dim); MLA with YaRN also x mscale(mscale_all_dim)^2
        (DeepSeek's reference, megatron-core's and transformers' MLA)."""
        if self.softmax_scale is not None:
            return self.softmax_scale
        scale = 1.0 / math.sqrt(self.head_dim)
        scaling = self.rope_scaling or {}
        if self.multi_latent_attention and scaling.get("rope_type") == "yarn" and scaling.get("mscale_all_dim"):
            mscale = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
            scale = scale * mscale * mscale
        return scale

    @property
    def rotary_dim(self) -> int:
        """The features of each head that rope rotates (Megatron's int(kv_channels x rotary_percent), transformers'
        int(head_dim x partial_rotary_factor)); the rest pass unrotated."""
        if self.multi_latent_attention:
            return int(self.qk_pos_emb_head_dim * self.rotary_percent)
        return int(self.head_dim * self.rotary_percent)

    @property
    def gated_linear_unit(self) -> bool:
        """fc1 computes [gate; up] (SwiGLU, GeGLU or quick-GeGLU)."""
        return self.swiglu or self.geglu or self.quick_geglu

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def splits_documents(self) -> bool:
        """Packed documents are kept apart (attention or positions restart after EOD)."""
        return self.reset_attention_mask or self.reset_position_ids

    @property
    def stages_take_ids(self) -> bool:
        """Every pipeline stage gets the micro-batch's whole-sequence ids: to find packed documents, or for the
        last stage's multi-token prediction (the tokens ahead)."""
        return self.splits_documents or bool(self.mtp_num_layers)

    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def zero3_vocab_block_rows(self, tp: int) -> int:
        """Under ZeRO-3, the rows of each block of an untied vocabulary table (vocab_block_rows; 0: whole).

        ZeRO-3 gathers a parameter whole for its module's forward and backward, and autograd makes its gradient
        whole before ZeRO reduce-scatters it: for a vocabulary table, by far a small model's largest parameter
        (GPT-2's 38.6M of 162M), that is the table twice over beside the partitioned states, on the stage that
        holds it. As DeepSpeed's TiledLinear does, the table is then separate parameters
        (hybrid.parallel.layers.TableBlock), gathered and reduced one after the other: as many as make each no
        larger than the layer's largest matrix (the MLP's first, [ffn (x2 gated) / tp, h]), but at most
        MAX_VOCAB_BLOCKS (each is a module with ZeRO-3's hooks and gathers of its own; GPT-2's 50,304 rows at
        hidden 768: 8 blocks of 6,288 rows, twice its MLP matrix, an eighth of the table). Not for a table read
        outside its module (tied, or multi-token prediction's embeddings): that reader takes the parameter whole."""
        if self.tied_embeddings or self.mtp_num_layers:
            return 0
        rows = self.padded_vocab_size(tp) // tp
        layer_rows = max(1, (self.ffn_hidden_size or 4 * self.hidden_size) * (2 if self.gated_linear_unit else 1) // tp)
        if rows <= layer_rows:
            return 0
        blocks = min(MAX_VOCAB_BLOCKS, -(-rows // layer_rows))
        return -(-rows // blocks)

    def vocab_blocked(self, tp: int) -> bool:
        """This model's untied vocabulary tables are row blocks (`blocks.{i}.weight`) at TP `tp`."""
        return 0 < self.vocab_block_rows < self.padded_vocab_size(tp) // tp

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rounded up to a multiple of make-vocab-size-divisible-by x TP, as Megatron-LM."""
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def validate(self, tp: int = 1) -> None:
        """Every shape rule, checked once before a model is built; errors name the flag."""
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads != 0:
            raise ConfigError(f"--hidden-size {self.hidden_size} must be divisible by "
                              f"--num-attention-heads {self.num_attention_heads}.")
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ConfigError(f"--num-attention-heads {self.num_attention_heads} must be divisible by "
                              f"--num-query-groups {self.num_query_groups}.")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ConfigError(f"--position-embedding-type must be learned_absolute or rope, "
                              f"got {self.position_embedding_type!r}.")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ConfigError(f"--normalization must be LayerNorm or RMSNorm, got {self.normalization!r}.")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ConfigError(f"--recompute-granularity must be full or selective, "
                              f"got {self.recompute_granularity!r}.")
        if self.num_experts:
            self._validate_moe()
        if self.recompute_method not in ("uniform", "block"):
            raise ConfigError(f"--recompute-method must be uniform or block, got {self.recompute_method!r}.")
        if not 0 < self.rotary_percent <= 1:
            raise ConfigError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}.")
        if self.position_embedding_type == "rope" and (self.rotary_dim % 2 != 0 or self.rotary_dim == 0):
            raise ConfigError(f"rope needs an even, non-zero number of rotated features per head: --kv-channels (or "
                              f"--hidden-size / --num-attention-heads) {self.head_dim} x --rotary-percent "
                              f"{self.rotary_percent} gives {self.rotary_dim}.")
        if self.kv_channels is not None and self.kv_channels < 1:
            raise ConfigError(f"--kv-channels must be positive, got {self.kv_channels}.")
        self._validate_query_options()
        if self.dsa_indexer_topk is not None:
            self._validate_dsa()
        if self.linear_attention_freq is not None or self.attention_output_gate:
            self._validate_linear_attention(tp)
        if self.swiglu + self.geglu + self.quick_geglu > 1:
            raise ConfigError("--swiglu, --geglu and --quick-geglu are three gated MLPs; give one.")
        if (self.glu_linear_offset or self.activation_func_clamp_value is not None) and not self.quick_geglu:
            raise ConfigError("--glu-linear-offset and --activation-func-clamp-value act on --quick-geglu's gated "
                              "unit (GPT-OSS's); add --quick-geglu.")
        if self.activation_func_clamp_value is not None and not self.activation_func_clamp_value > 0:
            raise ConfigError(f"--activation-func-clamp-value must be positive, got "
                              f"{self.activation_func_clamp_value}.")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"--window-size: the window must hold at least the token itself (got a window of "
                              f"{self.sliding_window}).")
        self._validate_rope_scaling()
        self._validate_layer_kinds()
        if self.lora_rank < 0:
            raise ConfigError(f"--lora-rank must be positive (0: no adapters), got {self.lora_rank}.")
        if self.lora_rank:
            lora.check(self, tp)
        if self.multi_latent_attention:
            self._validate_mla()
        if self.attention_sinks and self.multi_latent_attention:
            raise ConfigError("--softmax-type learnable (attention sinks) runs with multi-head / grouped-query "
                              "attention; drop --multi-latent-attention.")
        if self.mtp_num_layers is not None and self.mtp_num_layers < 0:
            raise ConfigError(f"--mtp-num-layers must be >= 0, got {self.mtp_num_layers}.")
        if self.mtp_num_layers and self.position_embedding_type != "rope":
            raise ConfigError("--mtp-num-layers: the multi-token prediction layers see positions as rope does "
                              "(relative); use --position-embedding-type rope.")
        if self.splits_documents and self.eod_token is None:
            raise ConfigError("--reset-attention-mask / --reset-position-ids split sequences at the end-of-document "
                              "token; use a tokenizer that has one.")
        if tp > 1:
            if self.num_attention_heads % tp != 0:
                raise ConfigError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                                  f"--tensor-model-parallel-size {tp}.")
            if self.num_query_groups % tp != 0:
                raise ConfigError(f"--num-query-groups {self.num_query_groups} is not divisible by "
                                  f"--tensor-model-parallel-size {tp}; use a TP size that divides it.")
            if self.ffn_hidden_size % tp != 0:
                raise ConfigError(f"--ffn-hidden-size {self.ffn_hidden_size} is not divisible by "
                                  f"--tensor-model-parallel-size {tp}.")
            if self.global_num_query_groups and self.global_num_query_groups % tp != 0:
                raise ConfigError(f"--global-num-query-groups {self.global_num_query_groups} is not divisible by "
                                  f"--tensor-model-parallel-size {tp}; use a TP size that divides it.")
            shared = self.moe_shared_expert_intermediate_size
            if self.num_experts and shared and shared % tp != 0:
                raise ConfigError(f"--moe-shared-expert-intermediate-size {shared} is not divisible by "
                                  f"--tensor-model-parallel-size {tp}.")

    def _validate_moe(self) -> None:
        def choice(flag, value, allowed):
            if value not in allowed:
                raise ConfigError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}.")
        choice("--moe-router-score-function", self.moe_router_score_function, MOE_SCORE_FUNCTIONS)
        choice("--moe-router-load-balancing-type", self.moe_router_load_balancing_type, MOE_BALANCING_TYPES)
        choice("--moe-token-drop-policy", self.moe_token_drop_policy, MOE_DROP_POLICIES)
        if self.num_experts < 1:
            raise ConfigError(f"--num-experts must be positive, got {self.num_experts}.")
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise ConfigError(f"--moe-router-topk {self.moe_router_topk} must be between 1 and --num-experts "
                              f"{self.num_experts}.")
        self._check_layer_pattern("--moe-layer-freq", self.moe_layer_freq)
        self._validate_router_groups()
        if self.moe_router_dtype not in (None, "fp32"):
            raise ConfigError(f"--moe-router-dtype {self.moe_router_dtype}: only fp32 routing is implemented (the "
                              f"GEMM in fp32, as megatron-core's); use fp32 or drop the flag.")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ConfigError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (the bias "
                              "shifts sigmoid scores, as DeepSeek-V3 and Megatron-LM).")
        if self.moe_expert_capacity_factor is not None and not self.moe_expert_capacity_factor > 0:
            raise ConfigError(f"--moe-expert-capacity-factor must be positive, got {self.moe_expert_capacity_factor}.")
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            raise ConfigError("--moe-pad-expert-input-to-capacity pads each expert to its capacity: it needs "
                              "--moe-expert-capacity-factor.")
        if self.moe_shared_expert_gate and not self.moe_shared_expert_intermediate_size:
            raise ConfigError("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size.")
        if self.moe_gemma4_block:
            needs = {"--moe-shared-expert-intermediate-size (its dense MLP)": self.moe_shared_expert_intermediate_size,
                     "no --moe-shared-expert-gate": not self.moe_shared_expert_gate,
                     "--moe-router-score-function softmax": self.moe_router_score_function == "softmax",
                     "no --moe-router-pre-softmax (its top-k weights renormalised)": not self.moe_router_pre_softmax,
                     "no --moe-router-enable-expert-bias": not self.moe_router_enable_expert_bias,
                     "--normalization RMSNorm": self.normalization == "RMSNorm"}
            missing = [flag for flag, holds in needs.items() if not holds]
            if missing:
                raise ConfigError(f"--moe-gemma4-block needs {', '.join(missing)}.")

    def _validate_query_options(self) -> None:
        """--qk-norm-across-heads and --llama-4-scaling-beta / -length."""
        if self.qk_norm_across_heads and not (self.qk_layernorm and self.normalization == "RMSNorm"
                                              and not self.multi_latent_attention and not self.apply_layernorm_1p):
            raise ConfigError("--qk-norm-across-heads needs --qk-layernorm with --normalization RMSNorm (without "
                              "--apply-layernorm-1p or --multi-latent-attention): it makes Q's and K's RMSNorms span "
                              "every head (MiniMax-M2's).")
        if (self.llama_4_scaling_beta is None) != (self.llama_4_scaling_length is None) or \
                (self.llama_4_scaling_length is not None and self.llama_4_scaling_length < 1):
            raise ConfigError("--llama-4-scaling-beta and --llama-4-scaling-length come together, the length a "
                              f"positive number of positions (got {self.llama_4_scaling_beta} and "
                              f"{self.llama_4_scaling_length}).")

    def _validate_dsa(self) -> None:
        if not self.dsa_indexer_loss_coeff >= 0:
            raise ConfigError(f"--dsa-indexer-loss-coeff must be >= 0, got {self.dsa_indexer_loss_coeff}.")
        if not (self.multi_latent_attention and self.q_lora_rank):
            raise ConfigError("--experimental-attention-variant dsa needs --multi-latent-attention with --q-lora-rank: "
                              "the indexer reads MLA's query latent.")
        share = self.dsa_index_share
        if share is not None and (len(share) != self.num_layers or share[0] or set(share) - {0, 1}):
            raise ConfigError(f"DSA's index sharing (--dsa-indexer-topk-freq / --dsa-indexer-skip-topk-offset) must "
                              f"give one 0/1 per layer with the first layer running its indexer, got {share}.")
        if self.sliding_window is not None:
            raise ConfigError("--experimental-attention-variant dsa with --window-size: DSA chooses each query's keys "
                              "itself; a window beside it is not implemented.")
        if min(self.dsa_indexer_topk, self.dsa_indexer_n_heads) < 1 or \
                self.dsa_indexer_head_dim < self.qk_pos_emb_head_dim:
            raise ConfigError(f"--dsa-indexer-topk {self.dsa_indexer_topk} and --dsa-indexer-n-heads "
                              f"{self.dsa_indexer_n_heads} must be positive and --dsa-indexer-head-dim "
                              f"{self.dsa_indexer_head_dim} at least --qk-pos-emb-head-dim {self.qk_pos_emb_head_dim} "
                              f"(its rope features).")

    def dsa_source(self, layer: int) -> Optional[int]:
        """The layer whose indexer's choice layer `layer` reuses (GLM-5's index sharing), or None: its own."""
        share = self.dsa_index_share
        if not share or layer >= len(share) or not share[layer]:  # (an MTP layer runs its own)
            return None
        return max(i for i in range(layer) if not share[i])

    def _validate_mla(self) -> None:
        dims = {"--kv-lora-rank": self.kv_lora_rank, "--qk-head-dim": self.qk_head_dim,
                "--qk-pos-emb-head-dim": self.qk_pos_emb_head_dim, "--v-head-dim": self.v_head_dim,
                "--q-lora-rank": self.q_lora_rank if self.q_lora_rank is not None else 1}
        bad = [f"{flag} {value}" for flag, value in dims.items() if value < 1]
        if bad:
            raise ConfigError(f"--multi-latent-attention: {', '.join(bad)} must be positive.")
        if self.position_embedding_type != "rope":
            raise ConfigError("--multi-latent-attention needs --position-embedding-type rope (or yarn).")
        if not self.qk_layernorm:
            raise ConfigError("--multi-latent-attention needs --qk-layernorm: with MLA it norms the query and "
                              "key-value latents (megatron-core's q_layernorm / kv_layernorm, DeepSeek's q_a_layernorm "
                              "/ kv_a_layernorm); MLA without them is not implemented.")
        others = {"--num-query-groups": self.num_query_groups != self.num_attention_heads,
                  "--add-qkv-bias": self.add_qkv_bias,
                  "--rotary-percent": self.rotary_percent != 1.0,
                  "--kv-channels": self.kv_channels is not None}
        wrong = [flag for flag, on in others.items() if on]
        if wrong:
            raise ConfigError(f"--multi-latent-attention: {', '.join(wrong)} do not apply to MLA (a key and value per "
                              f"head from one latent, head sizes --qk-head-dim, --qk-pos-emb-head-dim and "
                              f"--v-head-dim, rope on the --qk-pos-emb-head-dim features); drop them.")

    def _validate_router_groups(self) -> None:
        groups, chosen, k, experts = (self.moe_router_num_groups, self.moe_router_group_topk, self.moe_router_topk,
                                      self.num_experts)
        if (groups is None) != (chosen is None):
            raise ConfigError("--moe-router-num-groups and --moe-router-group-topk go together (group-limited "
                              "routing); give both or neither.")
        if groups is None:
            return
        if groups < 1 or experts % groups != 0:
            raise ConfigError(f"--moe-router-num-groups {groups} must divide --num-experts {experts}.")
        if not 1 <= chosen <= groups:
            raise ConfigError(f"--moe-router-group-topk {chosen} must be between 1 and --moe-router-num-groups "
                              f"{groups}.")
        if not 1 <= k // chosen <= experts // groups or k > chosen * (experts // groups):
            raise ConfigError(f"--moe-router-topk {k} with --moe-router-group-topk {chosen}: a group is scored by its "
                              f"top {k} // {chosen} experts and the {chosen} groups must hold {k}; each group has "
                              f"{experts // groups} experts.")

    def _check_layer_pattern(self, flag: str, freq, meaning: str = "") -> None:
        """Megatron-LM's per-layer patterns (--moe-layer-freq, --window-attn-skip-freq): N >= 1, or one 0/1 per
        layer."""
        if isinstance(freq, (list, tuple)):
            if len(freq) != self.num_layers or set(freq) - {0, 1}:
                raise ConfigError(f"{flag} as a list needs one 0 or 1 per layer ({self.num_layers}{meaning}), "
                                  f"got {list(freq)}.")
        elif int(freq) < 1:
            raise ConfigError(f"{flag} must be >= 1 or a list of 0/1 per layer, got {freq}.")

    def _validate_layer_kinds(self) -> None:
        freq = self.window_attn_skip_freq
        if freq is not None:
            if self.sliding_window is None:
                raise ConfigError("--window-attn-skip-freq chooses the layers that attend fully, the others through "
                                  "the window: it needs --window-size.")
            self._check_layer_pattern("--window-attn-skip-freq", freq, "; 1: windowed")
        if self.local_rotary_base is not None and (self.position_embedding_type != "rope" or self.sliding_window is None
                                                   or not self.local_rotary_base > 0):
            raise ConfigError(f"--local-rotary-base {self.local_rotary_base} is the windowed layers' rope base: it "
                              f"needs --position-embedding-type rope, --window-size and a positive base.")
        if self.softmax_scale is not None and not self.softmax_scale > 0:
            raise ConfigError(f"--softmax-scale must be positive, got {self.softmax_scale}.")
        self._validate_gemma4_options()

    def _validate_gemma4_options(self) -> None:
        """--global-kv-channels / --global-num-query-groups, --attention-k-eq-v, --v-norm, --final-logit-softcapping,
        --layer-scalars (Gemma 4)."""
        if (self.global_kv_channels or self.global_num_query_groups) and self.sliding_window is None:
            raise ConfigError("--global-kv-channels / --global-num-query-groups shape the full-attention layers beside "
                              "windowed ones: they need --window-size (and --window-attn-skip-freq).")
        if self.global_kv_channels is not None and not self.global_kv_channels > 0:
            raise ConfigError(f"--global-kv-channels must be positive, got {self.global_kv_channels}.")
        groups = self.global_num_query_groups
        if groups is not None and not (groups > 0 and self.num_attention_heads % groups == 0):
            raise ConfigError(f"--num-attention-heads {self.num_attention_heads} must be divisible by "
                              f"--global-num-query-groups {groups}.")
        if (self.attention_k_eq_v or self.v_norm or self.global_kv_channels) and self.multi_latent_attention:
            raise ConfigError("--attention-k-eq-v, --v-norm and --global-kv-channels are options of the usual "
                              "attention, not of --multi-latent-attention.")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ConfigError(f"--final-logit-softcapping must be positive, got {self.final_logit_softcapping}.")
        if self.layer_scalars is not None and len(self.layer_scalars) != self.num_layers:
            raise ConfigError(f"--layer-scalars needs one value per layer ({self.num_layers}), got "
                              f"{len(self.layer_scalars)}.")
        if self.per_layer_input_size < 0:
            raise ConfigError(f"--per-layer-input-size must be >= 0, got {self.per_layer_input_size}.")
        if self.per_layer_input_size and self.position_embedding_type != "rope":
            raise ConfigError("--per-layer-input-size (Gemma 4's per-layer inputs) is built for rope models: it needs "
                              "--position-embedding-type rope.")
        shared = self.kv_shared_layers
        if shared:
            if not 0 < shared < self.num_layers:
                raise ConfigError(f"--num-kv-shared-layers {shared}: the sharing layers read an earlier layer's keys "
                                  f"and values, so it must be between 1 and --num-layers - 1 ({self.num_layers - 1}).")
            kinds = {self.layer_window(i) is None for i in range(self.num_layers - shared)}
            missing = [i for i in range(self.num_layers - shared, self.num_layers)
                       if (self.layer_window(i) is None) not in kinds]
            if missing:
                raise ConfigError(f"--num-kv-shared-layers {shared}: layer {missing[0]} is of a kind (windowed or "
                                  f"full) no earlier layer has, so no layer computes the keys and values it reads.")
            if self.multi_latent_attention:
                raise ConfigError("--num-kv-shared-layers is an option of the usual attention, not of "
                                  "--multi-latent-attention.")
        if self.double_wide_shared_mlp and not shared:
            raise ConfigError("--double-wide-shared-mlp widens the KV-sharing layers' MLPs: it needs "
                              "--num-kv-shared-layers.")

    def _validate_linear_attention(self, tp: int) -> None:
        """--linear-attention-freq and the Gated DeltaNet shapes, --attention-output-gate."""
        if self.multi_latent_attention:
            raise ConfigError("--attention-output-gate and Gated DeltaNet layers (--linear-attention-freq) sit beside "
                              "multi-head / grouped-query attention, not --multi-latent-attention.")
        if self.linear_attention_freq is None:
            return
        self._check_layer_pattern("--linear-attention-freq", self.linear_attention_freq, "; 1: Gated DeltaNet")
        for flag in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                     "linear_num_value_heads", "linear_attention_chunk_size"):
            if not getattr(self, flag) >= 1:
                raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {getattr(self, flag)}.")
        keys, values = self.linear_num_key_heads, self.linear_num_value_heads
        if values % keys:
            raise ConfigError(f"--linear-num-value-heads {values} must be a multiple of --linear-num-key-heads {keys} "
                              f"(each key head serves a group of value heads).")
        if keys % tp:
            raise ConfigError(f"--linear-num-key-heads {keys} is not divisible by --tensor-model-parallel-size {tp}: "
                              f"TP splits the Gated DeltaNet key heads with their value heads; use a TP size that "
                              f"divides it.")
        if self.mtp_num_layers or self.kv_shared_layers or self.per_layer_input_size:
            raise ConfigError("Gated DeltaNet layers (--linear-attention-freq) with --mtp-num-layers, "
                              "--num-kv-shared-layers or --per-layer-input-size are not implemented; drop those.")

    def _validate_rope_scaling(self) -> None:
        scaling = self.rope_scaling
        if scaling is None:
            return
        kind = scaling.get("rope_type")
        if kind not in ROPE_SCALING_TYPES:
            raise ConfigError(f"rope scaling {kind!r} is not supported; supported: {', '.join(ROPE_SCALING_TYPES)} "
                              f"(--use-rope-scaling / --rotary-seq-len-interpolation-factor).")
        if self.position_embedding_type != "rope":
            raise ConfigError("rope scaling (--use-rope-scaling, --rotary-seq-len-interpolation-factor) needs "
                              "--position-embedding-type rope.")
        if not float(scaling.get("factor", 0)) > 0:
            raise ConfigError(f"--rope-scaling-factor must be positive, got {scaling.get('factor')}.")
        if kind == "proportional" and not 0 < float(scaling.get("partial_rotary_factor", 1.0)) <= 1:
            raise ConfigError(f"--rotary-proportional-percent must be in (0, 1], got "
                              f"{scaling.get('partial_rotary_factor')}.")
        if kind == "yarn" and not scaling.get("original_max_position_embeddings"):
            raise ConfigError("yarn rope scaling needs original_max_position_embeddings "
                              "(--yarn-original-max-position-embeddings).")
        if kind == "llama3":
            missing = [k for k in LLAMA3_ROPE_DEFAULTS if k not in scaling]
            if missing:
                raise ConfigError(f"llama3 rope scaling lacks {', '.join(missing)}.")
            if not float(scaling["high_freq_factor"]) > float(scaling["low_freq_factor"]):
                raise ConfigError("llama3 rope scaling needs high_freq_factor > low_freq_factor.")
