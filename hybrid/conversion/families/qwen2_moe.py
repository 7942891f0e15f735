"""Qwen2-MoE (Qwen2MoeForCausalLM): Qwen2 with MoE layers and a sigmoid-gated shared expert."""

from __future__ import annotations

from hybrid.conversion.families.moe import ExpertLayout, qwen_moe_config, qwen_moe_fields
from hybrid.conversion.families.qwen2 import Qwen2Adapter


class Qwen2MoeAdapter(Qwen2Adapter):
    family, hf_class, config_class = "qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig"
    options = ("Qwen2's, MoE layers by decoder_sparse_step / mlp_only_layers (--moe-layer-freq), a sigmoid-gated "
               "shared expert, norm_topk_prob (off: --moe-router-pre-softmax)")
    refused = "as Qwen2's"
    experts = ExpertLayout(shared=True)  # sigmoid-gated

    @classmethod
    def moe_config(cls, hf, config):
        return qwen_moe_config(hf, config, shared=True)

    def family_fields(self):
        return dict(super().family_fields(), **qwen_moe_fields(self.config, shared=True))
