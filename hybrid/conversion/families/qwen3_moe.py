"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 with MoE layers, no shared expert."""

from __future__ import annotations

from hybrid.conversion.families.moe import ExpertLayout, qwen_moe_config, qwen_moe_fields
from hybrid.conversion.families.qwen3 import Qwen3Adapter


class Qwen3MoeAdapter(Qwen3Adapter):
    family, hf_class, config_class = "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig"
    options = "Qwen3's, MoE layers by decoder_sparse_step / mlp_only_layers, norm_topk_prob, no shared expert"
    refused = "as Qwen3's"
    experts = ExpertLayout()

    @classmethod
    def moe_config(cls, hf, config):
        return qwen_moe_config(hf, config, shared=False)

    def family_fields(self):
        return dict(super().family_fields(), **qwen_moe_fields(self.config, shared=False))
