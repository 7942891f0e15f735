"""Megatron-LM's stored args (its argparse names) -> hybrid's ModelConfig, or one message naming what hybrid's model
does not compute; the args a converted checkpoint records, and the flags a run may not contradict."""

from __future__ import annotations

import argparse
import math
from typing import Optional

from hybrid.errors import ConfigError
from hybrid.model.config import (GPT_OSS_YARN, LLAMA3_ROPE_DEFAULTS, MLA_YARN_ORIGINAL_CONTEXT, ModelConfig,
                                 yarn_scaling)


def arg(args, name, default=None):
    """A stored arg, or `default` where the run's Megatron-LM did not have it."""
    return getattr(args, name, default)


def config_from_args(args: argparse.Namespace, true_vocab_size: Optional[int] = None, where: str = "") -> ModelConfig:
    """The model Megatron-LM's args describe (its argparse names), or one message naming what hybrid does
    not compute."""
    def refuse(what: str, why: str):
        raise ConfigError(f"{where}: the checkpoint's model has {what}, which hybrid's model does not compute "
                          f"({why}).")
    for name, why in REFUSED_ARGS.items():  # (first: a model hybrid does not build may lack the shape args too)
        value = arg(args, name)
        if value not in (None, False, 0, [], ()) and not _refusal_is_default(name, value):
            refuse(f"--{name.replace('_', '-')} {value}", why)
    missing = [name for name in REQUIRED_ARGS if arg(args, name) is None]
    if missing:
        raise ConfigError(f"{where}: the checkpoint's args lack {', '.join(missing)}, which the model's shape needs "
                          f"(saved with --no-save-args, or edited?); hybrid builds the model from them, as "
                          f"Megatron-LM's converter does.")
    if arg(args, "group_query_attention") and not arg(args, "multi_latent_attention") \
            and arg(args, "num_query_groups") is None:
        raise ConfigError(f"{where}: the checkpoint's args say group_query_attention but hold no num_query_groups, "
                          f"so the key/value heads are unknown; set args.num_query_groups in the checkpoint (the "
                          f"number the run used with --num-query-groups), then load it again.")
    if arg(args, "rotary_interleaved"):
        refuse("--rotary-interleaved", "rotary embeddings rotate halves, as transformers' Llama")
    if arg(args, "squared_relu"):
        refuse("--squared-relu", "the MLP is SwiGLU, GeGLU or tanh-GeLU")
    if arg(args, "heterogeneous_layers_config_path") or arg(args, "heterogeneous_layers_config_encoded_json"):
        refuse("heterogeneous layers", "every layer has the same shape")
    swiglu, quick = bool(arg(args, "swiglu", False)), bool(arg(args, "quick_geglu", False))
    bias = bool(arg(args, "add_bias_linear", True))
    if (not swiglu and not quick and not arg(args, "openai_gelu")
            and not (bias and arg(args, "bias_gelu_fusion", True))):
        refuse("the exact (erf) GeLU", "the GeLU MLP is the tanh approximation, which Megatron computes with "
               "--openai-gelu or with its fused bias + GeLU (--add-bias-linear, bias_gelu_fusion)")
    heads = int(args.num_attention_heads)
    kv_channels = arg(args, "kv_channels")
    if kv_channels and int(kv_channels) * heads == int(args.hidden_size):
        kv_channels = None
    mla = bool(arg(args, "multi_latent_attention"))
    rope = arg(args, "position_embedding_type", "learned_absolute") in ("rope", "yarn") or \
        bool(arg(args, "use_rotary_position_embeddings")) or mla or bool(arg(args, "enable_gpt_oss"))
    if not rope and (arg(args, "position_embedding_type") == "none" or arg(args, "add_position_embedding") is False):
        refuse("no position embedding (--no-position-embedding without rotary embeddings)",
               "positions come from a learned table or rotary embeddings")
    if mla and (arg(args, "rope_type") or "yarn") != "yarn" and (arg(args, "use_rope_scaling") or
                                                                  arg(args, "rotary_seq_len_interpolation_factor")):
        refuse("--use-rope-scaling / --rotary-seq-len-interpolation-factor with MLA's --rope-type rope",
               "megatron-core's MLA builds its rope without them, so the checkpoint's model never applied them")
    rope_scaling = _megatron_yarn(args, mla)
    if rope_scaling is not None and (arg(args, "use_rope_scaling")
                                     or arg(args, "rotary_seq_len_interpolation_factor")):
        refuse("YaRN with --use-rope-scaling / --rotary-seq-len-interpolation-factor", "one rope scaling per model")
    if rope_scaling is not None:
        pass
    elif arg(args, "use_rope_scaling"):
        rope_scaling = {"rope_type": "llama3", "factor": float(arg(args, "rope_scaling_factor", 8.0)),
                        **LLAMA3_ROPE_DEFAULTS}
    elif arg(args, "rotary_seq_len_interpolation_factor"):
        rope_scaling = {"rope_type": "linear", "factor": float(args.rotary_seq_len_interpolation_factor)}
    rows = int(arg(args, "padded_vocab_size") or 0)
    if not rows:
        raise ConfigError(f"{where}: the checkpoint's args have no padded_vocab_size (the embedding's rows).")
    if true_vocab_size is not None and not 0 < true_vocab_size <= rows:
        raise ConfigError(f"--true-vocab-size {true_vocab_size}: must be between 1 and the checkpoint's "
                          f"{rows} embedding rows.")
    window = arg(args, "window_size")
    skip_freq = arg(args, "window_attn_skip_freq", None)  # Megatron's: every N-th layer full, or 1 = windowed
    dtype = "bfloat16" if arg(args, "bf16") else "float16" if arg(args, "fp16") else None
    return ModelConfig(
        num_layers=int(args.num_layers), hidden_size=int(args.hidden_size), num_attention_heads=heads,
        vocab_size=true_vocab_size or rows,
        max_position_embeddings=int(arg(args, "max_position_embeddings") or arg(args, "seq_length")),
        ffn_hidden_size=arg(args, "ffn_hidden_size"),
        num_query_groups=int(args.num_query_groups) if arg(args, "group_query_attention") and not mla else None,
        position_embedding_type="rope" if rope else "learned_absolute",
        rotary_base=float(arg(args, "rotary_base", 10000)),
        rotary_percent=float(arg(args, "rotary_percent", 1.0) or 1.0),
        normalization=arg(args, "normalization", "LayerNorm"),
        norm_epsilon=float(arg(args, "norm_epsilon", None) or arg(args, "layernorm_epsilon", None) or 1e-5),
        swiglu=swiglu, add_bias_linear=bias, quick_geglu=quick,
        glu_linear_offset=float(arg(args, "glu_linear_offset", 0.0) or 0.0),
        activation_func_clamp_value=arg(args, "activation_func_clamp_value"),
        attention_sinks=arg(args, "softmax_type", "vanilla") == "learnable",
        untie_embeddings_and_output_weights=bool(arg(args, "untie_embeddings_and_output_weights", False)),
        hidden_dropout=float(arg(args, "hidden_dropout", 0.1)),
        attention_dropout=0.0 if arg(args, "softmax_type") == "learnable" else  # (sinks run without it here)
        float(arg(args, "attention_dropout", 0.1)),
        init_method_std=float(arg(args, "init_method_std", 0.02)), kv_channels=None if mla else kv_channels,
        add_qkv_bias=bool(arg(args, "add_qkv_bias", False)), qk_layernorm=bool(arg(args, "qk_layernorm", False)),
        sliding_window=None if not window or window[0] == -1 else int(window[0]) + 1, rope_scaling=rope_scaling,
        window_attn_skip_freq=skip_freq if window and window[0] != -1 else None,
        apply_layernorm_1p=bool(arg(args, "apply_layernorm_1p", False) or arg(args, "layernorm_zero_centered_gamma")),
        make_vocab_size_divisible_by=int(arg(args, "make_vocab_size_divisible_by", 128) or 128), hf_dtype=dtype,
        mtp_num_layers=int(arg(args, "mtp_num_layers", 0) or 0) or None,
        mtp_loss_scaling_factor=float(arg(args, "mtp_loss_scaling_factor", None) if
                                      arg(args, "mtp_loss_scaling_factor", None) is not None else 0.1),
        **_mla_fields(args, mla), **_moe_fields(args, refuse))


