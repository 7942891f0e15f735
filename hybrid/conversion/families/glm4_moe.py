"""GLM-4.5 (Glm4MoeForCausalLM): Llama with rope on part of each head, optional Q/K/V biases and Q/K norms,
DeepSeek's MoE (moe.DEEPSEEK_EXPERTS) and stored multi-token prediction layers (mtp)."""

from __future__ import annotations

import dataclasses

from hybrid.conversion.families.llama import LlamaAdapter
from hybrid.conversion.families.moe import DEEPSEEK_EXPERTS, deepseek_moe_config, deepseek_moe_fields, \
    deepseek_moe_wanted
from hybrid.conversion.families.options import partial_rotary_percent
from hybrid.model.config import ModelConfig


class Glm4MoeAdapter(LlamaAdapter):
    family, hf_class, config_class = "glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeConfig"
    options = ("Llama's, rope on part of each head (`partial_rotary_factor` = --rotary-percent), optional Q/K/V "
               "biases (`attention_bias` = --add-qkv-bias) and per-head Q/K norms (`use_qk_norm` = --qk-layernorm); "
               "DeepSeek's MoE: sigmoid routing with the score bias (--moe-router-enable-expert-bias; its GEMM in "
               "fp32: --moe-router-dtype fp32), groups "
               "(--moe-router-num-groups / --moe-router-group-topk), `routed_scaling_factor` "
               "(--moe-router-topk-scaling-factor), shared experts, the first layers dense (--moe-layer-freq)")
    refused = ("`norm_topk_prob` off with top-k > 1, `topk_group` with topk // topk_group != 2, as Llama's; its MTP "
               "layers (model.layers.{L + k}) are read and written as --mtp-num-layers")
    partial_rotary = True
    REFUSED_BIASES = ("mlp_bias",)  # `attention_bias` is Q/K/V's (the output projection never has one)

    experts = DEEPSEEK_EXPERTS
    stores_mtp = True  # its MTP layers (model.layers.{L + k}) are read and written as --mtp-num-layers

    @classmethod
    def moe_config(cls, hf, config):
        return deepseek_moe_config(cls.hf_class.replace("ForCausalLM", ""), hf, config)

    def moe_wanted(self):
        return deepseek_moe_wanted(self.config)

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.qkv_bias, self.qk_norm = config.add_qkv_bias, config.qk_layernorm  # either way, as the config says

    @classmethod
    def config_from_hf(cls, hf):
        return dataclasses.replace(super().config_from_hf(hf), add_qkv_bias=bool(hf.attention_bias),
                                   qk_layernorm=bool(hf.use_qk_norm), rotary_percent=partial_rotary_percent(hf))

    def family_fields(self):
        c = self.config
        rope = {"rope_type": "default"} if not c.rope_scaling else dict(c.rope_scaling)
        return dict(deepseek_moe_fields(c), attention_bias=c.add_qkv_bias, use_qk_norm=c.qk_layernorm,
                    rope_parameters=dict(rope, rope_theta=c.rotary_base, partial_rotary_factor=c.rotary_percent),
                    num_nextn_predict_layers=c.mtp_num_layers or 0)
