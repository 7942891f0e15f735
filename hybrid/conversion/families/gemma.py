"""Gemma (GemmaForCausalLM): GeGLU with the tanh GeLU, RMSNorm x (1 + weight), embeddings x sqrt(hidden)."""

from __future__ import annotations

from hybrid.conversion.families.llama import LlamaAdapter


class GemmaAdapter(LlamaAdapter):
    family, hf_class, config_class = "gemma", "GemmaForCausalLM", "GemmaConfig"
    options = ("GeGLU with tanh GeLU (--geglu), RMSNorm x (1 + weight) (--apply-layernorm-1p), embeddings x "
               "sqrt(hidden) (--scale-embeddings), head_dim = --kv-channels")
    refused = "Gemma 2 (soft-capping; another class; Gemma 3 is the `gemma3` family), as Llama's"
    hidden_act, gemma = "gelu_pytorch_tanh", True

    def family_fields(self):
        return {"hidden_activation": self.hidden_act}