def _megatron_yarn(args: argparse.Namespace, mla: bool) -> Optional[dict]:
    """YaRN as megatron-core computes it: MLA's rope (--rope-type, default yarn) from its MLATransformerConfig
    (--rotary-scaling-factor, --mscale, --mscale-all-dim; its original context and betas are the config's
    defaults, which no argument sets), or --position-embedding-type yarn from the --yarn-* arguments."""
    if arg(args, "enable_gpt_oss"):  # Megatron-LM's post-training switch: GPT-OSS's YaRN, set on the model's config
        return yarn_scaling(*GPT_OSS_YARN)
    if mla and (arg(args, "rope_type") or "yarn") == "yarn":
        return yarn_scaling(float(arg(args, "rotary_scaling_factor", 1.0) or 1.0), MLA_YARN_ORIGINAL_CONTEXT,
                            mscale=float(arg(args, "mscale", 1.0)),
                            mscale_all_dim=float(arg(args, "mscale_all_dim", 0.0)))
    if arg(args, "position_embedding_type") != "yarn":
        return None
    round_to_int = arg(args, "yarn_correction_range_round_to_int")
    return yarn_scaling(float(arg(args, "rotary_scaling_factor", 1.0) or 1.0),
                        int(arg(args, "yarn_original_max_position_embeddings") or MLA_YARN_ORIGINAL_CONTEXT),
                        float(arg(args, "yarn_beta_fast") or 32.0), float(arg(args, "yarn_beta_slow") or 1.0),
                        float(arg(args, "mscale", 1.0)), float(arg(args, "mscale_all_dim", 0.0)),
                        True if round_to_int is None else bool(round_to_int))


