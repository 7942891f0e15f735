"""Full activation recompute of transformer layers, through `deepspeed.checkpointing` (which restores
the TP RNG tracker's states, so recomputed dropout masks equal the original ones)."""

from __future__ import annotations

import deepspeed
import torch


def checkpoint(fn, *args):
    """Run `fn(*args)` keeping only its inputs; recompute it in backward (DeepSpeed's checkpoint)."""
    return deepspeed.checkpointing.checkpoint(fn, *args)


def full_recompute(config, training: bool) -> bool:
    """Whether --recompute-granularity full applies now (training with gradients)."""
    return config.recompute_granularity == "full" and training and torch.is_grad_enabled()


class LayerChunk:
    """Runs consecutive layers; the unit that full recompute checkpoints."""

    def __init__(self, layers):
        self.layers = layers

    def __call__(self, hidden, layout=None, *per_layer):
        for layer in self.layers:
            hidden = layer(hidden, layout, *per_layer)
        return hidden


def run_layers(layers, hidden, config, training: bool, layout=None, per_layer=None):
    """Apply `layers`, with full activation recompute as `--recompute-*` asks (Megatron-LM):
    uniform: chunks of `recompute_num_layers` layers are recomputed as units;
    block: the first `recompute_num_layers` layers are recomputed, the rest are not.
    `layout`: the micro-batch's documents and positions (hybrid.model.sequence), passed to every layer;
    `per_layer`: Gemma 4's per-layer inputs (hybrid.model.per_layer), an input of each recomputed unit too."""
    extra = () if per_layer is None else (per_layer,)
    if not full_recompute(config, training):
        return LayerChunk(layers)(hidden, layout, *extra)
    n = max(1, config.recompute_num_layers)
    if not hidden.requires_grad:  # a frozen embedding (LoRA): DeepSpeed's reentrant checkpoint would give no
        # gradient to the parameters inside it (transformers' enable_input_require_grads, for the same reason)
        hidden = hidden.detach().requires_grad_(True)
    if config.recompute_method == "uniform":
        for start in range(0, len(layers), n):
            hidden = checkpoint(LayerChunk(layers[start:start + n]), hidden, layout, *extra)
        return hidden
    for index, layer in enumerate(layers):
        hidden = checkpoint(layer, hidden, layout, *extra) if index < n else layer(hidden, layout, *extra)
    return hidden
