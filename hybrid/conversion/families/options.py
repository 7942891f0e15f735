"""Options several families share, read from an HF config and written back: rope (theta, llama3/linear/YaRN
scaling), sliding windows and transformers' `layer_types`, and the flags only some families export."""

from __future__ import annotations

from hybrid.conversion.families.adapter import refuse
from hybrid.model.config import ModelConfig

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types (Gemma 3, GPT-OSS)


def extras(c: ModelConfig) -> list[str]:
    """The options only some Llama-family members have, as flags (for messages)."""
    named = {"--add-qkv-bias": c.add_qkv_bias, "--qk-layernorm": c.qk_layernorm,
             "--qk-norm-across-heads": c.qk_norm_across_heads,
             "--llama-4-scaling-beta": c.llama_4_scaling_beta is not None,
             "--experimental-attention-variant dsa": c.dsa_indexer_topk is not None, "--softmax-type learnable":
             c.attention_sinks, "--quick-geglu": c.quick_geglu, "--multi-latent-attention": c.multi_latent_attention,
             "--mtp-num-layers": bool(c.mtp_num_layers), "--num-experts": bool(c.num_experts),
             "--window-size": c.sliding_window is not None, "--apply-layernorm-1p": c.apply_layernorm_1p,
             "--geglu": c.geglu, "--scale-embeddings": c.scale_embeddings, **gemma3_options(c), **gemma4_options(c),
             "--experimental-attention-variant gated_delta_net": c.linear_attention_freq is not None,
             "--attention-output-gate": c.attention_output_gate}
    return [flag for flag, on in named.items() if on]


def gemma3_options(c: ModelConfig) -> dict:
    """Gemma 3's options, as flags: only its adapter exports them."""
    return {"--sandwich-norms": c.sandwich_norms, "--window-attn-skip-freq": c.window_attn_skip_freq is not None,
            "--local-rotary-base": c.local_rotary_base is not None, "--softmax-scale": c.softmax_scale is not None}


def gemma4_options(c: ModelConfig) -> dict:
    """Gemma 4's own options, as flags: only its adapter exports them."""
    return {"--global-kv-channels": c.global_kv_channels is not None,
            "--global-num-query-groups": c.global_num_query_groups is not None,
            "--attention-k-eq-v": c.attention_k_eq_v, "--v-norm": c.v_norm,
            "--rotary-proportional-percent": (c.rope_scaling or {}).get("rope_type") == "proportional",
            "--final-logit-softcapping": c.final_logit_softcapping is not None,
            "--layer-scalars": c.layer_scalars is not None, "--per-layer-input-size": bool(c.per_layer_input_size),
            "--num-kv-shared-layers": bool(c.kv_shared_layers), "--double-wide-shared-mlp": c.double_wide_shared_mlp,
            "--moe-gemma4-block": c.moe_gemma4_block}


def rope_of(hf, params: dict | None = None, partial: bool = False) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling or None) from transformers 5's rope_parameters (or 4.x's rope_theta /
    rope_scaling), or from `params` (one layer type's, Gemma 3); scaling types other than llama3 and linear
    are refused by name, and a `partial_rotary_factor` unless the family rotates part of each head (`partial`)."""
    if params is None:
        params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    params = dict(params)
    params.pop("partial_rotary_factor" if partial else "", None)
    theta = params.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind not in ("llama3", "linear", "yarn"):
        refuse(type(hf).__name__, "rope_scaling.rope_type", kind, "only default, llama3, linear and yarn RoPE are "
               "implemented")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        refuse(type(hf).__name__, "partial_rotary_factor", params["partial_rotary_factor"], "RoPE covers whole heads")
    if kind == "yarn":
        return float(theta), yarn_of(hf, params)
    keys = ("factor",) + (("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                          if kind == "llama3" else ())
    return float(theta), {"rope_type": kind, **{k: params[k] for k in keys if k in params}}


def partial_rotary_percent(hf) -> float:
    """The share of each head rope rotates (`partial_rotary_factor` in rope_parameters or on the config; 1 without):
    --rotary-percent."""
    params = getattr(hf, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)) or 1.0)


def yarn_of(hf, params: dict) -> dict:
    """transformers' YaRN fields with its defaults written out (factor: the context's growth; betas 32 and 1;
    truncate True is left out), so that equal settings give equal configs (architecture.yarn_scaling's form)."""
    factor = params.get("factor") or hf.max_position_embeddings / params["original_max_position_embeddings"]
    scaling = {"rope_type": "yarn", "factor": float(factor),
               "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
               "beta_fast": float(params.get("beta_fast") or 32.0), "beta_slow": float(params.get("beta_slow") or 1.0)}
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if params.get(key) is not None:
            scaling[key] = float(params[key])
    if params.get("truncate", True) is False:
        scaling["truncate"] = False
    return scaling


def rope_parameters(c: ModelConfig) -> dict:
    """transformers 5's rope_parameters of the model's (one) rope."""
    return {"rope_type": "default", "rope_theta": c.rotary_base} if not c.rope_scaling else \
        dict(c.rope_scaling, rope_theta=c.rotary_base)


def sliding_layers(hf, family: str) -> list:
    """1 per windowed layer of transformers' `layer_types` (other kinds refused by name)."""
    unknown = set(hf.layer_types) - {SLIDING, FULL}
    if unknown:
        refuse(family, "layer_types", sorted(unknown), "only sliding_attention and full_attention layers exist")
    return [int(kind == SLIDING) for kind in hf.layer_types]


def layer_types(c: ModelConfig) -> list:
    """transformers' `layer_types` of the model's windowed and full layers (ModelConfig.layer_window)."""
    return [SLIDING if c.layer_window(i) is not None else FULL for i in range(c.num_layers)]


def window_pattern(sliding: list):
    """Which layers attend through the window (1 per layer), as Megatron-LM's --window-attn-skip-freq writes it:
    N where every N-th layer (1-based) is the full one, else the list; None when every layer is windowed."""
    if all(sliding):
        return None
    for n in range(2, len(sliding) + 1):
        if sliding == [int((i + 1) % n != 0) for i in range(len(sliding))]:
            return n
    return sliding


def window_of(hf, family: str):
    """The sliding window every layer uses, or None; alternating local/global layers are refused."""
    kinds = getattr(hf, "layer_types", None)
    window = getattr(hf, "sliding_window", None)
    if kinds and SLIDING in kinds:
        if set(kinds) != {SLIDING}:
            refuse(family, "layer_types", "mixed sliding/full", "alternating local and global attention layers are "
                   "not implemented (every layer uses the same attention)")
        return int(window)
    if kinds and family.startswith(("Qwen2", "Qwen3")):
        return None  # sliding_window is set but no layer uses it (use_sliding_window false)
    return int(window) if window else None
