"""The transformer's shape and options, named as Megatron-LM's flags."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


from hybrid.errors import ConfigError

MLP_TYPES = ("dense",)  # the feed-forward blocks hybrid.model.mlp.build_mlp can build
ROPE_SCALING_TYPES = ("llama3", "linear")  # hybrid.model.rotary.scaled_inv_freq
# Llama 3.1's values, which Megatron-LM's --use-rope-scaling hard-codes besides the factor
LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


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
    normalization: str = "LayerNorm"  # --normalization LayerNorm|RMSNorm
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
    seed: int = 1234  # --seed: the full weights depend on it alone, not on the layout
    mlp_type: str = "dense"  # each layer's feed-forward block (hybrid.model.mlp.build_mlp)
    kv_channels: Optional[int] = None  # --kv-channels: the head dimension; None = hidden / heads
    add_qkv_bias: bool = False  # --add-qkv-bias: a bias on Q, K and V only (Qwen2), with or without others
    qk_layernorm: bool = False  # --qk-layernorm: a norm (--normalization) over each head of Q and K (Qwen3)
    sliding_window: Optional[int] = None  # --window-size L,0: each token attends itself and L = window - 1 before
    rope_scaling: Optional[dict] = None  # {"rope_type": "llama3"|"linear", "factor": ..., ...} as transformers
    apply_layernorm_1p: bool = False  # --apply-layernorm-1p: norms scale by (1 + weight), weights start at 0
    geglu: bool = False  # --geglu: gated tanh-GeLU MLP (Gemma) instead of SwiGLU / GeLU
    scale_embeddings: bool = False  # --scale-embeddings: word embeddings x sqrt(hidden), in their dtype (Gemma)
    reset_attention_mask: bool = False  # --reset-attention-mask: a token attends its own document only (packed data)
    reset_position_ids: bool = False  # --reset-position-ids: positions restart at 0 after each EOD token
    eod_token: Optional[int] = None  # the end-of-document id at which those two split sequences (the tokenizer's)
    family: Optional[str] = None  # the HF family (hybrid.conversion.families); None: chosen from the options
    hf_dtype: Optional[str] = None  # the imported HF model's dtype ("bfloat16", ...): export writes it; None: fp32

    def __post_init__(self):
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None:
            if self.gated_linear_unit:  # Megatron-LM's default keeps the parameter count of a 4h GeLU MLP
                self.ffn_hidden_size = int((4 * self.hidden_size * 2 / 3) / 64) * 64 or 4 * self.hidden_size
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def gated_linear_unit(self) -> bool:
        """fc1 computes [gate; up] (SwiGLU or GeGLU)."""
        return self.swiglu or self.geglu

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def splits_documents(self) -> bool:
        """Packed documents are kept apart (attention or positions restart after EOD)."""
        return self.reset_attention_mask or self.reset_position_ids

    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

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
        if self.mlp_type not in MLP_TYPES:
            raise ConfigError(f"feed-forward block {self.mlp_type!r} is not one of {', '.join(MLP_TYPES)}.")
        if self.recompute_method not in ("uniform", "block"):
            raise ConfigError(f"--recompute-method must be uniform or block, got {self.recompute_method!r}.")
        if self.position_embedding_type == "rope" and self.head_dim % 2 != 0:
            raise ConfigError(f"rope needs an even head dimension (--kv-channels, or --hidden-size / "
                              f"--num-attention-heads); got {self.head_dim}.")
        if self.kv_channels is not None and self.kv_channels < 1:
            raise ConfigError(f"--kv-channels must be positive, got {self.kv_channels}.")
        if self.swiglu and self.geglu:
            raise ConfigError("--swiglu and --geglu are two gated MLPs; give one.")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"--window-size: the window must hold at least the token itself (got a window of "
                              f"{self.sliding_window}).")
        self._validate_rope_scaling()
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
        if kind == "llama3":
            missing = [k for k in LLAMA3_ROPE_DEFAULTS if k not in scaling]
            if missing:
                raise ConfigError(f"llama3 rope scaling lacks {', '.join(missing)}.")
            if not float(scaling["high_freq_factor"]) > float(scaling["low_freq_factor"]):
                raise ConfigError("llama3 rope scaling needs high_freq_factor > low_freq_factor.")