def megatron_rope_args(config: ModelConfig) -> dict:
    """Megatron-LM's args for the model's YaRN rope (the inverse of _megatron_yarn: MLA's --rope-type yarn, else
    --position-embedding-type yarn with the --yarn-* arguments), and MLA's --rope-type; {} for other ropes. An error
    where Megatron-LM's arguments cannot say it (MLA's YaRN has a fixed original context and betas)."""
    scaling = config.rope_scaling or {}
    mla = config.multi_latent_attention
    if mla and scaling and scaling.get("rope_type") != "yarn":
        raise ConfigError(f"the model's MLA rope has {scaling.get('rope_type')} scaling, which megatron-core's MLA "
                          f"does not compute (its rope is plain or YaRN, --rope-type); export with --saver hf instead.")
    if scaling.get("rope_type") != "yarn":
        return {"rope_type": "rope"} if mla else {}
    factor = float(scaling["factor"])
    if "mscale_all_dim" in scaling:
        mscale, all_dim = float(scaling["mscale"]), float(scaling["mscale_all_dim"])
    elif "attention_factor" in scaling and factor > 1:  # (yarn_mscale inverted)
        mscale, all_dim = (float(scaling["attention_factor"]) - 1.0) / (0.1 * math.log(factor)), 0.0
    else:
        mscale, all_dim = 1.0, 0.0
    args = dict(rotary_scaling_factor=factor, mscale=mscale, mscale_all_dim=all_dim)
    if mla:
        args["rope_type"] = "yarn"
    else:
        args.update(position_embedding_type="yarn",
                    yarn_original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                    yarn_beta_fast=float(scaling["beta_fast"]), yarn_beta_slow=float(scaling["beta_slow"]),
                    yarn_correction_range_round_to_int=bool(scaling.get("truncate", True)))
    back = _megatron_yarn(argparse.Namespace(**args), mla)
    if set(back) != set(scaling) or any(not math.isclose(float(back[k]), float(scaling[k]), rel_tol=1e-12)
                                        if isinstance(back[k], (int, float)) else back[k] != scaling[k] for k in back):
        raise ConfigError(f"the model's YaRN rope {scaling} has no Megatron-LM arguments that say it (they read back "
                          f"as {back}; " + (f"MLA's YaRN is megatron-core's MLATransformerConfig's, with original "
                                            f"context {MLA_YARN_ORIGINAL_CONTEXT} and betas 32 / 1" if mla else
                                            "--yarn-* cover factor, original context, betas, mscale") +
                          "); export with --saver hf instead.")
    return args


