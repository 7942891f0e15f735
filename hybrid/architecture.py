"""The model's architecture from Megatron-LM's flags (or a --load-hf model's config) with this run's
settings (recompute, sequence parallelism, MoE training options), checked once (ModelConfig.validate)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from hybrid.conversion.families import infer_family
from hybrid.errors import ConfigError
from hybrid.model.config import (GPT_OSS_YARN, LLAMA3_ROPE_DEFAULTS, MLA_YARN_ORIGINAL_CONTEXT, ModelConfig,
                                 yarn_scaling)
from hybrid.parallel.fp8 import DEFAULT_FP8_RECIPE, check_settings


def _yarn(args) -> bool:
    """YaRN rope: --position-embedding-type yarn, or MLA's rope (yarn unless --rope-type rope, as megatron-core)."""
    if args.position_embedding_type == "yarn":
        return True
    return args.multi_latent_attention and (args.rope_type or "yarn") == "yarn"


def _rope_scaling(args) -> Optional[dict]:
    if getattr(args, "enable_gpt_oss", False):  # (what Megatron-LM's model builder sets, whatever the flags say)
        return yarn_scaling(*GPT_OSS_YARN)
    if _yarn(args):
        if args.use_rope_scaling or args.rotary_seq_len_interpolation_factor:
            raise ConfigError("YaRN (--position-embedding-type yarn, or --multi-latent-attention's default rope) and "
                              "--use-rope-scaling / --rotary-seq-len-interpolation-factor are two rope scalings; give "
                              "one (--rope-type rope: MLA without YaRN).")
        return yarn_scaling(args.rotary_scaling_factor, args.yarn_original_max_position_embeddings or
                            MLA_YARN_ORIGINAL_CONTEXT,
                            args.yarn_beta_fast, args.yarn_beta_slow, args.mscale, args.mscale_all_dim,
                            args.yarn_correction_range_round_to_int)
    if args.rotary_proportional_percent is not None:
        if args.use_rope_scaling or args.rotary_seq_len_interpolation_factor:
            raise ConfigError("--rotary-proportional-percent and --use-rope-scaling / "
                              "--rotary-seq-len-interpolation-factor are two rope scalings; give one.")
        return {"rope_type": "proportional", "partial_rotary_factor": args.rotary_proportional_percent,
                "factor": 1.0}
    if args.use_rope_scaling and args.rotary_seq_len_interpolation_factor:
        raise ConfigError("--use-rope-scaling (llama3) and --rotary-seq-len-interpolation-factor (linear) are two "
                          "rope scalings; give one.")
    if args.use_rope_scaling:
        return {"rope_type": "llama3", "factor": args.rope_scaling_factor, **LLAMA3_ROPE_DEFAULTS}
    if args.rotary_seq_len_interpolation_factor:
        return {"rope_type": "linear", "factor": float(args.rotary_seq_len_interpolation_factor)}
    return None


def _sliding_window(args) -> Optional[int]:
    """Megatron's --window-size (left, right) -> the window transformers names (left + 1 keys)."""
    if args.window_size is None:
        return None
    left, right = args.window_size
    if right != 0:
        raise ConfigError(f"--window-size {left},{right}: a causal model attends no later tokens; use {left},0.")
    if left < -1:
        raise ConfigError(f"--window-size {left},0: LEFT must be >= 0 (-1: no window).")
    return None if left == -1 else left + 1


def architecture_from_flags(args, vocab_size: int) -> ModelConfig:
    """The model's shape and options from the flags (everything --load-hf takes from its config)."""
    if args.group_query_attention and not args.num_query_groups:
        raise ConfigError("--group-query-attention needs --num-query-groups N.")
    kv_channels = args.kv_channels
    if kv_channels and kv_channels * args.num_attention_heads == args.hidden_size:
        kv_channels = None  # the default head dimension (so the config equals an imported model's)
    return ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size, max_position_embeddings=args.max_position_embeddings or args.seq_length,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups if args.group_query_attention or args.num_query_groups else None,
        position_embedding_type="rope" if args.use_rotary_position_embeddings or args.position_embedding_type == "yarn"
        or args.enable_gpt_oss else args.position_embedding_type,
        rotary_base=args.rotary_base, rotary_percent=args.rotary_percent, normalization=args.normalization,
        norm_epsilon=args.norm_epsilon,
        swiglu=args.swiglu, add_bias_linear=not args.disable_bias_linear,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, kv_channels=kv_channels, add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm, qk_norm_across_heads=args.qk_norm_across_heads,
        llama_4_scaling_beta=args.llama_4_scaling_beta, llama_4_scaling_length=args.llama_4_scaling_length,
        sliding_window=_sliding_window(args), rope_scaling=_rope_scaling(args),
        apply_layernorm_1p=args.apply_layernorm_1p, geglu=args.geglu, scale_embeddings=args.scale_embeddings,
        window_attn_skip_freq=args.window_attn_skip_freq, local_rotary_base=args.local_rotary_base,
        softmax_scale=args.softmax_scale, sandwich_norms=args.sandwich_norms,
        global_kv_channels=args.global_kv_channels, global_num_query_groups=args.global_num_query_groups,
        attention_k_eq_v=args.attention_k_eq_v, v_norm=args.v_norm, rmsnorm_fp32_scale=args.rmsnorm_fp32_scale,
        final_logit_softcapping=args.final_logit_softcapping, layer_scalars=args.layer_scalars,
        per_layer_input_size=args.per_layer_input_size, kv_shared_layers=args.num_kv_shared_layers,
        double_wide_shared_mlp=args.double_wide_shared_mlp, moe_gemma4_block=args.moe_gemma4_block,
        attention_sinks=args.softmax_type == "learnable", quick_geglu=args.quick_geglu,
        glu_linear_offset=args.glu_linear_offset, activation_func_clamp_value=args.activation_func_clamp_value,
        attention_output_gate=args.attention_output_gate, **_mla_fields(args), **_linear_attention_fields(args),
        **_moe_fields(args))


