"""Qwen3 (Qwen3ForCausalLM): Qwen2's layout without Q/K/V biases, with per-head RMSNorm on Q and K."""

from __future__ import annotations

from hybrid.conversion.families.qwen2 import Qwen2Adapter


class Qwen3Adapter(Qwen2Adapter):
    family, hf_class, config_class = "qwen3", "Qwen3ForCausalLM", "Qwen3Config"
    options = "Llama's, plus per-head RMSNorm on Q and K (--qk-layernorm), head_dim = --kv-channels"
    refused = "`attention_bias` (on Q, K, V and O), a sliding window on some layers only, as Llama's"
    qkv_bias, qk_norm = False, True
