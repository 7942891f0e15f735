"""Mistral (MistralForCausalLM): Llama with sliding-window attention on every layer."""

from __future__ import annotations

from hybrid.conversion.families.llama import LlamaAdapter


class MistralAdapter(LlamaAdapter):
    family, hf_class, config_class = "mistral", "MistralForCausalLM", "MistralConfig"
    options = "Llama's, plus sliding-window attention (`sliding_window` = --window-size)"
    refused = "`layer_types` (alternating attention: Ministral), as Llama's"
    windowed = True

    def family_fields(self):
        return {"sliding_window": self.config.sliding_window}
