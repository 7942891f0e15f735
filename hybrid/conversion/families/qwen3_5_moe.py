"""Qwen3.5-MoE (Qwen3_5MoeForCausalLM, its text model): Qwen3.5's layers with MoE on every layer (top-k of a
softmax, renormalised) and a sigmoid-gated shared expert, as Qwen2-MoE stores them."""

from __future__ import annotations

from hybrid.conversion.families.adapter import require
from hybrid.conversion.families.moe import ExpertLayout, qwen_moe_config, qwen_moe_fields
from hybrid.conversion.families.qwen3_5 import Qwen3_5Adapter


class Qwen3_5MoeAdapter(Qwen3_5Adapter):
    family, hf_class, config_class = "qwen3_5_moe", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig"
    options = "Qwen3.5's, MoE on every layer with renormalised top-k and a sigmoid-gated shared expert"
    refused = "as Qwen3.5's"
    experts = ExpertLayout(shared=True)
    every_layer_moe = True  # the config has no decoder_sparse_step / mlp_only_layers / norm_topk_prob

    @classmethod
    def moe_config(cls, hf, config):
        return qwen_moe_config(hf, config, shared=True)

    def check_exportable(self):
        super().check_exportable()
        c = self.config
        if self.every_layer_moe:
            require(self.hf_class, {"MoE on every layer (--moe-layer-freq 1)": len(c.moe_layers) == c.num_layers,
                                    "renormalised top-k (no --moe-router-pre-softmax)": not c.moe_router_pre_softmax})

    def family_fields(self):
        fields = dict(super().family_fields(), **qwen_moe_fields(self.config, shared=True))
        fields.pop("intermediate_size", None)
        if self.every_layer_moe:
            for name in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
                fields.pop(name)
        return fields