LINEAR_ATTENTION_FLAGS = ("linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
                          "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")


def _linear_attention_fields(args) -> dict:
    """Gated DeltaNet's shape: --experimental-attention-variant gated_delta_net with --linear-attention-freq."""
    if args.experimental_attention_variant != "gated_delta_net":
        if args.linear_attention_freq is not None:
            raise ConfigError("--linear-attention-freq places Gated DeltaNet layers: add "
                              "--experimental-attention-variant gated_delta_net.")
        return {}
    if args.linear_attention_freq is None:
        raise ConfigError("--experimental-attention-variant gated_delta_net needs --linear-attention-freq (N: every "
                          "N-th layer attends fully; or a 0/1 list per layer), as megatron-core.")
    return {name: getattr(args, name) for name in LINEAR_ATTENTION_FLAGS}


MLA_FLAGS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
             "v_head_dim")  # the architecture of --multi-latent-attention
MTP_FLAGS = ("mtp_num_layers", "mtp_loss_scaling_factor")  # multi-token prediction (flags, also with --load-hf)


def _mtp_fields(args) -> dict:
    """--mtp-num-layers where given (0: none, also for a checkpoint that stores some), and its loss weight."""
    fields = {"mtp_loss_scaling_factor": args.mtp_loss_scaling_factor}
    if args.mtp_num_layers is not None:
        fields["mtp_num_layers"] = args.mtp_num_layers or None
    return fields


DSA_FLAGS = ("experimental_attention_variant", "dsa_indexer_topk", "dsa_indexer_n_heads", "dsa_indexer_head_dim",
             "dsa_indexer_topk_freq", "dsa_indexer_skip_topk_offset", "mla_latent_norm_epsilon")
DSA_TRAINING_FLAGS = ("dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss")  # how the indexer trains (any load)


def dsa_index_share(layers: int, freq: int, offset: int):
    """GLM-5's index sharing as a 0/1 list per layer (1: reuses the choice of the layer before it that runs its
    indexer): 1-based layer L runs its indexer when max(L - offset, 0) % freq == 0 (megatron-core's
    is_dsa_skip_topk_layer, transformers' GlmMoeDsaConfig indexer_types); None when every layer runs its own."""
    share = [int(max(layer - offset, 0) % freq != 0) for layer in range(1, layers + 1)]
    return share if any(share) else None


def _mla_fields(args) -> dict:
    fields = {name: getattr(args, name) for name in MLA_FLAGS} if args.multi_latent_attention else {}
    if args.multi_latent_attention and args.mla_latent_norm_epsilon is not None:
        fields["mla_latent_norm_epsilon"] = args.mla_latent_norm_epsilon
    if args.experimental_attention_variant == "dsa":
        fields.update({name: getattr(args, name) for name in DSA_FLAGS[1:4]})
        fields["dsa_index_share"] = dsa_index_share(args.num_layers, max(args.dsa_indexer_topk_freq, 1),
                                                    args.dsa_indexer_skip_topk_offset)
    return fields


MOE_FLAGS = ("num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function",
             "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups",
             "moe_router_group_topk",
             "moe_router_enable_expert_bias", "moe_router_dtype", "moe_shared_expert_intermediate_size",
             "moe_shared_expert_gate")  # the architecture (an imported model's config sets them)
MOE_TRAINING_FLAGS = ("moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                      "moe_router_bias_update_rate", "moe_expert_capacity_factor",
                      "moe_token_drop_policy", "moe_pad_expert_input_to_capacity",
                      "moe_grouped_gemm", "moe_routing_replay")  # how it trains (flags, also with --load-hf)


def _moe_fields(args) -> dict:
    return {name: getattr(args, name) for name in MOE_FLAGS} if args.num_experts else {}


