"""Gemma 4 (Gemma4ForCausalLM, text only; its dense forms: E2B, E4B, 31B): Gemma 3's layers with plain-weight
RMSNorms, unscaled scores (the Q/K norms set their size), values RMS-normed without a weight, full-attention layers
with their own head size and KV heads whose keys may serve as values, proportional rope on those layers, a constant
per layer on its output, final logit soft-capping; E2B/E4B's per-layer inputs (hybrid.model.per_layer) and last
layers that attend with an earlier layer's keys and values (their MLPs possibly twice as wide)."""

from __future__ import annotations

import dataclasses

import torch

from hybrid.conversion.families.adapter import expect, get, refuse, require
from hybrid.conversion.families.gemma3 import Gemma3Adapter
from hybrid.conversion.families.options import FULL, SLIDING, layer_types, rope_of, sliding_layers, window_pattern
from hybrid.model.config import ModelConfig
from hybrid.model.qkv import fuse_qkv, split_qkv_flat

_NOT_BUILT = {  # Gemma 4's options not built yet (the 26B-A4B form), each refused by name
    "enable_moe_block": "Gemma 4's MoE block beside the MLP (26B-A4B) is not implemented",
}
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
               "with an earlier layer's keys and values (--num-kv-shared-layers, --double-wide-shared-mlp); text only")
    refused = ("the MoE block (26B-A4B), bidirectional attention, rope scaling on the sliding layers, a per-layer "
               "table of another vocabulary size, as Llama's")
    gemma4 = True

    @classmethod
    def _rope(cls, hf) -> tuple:
        """The full-attention layers' rope: default, or proportional (its first share of frequencies turning)."""
        params = dict(hf.rope_parameters[FULL])
        if params.get("rope_type") != "proportional":
            return rope_of(hf, params)
        share, factor = float(params.get("partial_rotary_factor", 1.0)), float(params.get("factor", 1.0))
        scaling = {"rope_type": "proportional", "partial_rotary_factor": share, "factor": factor}
        return float(params["rope_theta"]), None if share == 1.0 and factor == 1.0 else scaling

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        name = "Gemma4"
        for field, why in _NOT_BUILT.items():
            if getattr(hf, field, None):
                refuse(name, field, getattr(hf, field), why)
        if getattr(hf, "use_bidirectional_attention", None):
            refuse(name, "use_bidirectional_attention", hf.use_bidirectional_attention, "attention here is causal")
        sliding = sliding_layers(hf, name)
        # (Gemma 3's own reads query_pre_attn_scalar; the full layers' head size and KV heads are read below)
        config = super(Gemma3Adapter, cls).config_from_hf(_LayerView(hf, sliding.index(1) if any(sliding) else 0))
        full = [i for i, kind in enumerate(hf.layer_types) if kind == FULL]
        shapes = {(hf.per_layer_config[i].head_dim, hf.per_layer_config[i].num_key_value_heads) for i in full}
        if len(shapes) > 1:
            refuse(name, "per_layer_config", sorted(shapes), "the full-attention layers share one head size and KV "
                   "head count")
        head_dim, kv_heads = shapes.pop()
        per_layer = hf.hidden_size_per_layer_input or 0
        if per_layer and hf.vocab_size_per_layer_input != hf.vocab_size:
            refuse(name, "vocab_size_per_layer_input", hf.vocab_size_per_layer_input,
                   f"the per-layer inputs' table has the vocabulary's rows here ({hf.vocab_size})")
        shared = hf.num_kv_shared_layers or 0
        fields = dict(sandwich_norms=True, softmax_scale=1.0, v_norm=True, attention_k_eq_v=bool(hf.attention_k_eq_v),
                      final_logit_softcapping=hf.final_logit_softcapping, per_layer_input_size=per_layer,
                      kv_shared_layers=shared, double_wide_shared_mlp=bool(shared and hf.use_double_wide_mlp))
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
                                    scaling.get("rope_type", "proportional") == "proportional"})

    def family_fields(self):
        c = self.config
        kinds = layer_types(c)
        full = next((i for i, kind in enumerate(kinds) if kind == FULL), None)
        sliding = next((i for i, kind in enumerate(kinds) if kind == SLIDING), None)
        scaling = c.rope_scaling or {}
        share = float(scaling.get("partial_rotary_factor", 1.0))
        ropes = {FULL: {"rope_type": "proportional", "partial_rotary_factor": share, "rope_theta": c.rotary_base,
                        **({"factor": scaling["factor"]} if float(scaling.get("factor", 1.0)) != 1.0 else {})}}
        if sliding is not None:
            ropes[SLIDING] = {"rope_type": "default", "rope_theta": c.layer_rope(sliding)[0]}
        else:
            ropes[SLIDING] = dict(ropes[FULL])
        fields = dict(hidden_activation=self.hidden_act, layer_types=kinds, sliding_window=c.sliding_window or 4096,
                      rope_parameters=ropes, attention_k_eq_v=c.attention_k_eq_v,
                      final_logit_softcapping=c.final_logit_softcapping,
                      hidden_size_per_layer_input=c.per_layer_input_size, vocab_size_per_layer_input=c.vocab_size,
                      num_kv_shared_layers=c.kv_shared_layers, enable_moe_block=False,
                      use_double_wide_mlp=c.double_wide_shared_mlp)
        if full is not None:
            layer = c.layer_config(full)
            fields.update(global_head_dim=layer.head_dim, num_global_key_value_heads=layer.num_query_groups)
        return fields

    def _layer_map(self) -> dict:
        return dict(super()._layer_map(), **(_PER_LAYER_MAP if self.config.per_layer_input_size else {}))

    def layer_to_canonical(self, hf_state, i, wanted=None):
        out = {}
        self.attention_to_canonical(hf_state, i, out)
        self.mlp_to_canonical(hf_state, i, out, wanted)
        for hf_tmpl, our_tmpl in self._layer_map().items():
            if not (self.config.kv_source(i) is not None and ".k_norm." in hf_tmpl):  # (a reader has no keys)
                out[our_tmpl.format(i)] = get(hf_state, hf_tmpl.format(i))
        return out

    def layer_to_hf(self, state: dict, i: int, out: dict) -> None:
        self.attention_to_hf(state, i, out)
        self.mlp_to_hf(state, i, out)
        for hf_tmpl, our_tmpl in self._layer_map().items():
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
