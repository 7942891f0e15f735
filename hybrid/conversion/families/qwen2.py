"""Qwen2 (Qwen2ForCausalLM): Llama with biases on Q, K and V only, and an optional window on every layer."""

from __future__ import annotations

from hybrid.conversion.families.llama import LlamaAdapter


class Qwen2Adapter(LlamaAdapter):
    family, hf_class, config_class = "qwen2", "Qwen2ForCausalLM", "Qwen2Config"
    options = "Llama's, plus a bias on Q, K and V only (--add-qkv-bias); a sliding window on every layer"
    refused = "a sliding window on some layers only (`max_window_layers` < `num_hidden_layers`), as Llama's"
    qkv_bias, windowed = True, True

    def family_fields(self):
        w = self.config.sliding_window  # a window on every layer (max_window_layers 0), or none
        return {"use_sliding_window": True, "sliding_window": w, "max_window_layers": 0} if w else {}