def fp8_recipe(args) -> Optional[str]:
    """The FP8 recipe a run trains with: --fp8-recipe, Megatron-LM's default (delayed) when --fp8-format comes
    alone; None without --fp8-format (check_settings refuses a recipe given without it)."""
    return (args.fp8_recipe or DEFAULT_FP8_RECIPE) if args.fp8_format else None


def fp8_fields(args) -> dict:
    """The ModelConfig's FP8 fields from --fp8-* (a training setting, with any architecture)."""
    check_settings(args.fp8_recipe, args.fp8_format, args.fp8_amax_history_len, args.fp8_amax_compute_algo)
    ends = args.first_last_layers_bf16
    return dict(fp8_recipe=fp8_recipe(args), fp8_format=args.fp8_format or "hybrid",
                fp8_amax_history_len=args.fp8_amax_history_len, fp8_amax_compute_algo=args.fp8_amax_compute_algo,
                fp8_margin=args.fp8_margin,
                fp8_layers_start_high_precision=args.num_layers_at_start_in_bf16 if ends else 0,
                fp8_layers_end_high_precision=args.num_layers_at_end_in_bf16 if ends else 0)


def lora_fields(args) -> dict:
    """The LoRA flags as ModelConfig fields (PEFT's defaults where a flag is not given)."""
    rank = getattr(args, "lora_rank", None)
    if not rank:
        for flag in ("lora_alpha", "lora_dropout", "lora_target_modules", "lora_use_rslora", "lora_modules_to_save"):
            if getattr(args, flag, None) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')} sets an option of the adapters; add --lora-rank R "
                                  f"(or --load-lora DIR).")
        return {}
    fields = {"lora_rank": rank, "lora_alpha": 8.0, "lora_dropout": 0.0, "lora_target_modules": (),
              "lora_use_rslora": False, "lora_modules_to_save": ()}
    fields.update({flag: value for flag in fields if (value := getattr(args, flag, None)) is not None})
    if not 0.0 <= fields["lora_dropout"] < 1.0:
        raise ConfigError(f"--lora-dropout must be in [0, 1), got {fields['lora_dropout']}.")
    return fields


def model_config(args, vocab_size: int, tp: int, base: Optional[ModelConfig] = None) -> ModelConfig:
    """The architecture (from the flags, or `base`: a --load-hf model's) with this run's settings."""
    granularity = args.recompute_granularity or ("full" if args.checkpoint_activations else None)
    num_layers = args.recompute_num_layers or args.checkpoint_num_layers or 1
    if base is not None and vocab_size > base.vocab_size:
        raise ConfigError(f"--load-hf {args.load_hf}: the tokenizer has {vocab_size} tokens but the model's "
                          f"embedding only {base.vocab_size}; use the model's own tokenizer (drop the tokenizer "
                          f"flags).")
    architecture = base or architecture_from_flags(args, vocab_size)
    if (args.dsa_indexer_loss_coeff or args.dsa_indexer_use_sparse_loss) and architecture.dsa_indexer_topk is None:
        raise ConfigError("--dsa-indexer-loss-coeff / --dsa-indexer-use-sparse-loss train DeepSeek sparse attention's "
                          "indexer: the model has none (--experimental-attention-variant dsa, or a DeepSeek-V3.2 / "
                          "GLM-5 --load-hf).")
    if args.moe_routing_replay and not architecture.num_experts:
        raise ConfigError("--moe-routing-replay replays the experts the generator chose: the model has no MoE layers "
                          "(--num-experts); drop the flag.")
    if architecture.family is None:  # recorded in the checkpoints, so export writes this family
        architecture = dataclasses.replace(architecture, family=infer_family(architecture))
    config = dataclasses.replace(
        architecture, **fp8_fields(args), make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling, use_flash_attn=args.use_flash_attn,
        recompute_granularity=granularity, recompute_method=args.recompute_method,
        recompute_num_layers=num_layers, sequence_parallel=args.sequence_parallel and tp > 1, seed=args.seed,
        async_tensor_model_parallel_allreduce=not args.no_async_tensor_model_parallel_allreduce,
        **_mtp_fields(args), **lora_fields(args),
        **({name: getattr(args, name) for name in MOE_TRAINING_FLAGS} if architecture.num_experts else {}),
        linear_attention_chunk_size=args.linear_attention_chunk_size,
        **({name: getattr(args, name) for name in DSA_TRAINING_FLAGS}
           if architecture.dsa_indexer_topk is not None else {}))
    config.validate(tp)
    if config.position_embedding_type == "learned_absolute" and args.seq_length > config.max_position_embeddings:
        raise ConfigError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                          f"{config.max_position_embeddings}.")
    if args.sequence_parallel and args.seq_length % tp != 0:
        raise ConfigError(f"--sequence-parallel needs --seq-length {args.seq_length} divisible by "
                          f"--tensor-model-parallel-size {tp}.")
    return config
