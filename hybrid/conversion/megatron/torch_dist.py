"""megatron-core's `torch_dist` checkpoints, read: global tensors (every layer's weight of one kind stacked), a
region at a time (hybrid.conversion.megatron.dcp_files); the model's tensors, or one kind of the optimizer's."""

from __future__ import annotations

import torch

from hybrid.conversion.megatron.args import arg
from hybrid.conversion.megatron.dcp_files import DCPCheckpoint
from hybrid.conversion.megatron.names import (EXPERT_KEYS, LAYER_KEY, MODEL_PREFIXES, canonical_of, expert_name,
                                              layer_scope)
from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig


class DistParts:
    """A torch_dist checkpoint's model tensors, or (`prefix` "optimizer.state.exp_avg." and so on) the
    optimizer's tensors of one kind, which megatron-core keys by the model's sharded keys."""

    def __init__(self, ckpt, prefix: str = ""):
        self.ckpt = ckpt
        self.dcp = DCPCheckpoint(ckpt.directory)
        self.layers = int(ckpt.args.num_layers)
        self.mla = bool(arg(ckpt.args, "multi_latent_attention"))
        self.prefix = prefix
        self.keys = [k[len(prefix):] for k in self.dcp.tensors
                     if k.startswith(prefix) and k[len(prefix):].startswith(MODEL_PREFIXES)]

    def _read(self, key: str, index=None) -> torch.Tensor:
        return self.dcp.read(self.prefix + key, index)

    def _shape(self, key: str) -> tuple:
        return self.dcp.shape(self.prefix + key)

    def part(self, layer: int, config: ModelConfig, wanted: set) -> dict:
        out = {}
        tied = not config.untie_embeddings_and_output_weights
        for key in self.keys:
            if key.startswith("decoder.layers."):
                rest = key[len("decoder.layers."):]
                match = LAYER_KEY.match(key)
                if match:  # non-homogeneous layers: one key per layer
                    if int(match.group(1)) == layer:
                        self._read_into(out, key, match.group(2), layer, (), wanted)
                elif layer >= 0:
                    if self._shape(key)[0] != self.layers:
                        raise ConfigError(f"{self.ckpt.directory}: {key} stacks {self._shape(key)[0]} layers, "
                                          f"the args say {self.layers}.")
                    # (with dense and MoE layers, a key holds some of them)
                    if self.dcp.holds(self.prefix + key, layer):
                        self._read_into(out, key, rest, layer, (layer,), wanted)
            elif layer < 0 and layer_scope(key):  # an MTP layer's (one key per layer)
                scope, rest = layer_scope(key)
                self._read_into(out, key, rest, scope, (), wanted)
            elif layer < 0:
                name = canonical_of(key, mla=self.mla)
                if name is not None and not (name == "output_layer.weight" and tied):
                    out[name] = self._read(key)
        return out

    def _read_into(self, out: dict, key: str, rest: str, layer, index: tuple, wanted: set) -> None:
        """One layer's tensor of `key` (its slice [index]; `layer`: a decoder layer's number, or an MTP layer's
        canonical prefix); experts one at a time, the wanted ones only."""
        scope = f"layers.{layer}." if isinstance(layer, int) else layer
        match = EXPERT_KEYS["dist"].match(rest)
        if match is None:
            name = canonical_of(key if scope.startswith("mtp.") else f"decoder.layers.{layer}.{rest}", mla=self.mla)
            if name is not None:
                out[name] = self._read(key, index)
            return
        for expert in range(self._shape(key)[len(index)]):
            name = expert_name(scope, expert, match.group(1), match.group(2))
            if name in wanted:
                out[name] = self._read(key, (*index, expert))
