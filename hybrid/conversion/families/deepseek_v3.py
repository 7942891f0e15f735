"""DeepSeek-V3 (DeepseekV3ForCausalLM; also Kimi-K2 and DeepSeek-V3.1/R1): multi-head latent attention with its
rope rows in DeepSeek's interleaved order (mla_rope), DeepSeek's MoE (moe.DEEPSEEK_EXPERTS) and stored
multi-token prediction layers (mtp)."""

from __future__ import annotations

import dataclasses

from hybrid.conversion.families.adapter import expect, get, refuse
from hybrid.conversion.families.llama import LlamaAdapter
from hybrid.conversion.families.mla_rope import deepseek_rope_rows
from hybrid.conversion.families.moe import DEEPSEEK_EXPERTS, deepseek_moe_config, deepseek_moe_fields, \
    deepseek_moe_wanted
from hybrid.errors import ConfigError

# transformers' DeepseekV3Attention builds q_a_layernorm / kv_a_layernorm with its default eps
HF_LATENT_NORM_EPS = 1e-6


class DeepseekV3Adapter(LlamaAdapter):
    family, hf_class, config_class = "deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config"
    options = ("Llama's (yarn rope included), multi-head latent attention (--multi-latent-attention: `q_lora_rank` "
               "or none, `kv_lora_rank`, `qk_nope_head_dim` = --qk-head-dim, `qk_rope_head_dim` = "
               "--qk-pos-emb-head-dim, `v_head_dim`; YaRN's `mscale_all_dim` on the softmax scale), DeepSeek's MoE "
               "(as GLM-4.5's); also Kimi-K2 and DeepSeek-V3.1/R1")
    refused = ("`attention_bias`, `rope_interleave` false, `num_key_value_heads` != `num_attention_heads`, as "
               "GLM-4.5's MoE; its MTP layers (model.layers.{L + k}) are read and written as --mtp-num-layers")

    experts = DEEPSEEK_EXPERTS
    stores_mtp = True  # its MTP layers (model.layers.{L + k}) are read and written as --mtp-num-layers
    qk_norm = True  # MLA's latent norms (hybrid.model.mla), which megatron-core's --qk-layernorm means with MLA
    mla = True

    @classmethod
    def moe_config(cls, hf, config):
        return deepseek_moe_config(cls.hf_class.replace("ForCausalLM", ""), hf, config)

    def moe_wanted(self):
        return deepseek_moe_wanted(self.config)

    def layer_map(self) -> dict:
        return dict(self.LAYER_MAP)  # (the latent norms are mapped with the projections)

    @classmethod
    def config_from_hf(cls, hf):
        name = cls.hf_class.replace("ForCausalLM", "")
        if getattr(hf, "rope_interleave", True) is False:
            refuse(name, "rope_interleave", False, "DeepSeek's rope features are read in their interleaved order")
        if (hf.num_key_value_heads or hf.num_attention_heads) != hf.num_attention_heads:
            refuse(name, "num_key_value_heads", hf.num_key_value_heads, "MLA has a key and value per head")
        # transformers' DeepSeek models compute the latent norms with eps 1e-6 whatever rms_norm_eps says
        latent_eps = None if float(hf.rms_norm_eps) == HF_LATENT_NORM_EPS else HF_LATENT_NORM_EPS
        return dataclasses.replace(
            super().config_from_hf(hf), multi_latent_attention=True, kv_channels=None, qk_layernorm=True,
            mla_latent_norm_epsilon=latent_eps, num_query_groups=hf.num_attention_heads, q_lora_rank=hf.q_lora_rank,
            kv_lora_rank=hf.kv_lora_rank, qk_head_dim=hf.qk_nope_head_dim, qk_pos_emb_head_dim=hf.qk_rope_head_dim,
            v_head_dim=hf.v_head_dim)

    def check_exportable(self):
        super().check_exportable()
        if not self.config.multi_latent_attention:
            raise ConfigError(f"exporting to {self.hf_class} needs --multi-latent-attention.")
        latent_eps = self.config.mla_latent_norm_epsilon or self.config.norm_epsilon
        if latent_eps != HF_LATENT_NORM_EPS:
            raise ConfigError(f"exporting to {self.hf_class} needs MLA's latent norms at eps {HF_LATENT_NORM_EPS} "
                              f"(--mla-latent-norm-epsilon, or --norm-epsilon; the model's are {latent_eps}): "
                              f"transformers computes them with {HF_LATENT_NORM_EPS} whatever rms_norm_eps says, so "
                              f"the export would be another model.")

    def family_fields(self):
        c = self.config
        return dict(deepseek_moe_fields(c), q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
                    qk_nope_head_dim=c.qk_head_dim, qk_rope_head_dim=c.qk_pos_emb_head_dim, v_head_dim=c.v_head_dim,
                    rope_interleave=True, num_mtp_layers=c.mtp_num_layers or 0,
                    head_dim=c.qk_pos_emb_head_dim)  # (its rope's, there)

    def _mla_tensors(self, i: int) -> dict:
        """HF name -> (canonical name, shape) of layer i's MLA projections and norms."""
        c = self.config
        p, ours = f"model.layers.{i}.self_attn.", f"layers.{i}.attention."
        n, h, d, kv, pos = c.num_attention_heads, c.hidden_size, c.head_dim, c.kv_lora_rank, c.qk_pos_emb_head_dim
        if c.q_lora_rank is None:
            tensors = {p + "q_proj.weight": (ours + "q.weight", (n * d, h))}
        else:
            r = c.q_lora_rank
            tensors = {p + "q_a_proj.weight": (ours + "q_down.weight", (r, h)),
                       p + "q_a_layernorm.weight": (ours + "q_down_norm.weight", (r,)),
                       p + "q_b_proj.weight": (ours + "q_up.weight", (n * d, r))}
        return dict(tensors, **{
            p + "kv_a_proj_with_mqa.weight": (ours + "kv_down.weight", (kv + pos, h)),
            p + "kv_a_layernorm.weight": (ours + "kv_down_norm.weight", (kv,)),
            p + "kv_b_proj.weight": (ours + "kv_up.weight", (n * (c.qk_head_dim + c.v_head_dim), kv))})

    def attention_to_canonical(self, hf_state, i, out):
        read = {name: expect(hf_name, get(hf_state, hf_name), shape)
                for hf_name, (name, shape) in self._mla_tensors(i).items()}
        out.update(deepseek_rope_rows(read, self.config, to_halves=True))

    def attention_to_hf(self, state, i, out):
        ours = deepseek_rope_rows({name: state[name] for name, _ in self._mla_tensors(i).values()}, self.config,
                                  to_halves=False)
        out.update({hf_name: ours[name] for hf_name, (name, _) in self._mla_tensors(i).items()})
