"""HuggingFace model directories <-> canonical hybrid state dicts (the families' adapters are in
hybrid.conversion.families)."""

from __future__ import annotations

import json
import os
from typing import Callable

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file

from hybrid.checkpoint.files import atomic_directory
from hybrid.conversion.families import BY_HF_CLASS, FAMILIES, Adapter, adapter_for_model
from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig
from hybrid.safe_loading import safe_load

# ---- HF directories ----------------------------------------------------------------------------

def read_hf_config(path: str, flag: str = "--load-dir") -> ModelConfig:
    """The ModelConfig of a local HF model directory (its family recorded); unsupported architectures
    and config fields are one message naming them."""
    if not os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: no such directory.")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"{flag} {path}: no config.json; not a HuggingFace model directory.")
    with open(config_path) as f:
        architectures = json.load(f).get("architectures") or []
    adapter_cls = next((BY_HF_CLASS[a] for a in architectures if a in BY_HF_CLASS), None)
    if adapter_cls is None:
        raise ConfigError(f"{flag} {path}: architecture {architectures or 'unknown'} is not supported; "
                          f"supported: {', '.join(BY_HF_CLASS)}.")
    from transformers import AutoConfig  # transformers' import takes seconds: only for HF directories
    try:
        return adapter_cls.config_from_hf(AutoConfig.from_pretrained(path, local_files_only=True))
    except ConfigError as e:
        raise ConfigError(f"{flag} {path}: {e}") from None


def read_hf_dir(path: str, progress: Callable = None, flag: str = "--load-dir") -> tuple[dict, ModelConfig, Adapter]:
    """A local HF model directory -> (canonical full state dict in fp32, ModelConfig, adapter)."""
    config = read_hf_config(path, flag)
    adapter = FAMILIES[config.family](config)
    state = load_hf_weights(path, progress, flag)
    return {k: v.float() for k, v in adapter.to_canonical(state).items()}, config, adapter


def load_hf_weights(path: str, progress=None, flag: str = "--load-dir") -> dict:
    """safetensors (single or sharded with an index), else pytorch_model.bin with weights_only=True."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    elif os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        return safe_load(os.path.join(path, "pytorch_model.bin"))
    else:
        raise ConfigError(f"{flag} {path}: no model.safetensors, sharded index or pytorch_model.bin.")
    state = {}
    for name in (progress(files) if progress else files):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ConfigError(f"{flag} {path}: weight shard {name} listed in the index is missing.")
        state.update(load_file(file))
    return state


def write_hf_dir(state: dict, config: ModelConfig, save_dir: str, tokenizer=None, max_shard_size: str = "5GB",
                 progress: Callable = None) -> None:
    """Canonical full state -> HF directory (config, safetensors shards + index, generation config,
    tokenizer), written to a temporary directory and renamed when complete."""
    from transformers import GenerationConfig  # transformers' import takes seconds: only when exporting

    adapter = adapter_for_model(config)
    dtype = getattr(torch, config.hf_dtype or "float32")  # the imported model's dtype (fp32 for models from flags)
    hf_state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in adapter.to_hf(state).items()}
    ids = {}
    if tokenizer is not None:
        ids = {"bos_token_id": tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
               "eos_token_id": tokenizer.eos_token_id}
    with atomic_directory(save_dir) as tmp:
        hf_config = adapter.hf_config(ids)
        hf_config.dtype = config.hf_dtype or "float32"
        hf_config.save_pretrained(tmp)
        GenerationConfig(**ids).save_pretrained(tmp)
        split = split_torch_state_dict_into_shards(hf_state, filename_pattern="model{suffix}.safetensors",
                                                   max_shard_size=max_shard_size)
        files = list(split.filename_to_tensors.items())
        for filename, names in (progress(files) if progress else files):
            save_file({n: hf_state[n].contiguous() for n in names}, os.path.join(tmp, filename),
                      metadata={"format": "pt"})
        if split.is_sharded:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
