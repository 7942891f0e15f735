"""Gemma 4 (Gemma4ForCausalLM, text only; its dense forms: E2B, E4B, 31B): Gemma 3's layers with plain-weight
RMSNorms, unscaled scores (the Q/K norms set their size), values RMS-normed without a weight, full-attention layers
with their own head size and KV heads whose keys may serve as values, proportional rope on those layers, a constant
per layer on its output, final logit soft-capping; E2B/E4B's per-layer inputs (hybrid.model.per_layer) and last
layers that attend with an earlier layer's keys and values (their MLPs possibly twice as wide)."""

from __future__ import annotations

import dataclasses

import torch

from hybrid.conversion.families.adapter import expect, gated_to_canonical, gated_to_hf, get, refuse, require
from hybrid.conversion.families.gemma3 import Gemma3Adapter
from hybrid.conversion.families.moe import ExpertLayout
from hybrid.conversion.families.options import FULL, SLIDING, layer_types, rope_of, sliding_layers, window_pattern
from hybrid.model.config import ModelConfig
from hybrid.model.naming import EXPERTS
from hybrid.model.qkv import fuse_qkv, split_qkv_flat

_MOE_MAP = {  # an MoE layer's (enable_moe_block: the 26B-A4B) router scales and norms, beside its dense MLP
    "model.layers.{}.router.proj.weight": "layers.{}.mlp.router.weight",
    "model.layers.{}.router.scale": "layers.{}.mlp.router.input_scale",
    "model.layers.{}.router.per_expert_scale": "layers.{}.mlp.router.output_scale",
    "model.layers.{}.post_feedforward_layernorm_1.weight": "layers.{}.mlp.shared_output_norm.weight",
    "model.layers.{}.pre_feedforward_layernorm_2.weight": "layers.{}.mlp.routed_input_norm.weight",
    "model.layers.{}.post_feedforward_layernorm_2.weight": "layers.{}.mlp.routed_output_norm.weight"}
_PER_LAYER_GLOBALS = {"model.embed_tokens_per_layer.weight": "embedding.per_layer.table.weight",
                      "model.per_layer_model_projection.weight": "embedding.per_layer.projection",
                      "model.per_layer_projection_norm.weight": "embedding.per_layer.norm.weight"}
_PER_LAYER_MAP = {"model.layers.{}.per_layer_input_gate.weight": "layers.{}.per_layer.gate",
                  "model.layers.{}.per_layer_projection.weight": "layers.{}.per_layer.up",
                  "model.layers.{}.post_per_layer_input_norm.weight": "layers.{}.per_layer.norm.weight"}


class _LayerView:
    """The HF config with `head_dim` and `num_key_value_heads` read from one layer's own config (transformers makes
    them per-layer attributes, whose global reads warn); every other field from the config itself."""

    def __init__(self, hf, layer: int):
        self._hf, self._layer = hf, hf.per_layer_config[layer]

    def __getattr__(self, name):
        return getattr(self._layer if name in ("head_dim", "num_key_value_heads") else self._hf, name)


