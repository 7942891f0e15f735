"""Checkpoint conversion: HuggingFace adapters, hybrid TP x PP layouts, the checkpoint_util CLI."""
