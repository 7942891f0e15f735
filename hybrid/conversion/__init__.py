"""Checkpoint conversion: what a directory holds and one reader for every kind, HuggingFace families, Megatron's
checkpoints, hybrid checkpoints at any TP x PP, DeepSpeed universal checkpoints, the checkpoint_util command.

Modules:
  source           what a checkpoint directory holds (HF, hybrid, Megatron-LM, Megatron-DeepSpeed) and its reader
  families         one file per HuggingFace family behind one adapter protocol, and their registry
  hf               HuggingFace directories <-> canonical state dicts, read a tensor at a time
  peft             PEFT's LoRA adapter directories <-> the model's adapters, and adapters merged
  layout           hybrid checkpoints as full state dicts and back to any layout; weights into a live model
  megatron         Megatron-LM's and Megatron-DeepSpeed's checkpoints, read and written
  ds_universal     DeepSpeed's universal checkpoint layout
  universal        universal checkpoints made with DeepSpeed's own ds_to_universal
  checkpoint_util  the converter command (conversion/checkpoint_util.py)
"""