def _mla_fields(args: argparse.Namespace, mla: bool) -> dict:
    """Multi-latent attention's sizes (Megatron-LM's names, as hybrid's flags)."""
    if not mla:
        return {}
    return dict(multi_latent_attention=True, q_lora_rank=arg(args, "q_lora_rank"),
                kv_lora_rank=int(arg(args, "kv_lora_rank", 32)), qk_head_dim=int(arg(args, "qk_head_dim", 128)),
                qk_pos_emb_head_dim=int(arg(args, "qk_pos_emb_head_dim", 64)),
                v_head_dim=int(arg(args, "v_head_dim", 128)))


# the args without which no model can be built (one message, not an AttributeError)
REQUIRED_ARGS = ("num_layers", "hidden_size", "num_attention_heads")
# Megatron-LM's args that change the model's mathematics in ways hybrid's model does not compute, each refused by
# name with why (a value that is the argument's "off" value passes); the args it maps are read by
# config_from_args and _moe_fields below, and tests/test_megatron_checkpoints.py gives every one of them a value
# other than its default
REFUSED_ARGS = {  # (names as megatron-core's TransformerConfig and Megatron-LM's arguments.py spell them)
    "no_rope_freq": "rotary embeddings left out of some layers; hybrid rotates every layer",
    "mtp_hsm": "hidden-state mixing across the multi-token prediction depths",
    "mtp_use_repeated_layer": "one multi-token prediction layer repeated over the depths",
    "mtp_hybrid_override_pattern": "a hybrid (Mamba) multi-token prediction layer",
    "mtp_detach_heads": "multi-token prediction heads detached from the embeddings and output layer",
    "experimental_attention_variant": "an attention other than softmax attention (gated delta net, DSA)",
    "linear_attention_freq": "linear attention layers among the softmax ones",
    "hybrid_override_pattern": "a hybrid (Mamba / attention) layer pattern",
    "softmax_type": "a softmax with an offset of one (off-by-one); learned sinks (learnable) are read",
    "attention_output_gate": "a gate on the attention output",
    "qk_l2_norm": "L2-normalized queries and keys",
    "hybrid_layer_pattern": "a hybrid (Mamba / attention) layer pattern",
    "is_hybrid_model": "a hybrid (Mamba / attention) model",
    "use_fused_weighted_squared_relu": "squared-ReLU experts weighted before the activation",
    "moe_apply_probs_on_input": "router probabilities applied to the experts' input",
    "moe_mlp_glu_interleave_size": "experts whose gate and up rows are interleaved in blocks",
    "moe_shared_expert_glu_interleave_size": "a shared expert whose gate and up rows are interleaved in blocks",
    "moe_expert_rank_capacity_factor": "tokens dropped over a per-rank budget",
    "moe_router_force_biased": "random biases on the router's logits",
    "moe_router_padding_for_quantization": "routing padded for quantized experts",
    "moe_router_quantile_balancing_ema": "quantile-balancing expert biases",
    "apply_residual_connection_post_layernorm": "residuals taken after the layer norm",
    "use_mup": "muP's scaled embeddings, attention and output",
    "enable_mhc_connections": "manifold hyper-connections",
    "mrope_section": "multimodal rotary sections",
    "spec": "a layer spec of the run's own",
}
_OFF_VALUES = {"softmax_type": ("vanilla", "learnable"), "experimental_attention_variant": ("none",)}

