"""Megatron-format token files, tokenizers, GPT samples, and the embedded default corpus."""
