"""The interface every HF family's adapter declares (torchtitan's protocols/state_dict_adapter.py), the base
class the families build on, and the small pieces they share (a tensor's presence and shape, a refusal, a gated
MLP's projections)."""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig


class StateDictAdapter(Protocol):
    """What hybrid.conversion.hf and the registry ask of a family: its config both ways, its state dict both ways
    (the whole model, or one layer / the tensors outside the layers, so a rank reads only its part)."""

    family: ClassVar[str]  # the name recorded in checkpoints (ModelConfig.family)
    hf_class: ClassVar[str]  # transformers' model class (config.json's architectures)
    options: ClassVar[str]  # README: what the family maps to
    refused: ClassVar[str]  # README: what is refused
    config: ModelConfig

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig: ...

    @classmethod
    def with_stored_layers(cls, config: ModelConfig, names) -> ModelConfig: ...

    def check_exportable(self) -> None: ...

    def hf_config(self, tokenizer_ids: dict): ...

    def to_canonical(self, hf_state) -> dict: ...

    def globals_to_canonical(self, hf_state, wanted=None) -> dict: ...

    def layer_to_canonical(self, hf_state, i: int, wanted=None) -> dict: ...

    def to_hf(self, state: dict) -> dict: ...


def expect(name: str, tensor: torch.Tensor, shape: tuple) -> torch.Tensor:
    """`tensor` after checking it has the shape config.json implies."""
    if tuple(tensor.shape) != tuple(shape):
        raise ConfigError(f"HF tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(shape)} from "
                          f"config.json.")
    return tensor


def get(state: dict, name: str) -> torch.Tensor:
    """The HF tensor `name`, or one message naming it."""
    if name not in state:
        raise ConfigError(f"HF checkpoint lacks tensor {name}.")
    return state[name]


def dtype_of(hf):
    """The HF config's dtype as a name ("bfloat16"), or None."""
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    if dtype is None:
        return None
    name = str(dtype).replace("torch.", "")
    return name if name in ("float32", "bfloat16", "float16") else None


def refuse(family: str, field: str, value, why: str):
    """One message for a config field this family's model does not implement."""
    raise ConfigError(f"{family} config field {field}={value!r} is not supported: {why}.")


def require(hf_class: str, wanted: dict) -> None:
    """Raise naming every option of `wanted` (what -> whether the model has it) the export to `hf_class` lacks."""
    missing = [what for what, ok in wanted.items() if not ok]
    if missing:
        raise ConfigError(f"exporting to {hf_class} needs {', '.join(missing)}.")


class Adapter:
    """Maps one HF family's state dict and config to ours and back (StateDictAdapter's base)."""

    family: ClassVar[str]
    hf_class: ClassVar[str]
    options: ClassVar[str]
    refused: ClassVar[str]

    def __init__(self, config: ModelConfig):
        self.config = config

    @classmethod
    def with_stored_layers(cls, config: ModelConfig, names) -> ModelConfig:
        """The config with what the checkpoint's tensor `names` add to config.json (DeepSeek's MTP layers)."""
        return config

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        raise NotImplementedError

    def check_exportable(self) -> None:
        """Raise if the model has an option this family cannot express."""

    def hf_config(self, tokenizer_ids: dict):
        raise NotImplementedError

    def to_canonical(self, hf_state) -> dict:
        """The whole model's canonical tensors from an HF state (a dict, or a lazy mapping that reads each
        tensor when asked: hybrid.conversion.hf.HFTensors)."""
        out = self.globals_to_canonical(hf_state)
        for i in range(self.config.num_layers):
            out.update(self.layer_to_canonical(hf_state, i))
        return out

    def globals_to_canonical(self, hf_state, wanted=None) -> dict:
        """The tensors outside the transformer layers (embeddings, final norm, output head), those of
        `wanted` (canonical names) only when given."""
        raise NotImplementedError

    def layer_to_canonical(self, hf_state, i: int, wanted=None) -> dict:
        """Transformer layer `i`'s canonical tensors (reading only that layer's HF tensors; of an MoE layer's
        experts only those in `wanted`, canonical names, when given)."""
        raise NotImplementedError

    def to_hf(self, state: dict) -> dict:
        raise NotImplementedError


def gated_to_canonical(hf_state, hf_prefix: str, ours: str, out: dict,
                       names=("gate_proj", "up_proj", "down_proj")) -> None:
    """A gated MLP's gate/up/down projections -> fc1 = [gate; up], fc2."""
    gate, up, down = (get(hf_state, f"{hf_prefix}{n}.weight") for n in names)
    out[f"{ours}fc1.weight"], out[f"{ours}fc2.weight"] = torch.cat([gate, up], dim=0), down


def gated_to_hf(state: dict, ours: str, hf_prefix: str, out: dict, names=("gate_proj", "up_proj", "down_proj")) -> None:
    """fc1 = [gate; up] and fc2 -> a gated MLP's gate/up/down projections."""
    gate, up = state[f"{ours}fc1.weight"].chunk(2, dim=0)
    for n, t in zip(names, (gate, up, state[f"{ours}fc2.weight"])):
        out[f"{hf_prefix}{n}.weight"] = t.contiguous()
