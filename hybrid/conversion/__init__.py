"""Checkpoint conversion: HuggingFace adapters (families, hf), hybrid checkpoints at any TP x PP and
weights into a live model (layout), DeepSpeed universal checkpoints (ds_universal, universal), the
checkpoint_util command."""