class Gemma4Adapter(Gemma3Adapter):
    family, hf_class, config_class = "gemma4", "Gemma4ForCausalLM", "Gemma4TextConfig"
    options = ("Gemma 3's layers with plain RMSNorms, scores unscaled (--softmax-scale 1), values RMS-normed "
               "(--v-norm), full-attention layers with their own head size and KV heads (--global-kv-channels, "
               "--global-num-query-groups) and keys as values (--attention-k-eq-v), proportional rope on them "
               "(--rotary-proportional-percent), `layer_scalar` (--layer-scalars), final logit soft-capping "
               "(--final-logit-softcapping), per-layer inputs (--per-layer-input-size), the last layers attending "
               "with an earlier layer's keys and values (--num-kv-shared-layers, --double-wide-shared-mlp), the "
               "26B-A4B's MoE block beside each dense MLP (--moe-gemma4-block); text only")
    refused = ("bidirectional attention, rope scaling on the sliding layers, a per-layer table of another vocabulary "
               "size, an MoE block beside double-wide MLPs, as Llama's")
    gemma4 = True

    @classmethod
    def _rope(cls, hf) -> tuple:
        """The full-attention layers' rope: default, or proportional (its first share of frequencies turning)."""
        hf = getattr(hf, "_hf", hf)  # (the config itself, not _LayerView: refusals name its class)
        params = dict(hf.rope_parameters[FULL])
        if params.get("rope_type") != "proportional":
            return rope_of(hf, params)
        share, factor = float(params.get("partial_rotary_factor", 1.0)), float(params.get("factor", 1.0))
        scaling = {"rope_type": "proportional", "partial_rotary_factor": share, "factor": factor}
        return float(params["rope_theta"]), None if share == 1.0 and factor == 1.0 else scaling

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        name = "Gemma4"
        if getattr(hf, "use_bidirectional_attention", None) == "all":  # ("vision": text tokens attend causally)
            refuse(name, "use_bidirectional_attention", hf.use_bidirectional_attention, "attention here is causal")
        sliding = sliding_layers(hf, name)
        # (Gemma 3's own reads query_pre_attn_scalar; the full layers' head size and KV heads are read below)
        config = super(Gemma3Adapter, cls).config_from_hf(_LayerView(hf, sliding.index(1) if any(sliding) else 0))
        full = [i for i, kind in enumerate(hf.layer_types) if kind == FULL]
        for kind, layers in ((FULL, full), (SLIDING, [i for i, on in enumerate(sliding) if on])):
            shapes = {(hf.per_layer_config[i].head_dim, hf.per_layer_config[i].num_key_value_heads) for i in layers}
            if len(shapes) > 1:
                refuse(name, "per_layer_config", sorted(shapes), f"the {kind} layers share one head size and KV head "
                       f"count")
        head_dim, kv_heads = hf.per_layer_config[full[0]].head_dim, hf.per_layer_config[full[0]].num_key_value_heads
        if any(sliding) and kv_heads != config.num_query_groups and not hf.attention_k_eq_v:
            refuse(name, "per_layer_config", f"{kv_heads} KV heads on the full layers", "transformers gives the full "
                   "layers their own KV heads (num_global_key_value_heads) only with attention_k_eq_v; export could "
                   "not write this")
        per_layer = hf.hidden_size_per_layer_input or 0
        if per_layer and hf.vocab_size_per_layer_input != hf.vocab_size:
            refuse(name, "vocab_size_per_layer_input", hf.vocab_size_per_layer_input,
                   f"the per-layer inputs' table has the vocabulary's rows here ({hf.vocab_size})")
        shared = hf.num_kv_shared_layers or 0
        fields = dict(sandwich_norms=True, softmax_scale=1.0, v_norm=True, rmsnorm_fp32_scale=True,
                      attention_k_eq_v=bool(hf.attention_k_eq_v), final_logit_softcapping=hf.final_logit_softcapping,
                      per_layer_input_size=per_layer, kv_shared_layers=shared,
                      double_wide_shared_mlp=bool(shared and hf.use_double_wide_mlp))
        if hf.enable_moe_block:  # every layer: its dense MLP (our shared experts) beside the routed experts
            if fields["double_wide_shared_mlp"]:
                refuse(name, "use_double_wide_mlp", True, "with enable_moe_block the dense MLPs keep one width here")
            fields.update(num_experts=hf.num_experts, moe_router_topk=hf.top_k_experts,
                          moe_ffn_hidden_size=hf.moe_intermediate_size, moe_layer_freq=1,
                          moe_shared_expert_intermediate_size=hf.intermediate_size, moe_gemma4_block=True)
        if any(sliding):
            local = dict(hf.rope_parameters[SLIDING])
            if local.get("rope_type", "default") != "default":
                refuse(name, "rope_parameters.sliding_attention.rope_type", local.get("rope_type"),
                       "the sliding layers' rope is unscaled here")
            fields.update(window_attn_skip_freq=window_pattern(sliding), local_rotary_base=float(local["rope_theta"]))
            if head_dim != config.head_dim:
                fields["global_kv_channels"] = head_dim
            if kv_heads != config.num_query_groups:
                fields["global_num_query_groups"] = kv_heads
        else:  # every layer a full one: their shapes are the model's
            fields.update(kv_channels=None if head_dim * hf.num_attention_heads == hf.hidden_size else head_dim,
                          num_query_groups=kv_heads)
        return dataclasses.replace(config, **fields)

    @classmethod
    def with_stored_layers(cls, config: ModelConfig, names) -> ModelConfig:
        """Each layer's `layer_scalar` (a constant transformers never trains) read into --layer-scalars."""
        scalars = []
        for i in range(config.num_layers):
            key = f"model.layers.{i}.layer_scalar"
            scalars.append(float(expect(key, get(names, key), (1,))[0]) if key in names else 1.0)
        return config if all(s == 1.0 for s in scalars) else dataclasses.replace(config, layer_scalars=tuple(scalars))

    def check_exportable(self):
        super(Gemma3Adapter, self).check_exportable()
        c = self.config
        scaling = c.rope_scaling or {}
        require(self.hf_class, {"--softmax-scale 1": c.softmax_scale == 1.0, "--v-norm": c.v_norm,
                                "--qk-layernorm": c.qk_layernorm,
                                # (transformers applies num_global_key_value_heads only with attention_k_eq_v)
                                "--attention-k-eq-v with --global-num-query-groups":
                                    c.attention_k_eq_v or c.global_num_query_groups is None,
                                "rope unscaled or proportional on the full layers":
                                    scaling.get("rope_type", "proportional") == "proportional",
                                # (transformers makes the last layer a full one)
                                "the last layer attending fully (--window-attn-skip-freq)":
                                    c.layer_window(c.num_layers - 1) is None})
        if c.num_experts:  # Gemma 4's MoE block on every layer, its dense MLP as wide as --ffn-hidden-size
            require(self.hf_class, {"--moe-gemma4-block": c.moe_gemma4_block,
                                    "every layer MoE (--moe-layer-freq 1)": len(c.moe_layers) == c.num_layers,
                                    "--moe-shared-expert-intermediate-size = --ffn-hidden-size":
                                        c.moe_shared_expert_intermediate_size == c.ffn_hidden_size,
                                    "no --moe-router-topk-scaling-factor": not c.moe_router_topk_scaling_factor,
                                    "no --moe-router-num-groups": not c.moe_router_num_groups})

    def family_fields(self):
        c = self.config
        kinds = layer_types(c)
        full = next((i for i, kind in enumerate(kinds) if kind == FULL), None)
        sliding = next((i for i, kind in enumerate(kinds) if kind == SLIDING), None)
        scaling = c.rope_scaling or {}
        share = float(scaling.get("partial_rotary_factor", 1.0))
        ropes = {FULL: {"rope_type": "proportional", "partial_rotary_factor": share, "rope_theta": c.rotary_base,
                        **({"factor": scaling["factor"]} if float(scaling.get("factor", 1.0)) != 1.0 else {})}}
        if sliding is not None:  # (--local-rotary-base, else the full layers' rope on every layer)
            base, scaled = c.layer_rope(sliding)
            ropes[SLIDING] = dict(ropes[FULL], rope_theta=base) if scaled else {"rope_type": "default",
                                                                                "rope_theta": base}
        else:
            ropes[SLIDING] = dict(ropes[FULL])
        fields = dict(hidden_activation=self.hidden_act, layer_types=kinds, sliding_window=c.sliding_window or 4096,
                      rope_parameters=ropes, attention_k_eq_v=c.attention_k_eq_v,
                      final_logit_softcapping=c.final_logit_softcapping,
                      hidden_size_per_layer_input=c.per_layer_input_size, vocab_size_per_layer_input=c.vocab_size,
                      num_kv_shared_layers=c.kv_shared_layers, enable_moe_block=bool(c.num_experts),
                      use_double_wide_mlp=c.double_wide_shared_mlp)
        if c.num_experts:
            fields.update(num_experts=c.num_experts, top_k_experts=c.moe_router_topk,
                          moe_intermediate_size=c.moe_ffn_hidden_size)
        if full is not None:
            layer = c.layer_config(full)
            fields.update(global_head_dim=layer.head_dim, num_global_key_value_heads=layer.num_query_groups)
        return fields

    def layer_map(self) -> dict:
        return dict(super().layer_map(), **(_PER_LAYER_MAP if self.config.per_layer_input_size else {}),
                    **(_MOE_MAP if self.config.moe_gemma4_block else {}))

    def mlp_to_canonical(self, hf_state, i: int, out: dict, wanted=None) -> None:
        if not self.config.moe_gemma4_block:
            return super().mlp_to_canonical(hf_state, i, out, wanted)
        c = self.config  # the dense MLP as the shared experts; the stacked experts (an EP rank's own, when wanted)
        gated_to_canonical(hf_state, f"model.layers.{i}.mlp.", f"layers.{i}.mlp.shared_mlp.", out)
        ExpertLayout.fused_to_canonical(c, hf_state, f"model.layers.{i}.", f"layers.{i}.mlp.", out, wanted)

    def mlp_to_hf(self, state: dict, i: int, out: dict) -> None:
        if not self.config.moe_gemma4_block:
            return super().mlp_to_hf(state, i, out)
        gated_to_hf(state, f"layers.{i}.mlp.shared_mlp.", f"model.layers.{i}.mlp.", out)
        experts = [f"layers.{i}.mlp.{EXPERTS[1:]}{e}." for e in range(self.config.num_experts)]
        out[f"model.layers.{i}.experts.gate_up_proj"] = torch.stack([state[x + "fc1.weight"] for x in experts])
        out[f"model.layers.{i}.experts.down_proj"] = torch.stack([state[x + "fc2.weight"] for x in experts])

    def layer_to_canonical(self, hf_state, i, wanted=None):
        out = {}
        self.attention_to_canonical(hf_state, i, out)
        self.mlp_to_canonical(hf_state, i, out, wanted)
        for hf_tmpl, our_tmpl in self.layer_map().items():
            if not (self.config.kv_source(i) is not None and ".k_norm." in hf_tmpl):  # (a reader has no keys)
                out[our_tmpl.format(i)] = get(hf_state, hf_tmpl.format(i))
        return out

    def layer_to_hf(self, state: dict, i: int, out: dict) -> None:
        self.attention_to_hf(state, i, out)
        self.mlp_to_hf(state, i, out)
        for hf_tmpl, our_tmpl in self.layer_map().items():
            if our_tmpl.format(i) in state:
                out[hf_tmpl.format(i)] = state[our_tmpl.format(i)]

    def globals_to_canonical(self, hf_state, wanted=None):
        out = super().globals_to_canonical(hf_state, wanted)
        if self.config.per_layer_input_size:
            out.update({ours: get(hf_state, hf) for hf, ours in _PER_LAYER_GLOBALS.items()
                        if wanted is None or ours in wanted})
        return out

    def attention_to_canonical(self, hf_state, i: int, out: dict) -> None:
        c = self.config.layer_config(i)
        groups, d, h = c.num_query_groups, c.head_dim, c.hidden_size
        p = f"model.layers.{i}.self_attn."
        shapes = {"q": (c.num_attention_heads * d, h), "k": (groups * d, h), "v": (groups * d, h)}
        if c.kv_source(i) is not None:  # a layer reading another's keys and values: its queries only
            out[f"layers.{i}.attention.qkv.weight"] = expect(f"{p}q_proj.weight", get(hf_state, f"{p}q_proj.weight"),
                                                              shapes["q"])
            return
        q, k = (expect(f"{p}{x}_proj.weight", get(hf_state, f"{p}{x}_proj.weight"), shapes[x]) for x in "qk")
        v = None if c.attention_k_eq_v else expect(f"{p}v_proj.weight", get(hf_state, f"{p}v_proj.weight"),
                                                   shapes["v"])
        out[f"layers.{i}.attention.qkv.weight"] = fuse_qkv(q, k, v, groups)

    def attention_to_hf(self, state: dict, i: int, out: dict) -> None:
        c = self.config.layer_config(i)
        if c.kv_source(i) is not None:
            out[f"model.layers.{i}.self_attn.q_proj.weight"] = state[f"layers.{i}.attention.qkv.weight"]
            return
        q, k, v = split_qkv_flat(state[f"layers.{i}.attention.qkv.weight"], c.num_attention_heads // c.num_query_groups,
                                 c.head_dim, not c.attention_k_eq_v)
        for x, t in zip("qkv", (q, k, v)):
            if t is not None:
                out[f"model.layers.{i}.self_attn.{x}_proj.weight"] = t

    def to_hf(self, state):
        out = super().to_hf(state)
        if self.config.per_layer_input_size:
            out.update({hf: state[ours] for hf, ours in _PER_LAYER_GLOBALS.items()})
        dtype = state["final_norm.weight"].dtype
        for i in range(self.config.num_layers):  # transformers' buffer, stored with the weights
            scalar = self.config.layer_scalars[i] if self.config.layer_scalars else 1.0
            out[f"model.layers.{i}.layer_scalar"] = torch.tensor([scalar], dtype=dtype)
        return out
