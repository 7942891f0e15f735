"""Mixtral (MixtralForCausalLM): Mistral with every layer a softmax top-k mixture of experts."""

from __future__ import annotations

import dataclasses

from hybrid.conversion.families.adapter import refuse
from hybrid.conversion.families.mistral import MistralAdapter
from hybrid.conversion.families.moe import ExpertLayout


class MixtralAdapter(MistralAdapter):
    family, hf_class, config_class = "mixtral", "MixtralForCausalLM", "MixtralConfig"
    options = ("Mistral's, every layer a mixture of experts: softmax top-k renormalised (--num-experts, "
               "--moe-router-topk)")
    refused = "`router_jitter_noise` > 0, as Mistral's"
    # the experts' names on disk (transformers 5 fuses them on load)
    experts = ExpertLayout(block="block_sparse_moe", expert_names=("w1", "w3", "w2"))

    @classmethod
    def moe_config(cls, hf, config):
        if getattr(hf, "router_jitter_noise", 0.0):
            refuse("Mixtral", "router_jitter_noise", hf.router_jitter_noise, "routing noise is not implemented")
        return dataclasses.replace(config, num_experts=hf.num_local_experts, moe_router_topk=hf.num_experts_per_tok,
                                   moe_ffn_hidden_size=hf.intermediate_size, moe_layer_freq=1)

    def moe_wanted(self):
        c = self.config
        return {"--moe-layer-freq 1": all(c.mlp_type_of(i) == "moe" for i in range(c.num_layers)),
                "no --moe-router-pre-softmax": not c.moe_router_pre_softmax,
                "--moe-ffn-hidden-size = --ffn-hidden-size": c.moe_ffn_hidden_size == c.ffn_hidden_size}

    def family_fields(self):
        c = self.config
        fields = dict(super().family_fields(), num_local_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk)
        if c.kv_channels is None:
            fields["head_dim"] = None  # MixtralConfig keeps the default head size unset
        return fields
