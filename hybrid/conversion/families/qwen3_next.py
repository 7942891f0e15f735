"""Qwen3-Next (Qwen3NextForCausalLM): Qwen3.5-MoE's architecture before it, its Gated DeltaNet input projection
grouped per key head (`in_proj_qkvz`, `in_proj_ba`), MoE layers by decoder_sparse_step / mlp_only_layers and
norm_topk_prob as Qwen2-MoE."""

from __future__ import annotations

from hybrid.conversion.families.qwen3_5_moe import Qwen3_5MoeAdapter


class Qwen3NextAdapter(Qwen3_5MoeAdapter):
    family, hf_class, config_class = "qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig"
    options = ("Qwen3.5-MoE's with the grouped Gated DeltaNet projections, MoE layers by decoder_sparse_step / "
               "mlp_only_layers (--moe-layer-freq), norm_topk_prob (off: --moe-router-pre-softmax)")
    refused = "as Qwen3.5's"
    grouped_projections = True
    every_layer_moe = False
