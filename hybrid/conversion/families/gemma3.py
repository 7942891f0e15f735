"""Gemma 3 (Gemma3ForCausalLM, text only): Gemma's options plus Q/K norms, sandwich norms, sliding-window and full
layers each with its own rope, and `query_pre_attn_scalar`."""

from __future__ import annotations

import dataclasses

from hybrid.conversion.families.adapter import refuse
from hybrid.conversion.families.gemma import GemmaAdapter
from hybrid.conversion.families.options import FULL, SLIDING, layer_types, rope_of, sliding_layers, window_pattern
from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig


class Gemma3Adapter(GemmaAdapter):
    family, hf_class, config_class = "gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig"
    options = ("Gemma's, plus (1 + w) RMSNorm over each head of Q and K (--qk-layernorm), norms on the attention's "
               "and the MLP's outputs (--sandwich-norms), sliding-window and full layers (`layer_types`: --window-size "
               "with --window-attn-skip-freq), each with its own rope base (--local-rotary-base; linear or llama3 "
               "scaling on the full layers), `query_pre_attn_scalar` (--softmax-scale); text only")
    refused = "soft-capping, bidirectional attention, rope scaling on the sliding layers, as Llama's"
    qk_norm, windowed, gemma3 = True, True, True
    LAYER_MAP = {"model.layers.{}.input_layernorm.weight": "layers.{}.input_norm.weight",
                 "model.layers.{}.post_attention_layernorm.weight": "layers.{}.attention_output_norm.weight",
                 "model.layers.{}.pre_feedforward_layernorm.weight": "layers.{}.post_attention_norm.weight",
                 "model.layers.{}.post_feedforward_layernorm.weight": "layers.{}.mlp_output_norm.weight",
                 "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.dense.weight"}

    @classmethod
    def _rope(cls, hf) -> tuple:
        return rope_of(hf, hf.rope_parameters[FULL])

    @classmethod
    def _window(cls, hf, name: str):
        return int(hf.sliding_window) if SLIDING in hf.layer_types else None

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        name = cls.hf_class.replace("ForCausalLM", "")
        if getattr(hf, "use_bidirectional_attention", False):
            refuse(name, "use_bidirectional_attention", True, "attention here is causal")
        sliding = sliding_layers(hf, name)
        config = super().config_from_hf(hf)
        local_base = None
        if any(sliding):
            local_base, local_scaling = rope_of(hf, hf.rope_parameters[SLIDING])
            if local_scaling and (local_scaling, local_base) != (config.rope_scaling, config.rotary_base):
                refuse(name, "rope_parameters.sliding_attention", hf.rope_parameters[SLIDING],
                       "the sliding layers' rope is unscaled here, or the full layers' own")
            if local_scaling:  # the full layers' rope on every layer
                local_base = None
        head_dim = config.head_dim
        scale = float(hf.query_pre_attn_scalar) ** -0.5
        return dataclasses.replace(
            config, sandwich_norms=True, window_attn_skip_freq=window_pattern(sliding) if any(sliding) else None,
            local_rotary_base=local_base, softmax_scale=None if scale == head_dim ** -0.5 else scale)

    def family_fields(self):
        c = self.config
        kinds = layer_types(c)
        ropes = {}
        for i, kind in enumerate(kinds):  # each kind's rope, as the model computes it (ModelConfig.layer_rope)
            base, scaling = c.layer_rope(i)
            ropes[kind] = dict(scaling, rope_theta=base) if scaling else {"rope_type": "default", "rope_theta": base}
        for kind in (SLIDING, FULL):  # a kind no layer has: the other's
            ropes.setdefault(kind, ropes[FULL if kind == SLIDING else SLIDING])
        return dict(super().family_fields(), layer_types=kinds, sliding_window=c.sliding_window or 4096,
                    rope_parameters=ropes, query_pre_attn_scalar=self._pre_attn_scalar())

    def _pre_attn_scalar(self):
        c = self.config
        if c.softmax_scale is None:
            return c.head_dim
        scalar = c.softmax_scale ** -2
        return round(scalar) if round(scalar) > 0 and abs(scalar - round(scalar)) < 1e-6 else None

    def check_exportable(self):
        super().check_exportable()
        if self._pre_attn_scalar() is None:
            raise ConfigError(f"exporting to Gemma3ForCausalLM: --softmax-scale {self.config.softmax_scale} is not "
                              f"1/sqrt(n) for a whole n (its query_pre_attn_scalar is an integer).")