# The rest of Megatron-LM's arguments that could describe the model (those of its parser groups "network size",
# "transformer configuration", "mla", "moe", "experimental", "heterogeneous architecture" and
# "experimental_attention_variant"), each with why it leaves a checkpoint's model as config_from_args reads it:
# how the model is computed or run (kernels, parallelism, memory, precision), training alone, another model kind,
# or a setting that only acts with an argument refused above. With the names config_from_args reads and
# REFUSED_ARGS this covers every such argument of Megatron-LM's parser (tests/test_megatron_args_real.py, against
# the table its own parser gives: tests/fixtures/megatron_lm_args/arguments.json).
NOT_MODEL_ARGS = {
    "parallelism and communication (the same model at any layout)": (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
        "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
        "hierarchical_context_parallel_sizes", "hybrid_context_parallel", "max_seqlen_per_dp_cp_rank",
        "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
        "microbatch_group_size_per_vp_stage", "overlap_p2p_comm_warmup_flush", "pipeline_model_parallel_comm_backend",
        "use_ring_exchange_p2p", "symmetric_ar_type", "tp_comm_bootstrap_backend", "tp_comm_bulk_dgrad",
        "tp_comm_bulk_wgrad", "tp_comm_overlap", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
        "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_split_rs", "tensor_parallel_num_weight_shards",
        "expert_tensor_parallel_num_weight_shards", "gtp_remat_opt_in_modules", "high_priority_a2a_comm_stream",
        "ep_overlap_early_attn_memory_release", "overlap_moe_expert_parallel_comm",
        "overlap_dispatch_backward_with_experts_wgrad", "moe_token_dispatcher_type", "moe_enable_deepep",
        "moe_deepep_num_sms", "moe_flex_dispatcher_backend", "moe_flex_dispatcher_num_sms",
        "moe_hybridep_num_blocks_permute", "moe_hybridep_num_blocks_unpermute", "moe_hybridep_num_sms",
        "moe_hybridep_num_sms_preprocessing", "moe_hybridep_pad_uneven_dispatch_inputs", "moe_ncclep_zero_copy",
        "moe_shared_expert_overlap", "megatron_fsdp_enable_fine_grained_param_gather", "megatron_fsdp_grad_comm_dtype",
        "megatron_fsdp_main_grads_dtype", "megatron_fsdp_main_params_dtype", "megatron_fsdp_max_pool_double_buffer",
        "fsdp_db_use_persist_buf_on_alloc_fail"),
    "kernels and fusions computing the same mathematics": (
        "attention_backend", "flash_attention_version", "transformer_impl", "use_te_activation_func",
        "use_transformer_engine_op_fuser", "use_kitchen_attention", "kitchen_attention_backend",
        "cross_entropy_fusion_impl", "cross_entropy_loss_fusion", "fused_residual_rmsnorm", "moe_permute_fusion",
        "moe_permute_fusion_into_hybridep", "moe_router_fusion", "moe_use_grouped_tensor", "moe_single_grouped_bias",
        "moe_single_grouped_weight", "use_grouped_gemm_for_dense_mlp", "use_grouped_gemm_for_shared_expert",
        "mlp_chunks_for_training", "mlp_chunks_for_prefill", "batch_invariant_backend", "batch_invariant_mode",
        "deterministic_mode", "mla_down_proj_fusion", "use_mamba_mem_eff_path", "gdp_cutedsl_kernel",
        "dsa_kernel_backend", "apply_query_key_layer_scaling"),
    "memory: recomputation, offloading, initialization placement": (
        "recompute_granularity", "recompute_method", "recompute_modules", "recompute_num_layers",
        "distribute_saved_activations", "moe_layer_recompute", "cpu_offloading_num_layers",
        "cpu_offloading_retain_pinned_cpu_buffers", "activation_offload_fraction", "fine_grained_activation_offloading",
        "fine_grained_offloading_max_inflight_offloads", "offload_modules", "min_offloaded_tensor_size",
        "delta_offload_bytes_across_pp_ranks", "delay_offload_until_cuda_graph", "moe_paged_stash",
        "moe_paged_stash_buffer_size_factor_cpu", "moe_paged_stash_buffer_size_factor_cuda",
        "moe_paged_stash_page_size", "defer_embedding_wgrad_compute", "delay_wgrad_compute", "wgrad_deferral_limit",
        "clone_scatter_output_in_embedding", "init_model_with_meta_device", "use_cpu_initialization",
        "perform_initialization", "gdp_num_chunk_states_to_recompute", "mhc_recompute_layer_num"),
    "CUDA graphs and inference serving": (
        "cuda_graph_impl", "cuda_graph_warmup_steps", "enable_cuda_graph", "external_cuda_graph",
        "inference_cuda_graph_scope", "inference_disable_triton_nvls_kernels", "inference_fuse_tp_communication",
        "inference_grouped_gemm_backend", "inference_moe_disable_fused_quant_kernels",
        "inference_moe_token_dispatcher_type", "flash_decode", "nccl_all_reduce_for_prefill",
        "moe_pad_experts_for_cuda_graph_inference", "cache_mla_latents"),
    "precision: the run's own (hybrid's --bf16 / --fp16 / --fp8-format); the checkpoint's weights are the same": (
        "fp8", "fp8_recipe", "fp8_margin", "fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo",
        "fp8_wgrad", "fp8_output_proj", "fp8_quantizer_factory", "fp4", "fp4_recipe", "fp4_quantizer_factory",
        "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
        "disable_bf16_reduced_precision_matmul", "fp32_residual_connection",
        "moe_combine_bwd_dtype", "moe_dispatch_fwd_dtype", "main_grads_dtype", "main_params_dtype", "exp_avg_dtype",
        "exp_avg_sq_dtype", "use_precision_aware_optimizer"),
    "training alone (the loss's reduction, initialization, optimizer-side clipping, logging, upcycling)": (
        "calculate_per_token_loss", "embedding_init_method_std", "qk_clip", "qk_clip_alpha", "qk_clip_threshold",
        "moe_enable_routing_replay", "moe_per_layer_logging", "config_logger_dir", "moe_use_upcycling",
        "moe_upcycling_granularity", "enable_experimental", "yaml_cfg"),
    "BERT and T5 models (hybrid reads GPT models)": (
        "bert_binary_head", "encoder_num_layers", "decoder_num_layers", "relative_attention_max_distance",
        "relative_attention_num_buckets", "onnx_safe"),
    "where the multi-token prediction layers run (a pipeline placement)": ("mtp_standalone",),
    "read with --position-embedding-type yarn (_megatron_yarn; megatron-core's MLA takes its config's defaults)": (
        "yarn_beta_fast", "yarn_beta_slow", "yarn_correction_range_round_to_int",
        "yarn_original_max_position_embeddings"),
    "only with --experimental-attention-variant or --linear-attention-freq (refused)": (
        "dsa_indexer_head_dim", "dsa_indexer_k_norm_epsilon", "dsa_indexer_k_norm_fp32", "dsa_indexer_loss_coeff",
        "dsa_indexer_n_heads", "dsa_indexer_rope_interleaved", "dsa_indexer_rotate_activation",
        "dsa_indexer_scoring_relu", "dsa_indexer_skip_topk_offset", "dsa_indexer_topk", "dsa_indexer_topk_freq",
        "dsa_indexer_use_sparse_loss", "gdp_num_householder", "linear_conv_kernel_dim", "linear_key_head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim"),
    "only with a hybrid (Mamba) layer pattern (refused)": (
        "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "mamba_state_dim"),
    "only with --use-mup or --enable-mhc-connections (refused)": (
        "mup_attn_scale_power", "mup_base_head_dim", "mup_base_hidden_size", "mup_embedding_mult", "mup_output_mult",
        "mup_width_mult", "mhc_init_gating_factor", "mhc_num_residual_streams", "mhc_sinkhorn_iterations"),
}


def _refusal_is_default(name: str, value) -> bool:
    """Whether a refused argument holds the value that means "off" (Megatron stores some as strings or 1.0)."""
    return value in _OFF_VALUES.get(name, ())


def _moe_fields(args: argparse.Namespace, refuse) -> dict:
    """The ModelConfig fields of Megatron-LM's MoE args (the same names, as hybrid's flags have them)."""
    experts = arg(args, "num_experts") or arg(args, "num_moe_experts")
    if not experts:
        return {}
    for name, why in (("moe_input_jitter_eps", "input jitter"), ("moe_router_force_load_balancing", "forced routing"),
                      ("moe_latent_size", "latent MoE projections"), ("moe_router_padding_for_fp8", "FP8 padding")):
        if arg(args, name):
            refuse(f"--{name.replace('_', '-')} {arg(args, name)}", f"{why} is not implemented")
    balancing = arg(args, "moe_router_load_balancing_type", "aux_loss")
    coeff = arg(args, "moe_aux_loss_coeff", 0.0)
    # Megatron-LM's parser takes a list of each (nargs="+"): one element is that one loss
    balancing, coeff = (v[0] if isinstance(v, (list, tuple)) and len(v) == 1 else v for v in (balancing, coeff))
    if isinstance(balancing, (list, tuple)) or isinstance(coeff, (list, tuple)):
        refuse(f"--moe-router-load-balancing-type {balancing}", "one balancing loss per router")
    if balancing not in ("aux_loss", "seq_aux_loss", "none"):
        refuse(f"--moe-router-load-balancing-type {balancing}", "aux_loss, seq_aux_loss or none")
    freq = arg(args, "moe_layer_freq", 1)
    return dict(
        num_experts=int(experts), moe_layer_freq=list(freq) if isinstance(freq, (list, tuple)) else int(freq),
        moe_ffn_hidden_size=arg(args, "moe_ffn_hidden_size"), moe_router_topk=int(arg(args, "moe_router_topk", 2)),
        moe_router_score_function=arg(args, "moe_router_score_function", "softmax") or "softmax",
        moe_router_pre_softmax=bool(arg(args, "moe_router_pre_softmax", False)),
        moe_router_topk_scaling_factor=arg(args, "moe_router_topk_scaling_factor"),
        moe_router_num_groups=arg(args, "moe_router_num_groups"),
        moe_router_group_topk=arg(args, "moe_router_group_topk"),
        moe_router_load_balancing_type=balancing, moe_aux_loss_coeff=float(coeff or 0.0),
        moe_z_loss_coeff=arg(args, "moe_z_loss_coeff"),
        moe_router_enable_expert_bias=bool(arg(args, "moe_router_enable_expert_bias", False)),
        moe_router_dtype=arg(args, "moe_router_dtype"),  # (fp64: refused by ModelConfig, one message)
        moe_router_bias_update_rate=float(arg(args, "moe_router_bias_update_rate", 1e-3) or 1e-3),
        moe_shared_expert_intermediate_size=arg(args, "moe_shared_expert_intermediate_size"),
        moe_shared_expert_gate=bool(arg(args, "moe_shared_expert_gate", False)),
        moe_expert_capacity_factor=arg(args, "moe_expert_capacity_factor"),
        moe_token_drop_policy=arg(args, "moe_token_drop_policy", "probs") or "probs",
        moe_pad_expert_input_to_capacity=bool(arg(args, "moe_pad_expert_input_to_capacity", False))
        and arg(args, "moe_expert_capacity_factor") is not None,
        moe_grouped_gemm=bool(arg(args, "moe_grouped_gemm", False)))


def megatron_run_args(args: argparse.Namespace) -> dict:
    """A Megatron-LM run's args as hybrid records a run's flags (the same names; plain values only), so an
    export finds its tokenizer and --use-checkpoint-args its architecture."""
    out = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
    out["disable_bias_linear"] = not bool(getattr(args, "add_bias_linear", True))
    return out


# the architecture flags a run's own flags may not contradict (launch/train.py --load, evaluate.py):
# flag namespace attribute -> the stored args' attribute
ARCHITECTURE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups",
                      "normalization", "swiglu", "untie_embeddings_and_output_weights", "position_embedding_type",
                      "qk_layernorm", "add_qkv_bias", "rotary_base", "rotary_percent", "max_position_embeddings",
                      "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                      "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                      "v_head_dim", "mtp_num_layers")


def contradictions(flags: argparse.Namespace, defaults: dict, args: argparse.Namespace) -> list[str]:
    """The architecture flags given (not left at their defaults) whose values differ from the checkpoint's."""
    out = []
    for name in ARCHITECTURE_FLAGS:
        given, stored = getattr(flags, name, None), getattr(args, name, None)
        if given is None or given == defaults.get(name) or stored is None:
            continue
        if name == "position_embedding_type" and getattr(args, "use_rotary_position_embeddings", False):
            stored = "rope"
        if type(stored)(given) != stored:
            out.append(f"--{name.replace('_', '-')} {given} (the checkpoint: {stored})")
    if getattr(flags, "disable_bias_linear", False) and getattr(args, "add_bias_linear", True):
        out.append("--disable-bias-linear (the checkpoint has biases)")
    return out
