"""GPT-OSS (GptOssForCausalLM): attention sinks, sliding-window and full layers, YaRN rope, biases everywhere, and
every layer a softmax top-k MoE whose fused experts hold gate and up interleaved."""

from __future__ import annotations

import dataclasses

import torch

from hybrid.conversion.families.adapter import expect, get, refuse, require
from hybrid.conversion.families.llama import LlamaAdapter
from hybrid.conversion.families.options import layer_types, sliding_layers, window_pattern
from hybrid.model.naming import EXPERTS


class GptOssAdapter(LlamaAdapter):
    family, hf_class, config_class = "gpt_oss", "GptOssForCausalLM", "GptOssConfig"
    options = ("attention sinks (--softmax-type learnable), sliding-window and full layers (`layer_types`: "
               "--window-size with --window-attn-skip-freq), YaRN rope, biases everywhere (--add-bias-linear: Q/K/V, "
               "output, router, experts), every layer a softmax top-k MoE whose experts' clamped quick-GeGLU is "
               "--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value `swiglu_limit`")
    refused = ("`swiglu_alpha` other than 1.702, `attention_bias` false, as Llama's (MXFP4 weights: save them "
               "dequantized)")
    qkv_bias = True  # (Q/K/V's biases as --add-bias-linear's, with the output's)
    hidden_act = None  # transformers' GPT-OSS never reads `hidden_act`: its experts' activation is the clamped GLU
    REFUSED_BIASES = ("mlp_bias",)
    LAYER_MAP = dict(LlamaAdapter.LAYER_MAP,
                     **{"model.layers.{}.self_attn.o_proj.bias": "layers.{}.attention.dense.bias",
                        "model.layers.{}.self_attn.sinks": "layers.{}.attention.sinks"})

    @classmethod
    def config_from_hf(cls, hf):
        name = "GptOss"
        if float(hf.swiglu_alpha) != 1.702:
            refuse(name, "swiglu_alpha", hf.swiglu_alpha, "the quick-GeGLU's alpha is 1.702 (megatron-core's)")
        if not hf.attention_bias:
            refuse(name, "attention_bias", False, "GPT-OSS's attention has biases here (--add-bias-linear)")
        sliding = sliding_layers(hf, name)
        config = super().config_from_hf(hf)
        return dataclasses.replace(config, swiglu=False, quick_geglu=True, glu_linear_offset=1.0,
                        activation_func_clamp_value=float(hf.swiglu_limit), add_bias_linear=True, add_qkv_bias=False,
                        attention_sinks=True, num_experts=hf.num_local_experts, moe_router_topk=hf.num_experts_per_tok,
                        moe_ffn_hidden_size=hf.intermediate_size, moe_layer_freq=1,
                        sliding_window=int(hf.sliding_window) if any(sliding) else None,
                        window_attn_skip_freq=window_pattern(sliding) if any(sliding) else None)

    @classmethod
    def _window(cls, hf, name: str):
        return None  # (set from layer_types above)

    def check_exportable(self):
        c = self.config
        wanted = {"rope": c.position_embedding_type == "rope", "RMSNorm": c.normalization == "RMSNorm",
                  "--add-bias-linear": c.add_bias_linear, "--softmax-type learnable": c.attention_sinks,
                  "--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value":
                      c.quick_geglu and c.glu_linear_offset == 1.0 and c.activation_func_clamp_value is not None,
                  "--num-experts on every layer (--moe-layer-freq 1)":
                      bool(c.num_experts) and all(c.mlp_type_of(i) == "moe" for i in range(c.num_layers)),
                  "softmax top-k routing (no --moe-router-pre-softmax, scaling, score bias, groups, shared experts)":
                      bool(c.num_experts) and c.moe_router_score_function == "softmax"
                      and not (c.moe_router_pre_softmax or c.moe_router_topk_scaling_factor
                               or c.moe_router_enable_expert_bias or c.moe_router_num_groups
                               or c.moe_shared_expert_intermediate_size),
                  "none of --qk-layernorm, --add-qkv-bias, --sandwich-norms, --rotary-percent, --apply-layernorm-1p, "
                  "--scale-embeddings, --local-rotary-base, --softmax-scale, --multi-latent-attention, "
                  "--mtp-num-layers": not (
                      c.qk_layernorm or c.add_qkv_bias or c.sandwich_norms or c.rotary_percent != 1.0
                      or c.apply_layernorm_1p or c.scale_embeddings or c.local_rotary_base is not None
                      or c.softmax_scale is not None or c.multi_latent_attention or c.mtp_num_layers)}
        require(self.hf_class, wanted)

    def family_fields(self):
        c = self.config
        kinds = layer_types(c)
        return dict(intermediate_size=c.moe_ffn_hidden_size, num_local_experts=c.num_experts,
                    num_experts_per_tok=c.moe_router_topk, sliding_window=c.sliding_window or 128, layer_types=kinds,
                    attention_bias=True, swiglu_limit=c.activation_func_clamp_value, swiglu_alpha=1.702,
                    hidden_act="silu")  # (GptOssConfig's default, which its model never reads)

    def mlp_to_canonical(self, hf_state, i, out, wanted=None):
        """GPT-OSS's fused experts (gate_up_proj [E, h, 2f], its gate and up columns interleaved; down_proj
        [E, f, h]; their biases) -> each expert's fc1 = [gate; up] and fc2, [out, in]; the router's weight and bias."""
        c = self.config
        hf, ours = f"model.layers.{i}.mlp.", f"layers.{i}.mlp."
        e, h, f = c.num_experts, c.hidden_size, c.moe_ffn_hidden_size
        out[ours + "router.weight"] = expect(hf + "router.weight", get(hf_state, hf + "router.weight"), (e, h))
        out[ours + "router.bias"] = expect(hf + "router.bias", get(hf_state, hf + "router.bias"), (e,))
        mine = [j for j in range(e) if wanted is None or f"{ours}{EXPERTS[1:]}{j}.fc1.weight" in wanted]
        if not mine:
            return
        gate_up = expect(hf + "experts.gate_up_proj", get(hf_state, hf + "experts.gate_up_proj"), (e, h, 2 * f))
        gate_up_bias = expect(hf + "experts.gate_up_proj_bias", get(hf_state, hf + "experts.gate_up_proj_bias"),
                              (e, 2 * f))
        down = expect(hf + "experts.down_proj", get(hf_state, hf + "experts.down_proj"), (e, f, h))
        down_bias = expect(hf + "experts.down_proj_bias", get(hf_state, hf + "experts.down_proj_bias"), (e, h))
        for j in mine:
            expert = f"{ours}{EXPERTS[1:]}{j}."
            out[expert + "fc1.weight"] = torch.cat([gate_up[j][:, 0::2].t(), gate_up[j][:, 1::2].t()]).contiguous()
            out[expert + "fc1.bias"] = torch.cat([gate_up_bias[j][0::2], gate_up_bias[j][1::2]]).contiguous()
            out[expert + "fc2.weight"] = down[j].t().contiguous()
            out[expert + "fc2.bias"] = down_bias[j].clone()

    def mlp_to_hf(self, state, i, out):
        c = self.config
        hf, ours = f"model.layers.{i}.mlp.", f"layers.{i}.mlp."
        out[hf + "router.weight"], out[hf + "router.bias"] = state[ours + "router.weight"], state[ours + "router.bias"]
        experts = [f"{ours}{EXPERTS[1:]}{j}." for j in range(c.num_experts)]

        def interleaved(t):  # [gate; up] along dim 0 -> gate and up alternating
            gate, up = t.chunk(2, dim=0)
            return torch.stack([gate, up], dim=1).reshape(t.shape)
        out[hf + "experts.gate_up_proj"] = torch.stack([interleaved(state[x + "fc1.weight"]).t() for x in experts])
        out[hf + "experts.gate_up_proj_bias"] = torch.stack([interleaved(state[x + "fc1.bias"]) for x in experts])
        out[hf + "experts.down_proj"] = torch.stack([state[x + "fc2.weight"].t() for x in experts])
        out[hf + "experts.down_proj_bias"] = torch.stack([state[x + "fc2.bias"] for x in experts])
