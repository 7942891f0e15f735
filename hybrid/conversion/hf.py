"""HuggingFace model directories <-> canonical hybrid state dicts (the families' adapters are in
hybrid.conversion.families)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Callable, Iterator

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file

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
        config = adapter_cls.config_from_hf(AutoConfig.from_pretrained(path, local_files_only=True))
    except ConfigError as e:
        raise ConfigError(f"{flag} {path}: {e}") from None
    return adapter_cls.with_stored_layers(config, HFTensors(path, flag))


class HFTensors(Mapping):
    """The weight tensors of a local HF model directory by name, each read from its file when asked and
    kept in the file's dtype: safetensors (one file or shards with `model.safetensors.index.json`) are
    memory-mapped and copy out only the tensor asked for; `pytorch_model.bin` (or its shards with
    `pytorch_model.bin.index.json`) loads weights-only and memory-mapped, a file when one of its tensors
    is first asked for."""

    def __init__(self, path: str, flag: str = "--load-dir"):
        self.path, self.flag = path, flag
        self.files: dict[str, str] = {}  # tensor name -> its file
        self._open: dict[str, object] = {}  # file -> safe_open handle, or the bin file's loaded dict
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if os.path.isfile(os.path.join(path, index)):
                with open(os.path.join(path, index)) as f:
                    self.files = dict(json.load(f)["weight_map"])
                break
        else:
            for single in ("model.safetensors", "pytorch_model.bin"):
                if os.path.isfile(os.path.join(path, single)):
                    self.files = {name: single for name in self._handle(single).keys()}
                    break
            else:
                raise ConfigError(f"{flag} {path}: no model.safetensors, pytorch_model.bin or sharded index "
                                  f"(model.safetensors.index.json, pytorch_model.bin.index.json).")
        for name in sorted(set(self.files.values())):
            if not os.path.isfile(os.path.join(path, name)):
                raise ConfigError(f"{flag} {path}: weight shard {name} listed in the index is missing.")

    def release(self) -> None:
        """Unmap the safetensors files read so far: their pages no longer count in this process's resident
        memory (the tensors handed out are copies); a later read maps its file again."""
        for file in [f for f in self._open if f.endswith(".safetensors")]:
            del self._open[file]

    def _handle(self, file: str):
        if file not in self._open:
            full = os.path.join(self.path, file)
            if file.endswith(".safetensors"):
                try:
                    self._open[file] = safe_open(full, framework="pt")
                except Exception as error:  # safetensors' SafetensorError (a truncated file), OSError
                    raise self._unreadable(file, error) from None
            else:
                self._open[file] = safe_load(full, mmap=True)  # its own one message for a damaged file
        return self._open[file]

    def _unreadable(self, file: str, error: Exception) -> ConfigError:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        return ConfigError(f"{self.flag} {self.path}: weight file {file} is unreadable ({first}); it is truncated or "
                           f"damaged. Download or copy it again.")

    def __getitem__(self, name: str) -> torch.Tensor:
        handle = self._handle(self.files[name])
        if not hasattr(handle, "get_tensor"):
            return handle[name]
        try:
            return handle.get_tensor(name)
        except Exception as error:  # the index lists a tensor the file lacks, or its bytes cannot be read
            raise self._unreadable(self.files[name], error) from None

    def __iter__(self):
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def __contains__(self, name) -> bool:
        return name in self.files


HASH_CHUNK = 8 << 20  # bytes read at a time while hashing weight files


def weights_hash(path: str, flag: str = "--load-hf") -> tuple[str, int]:
    """(a SHA-256 of a model directory's config.json and every byte of its weight files, the bytes hashed): what
    its weights are, for caches of values they determine (the DPO reference's log-probabilities). Every byte is
    read, so two models that differ in one row of one matrix differ here (a sample of the files let a retrained
    head or a few merged adapters through); a copy of the same files has the same hash (no paths or times)."""
    tensors = HFTensors(path, flag)
    h = hashlib.sha256()
    with open(os.path.join(path, "config.json"), "rb") as f:
        h.update(f.read())
    total = 0
    for name in sorted(set(tensors.files.values())):
        full = os.path.join(path, name)
        h.update(f"{name}:{os.path.getsize(full)}".encode())
        with open(full, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                h.update(chunk)
                total += len(chunk)
    return h.hexdigest(), total


def hf_fingerprint(path: str, flag: str = "--load-hf") -> str:
    """weights_hash's digest."""
    return weights_hash(path, flag)[0]


def read_hf_dir(path: str, progress: Callable = None, flag: str = "--load-dir") -> tuple[dict, ModelConfig, Adapter]:
    """A local HF model directory -> (canonical full state dict in fp32, ModelConfig, adapter): the whole
    model at once, for conversion (training streams it: `hf_parts`)."""
    config = read_hf_config(path, flag)
    adapter = FAMILIES[config.family](config)
    tensors = HFTensors(path, flag)
    state = adapter.globals_to_canonical(tensors)
    layers = range(config.num_layers)
    for i in (progress(layers) if progress else layers):
        state.update(adapter.layer_to_canonical(tensors, i))
    return {k: v.float() for k, v in state.items()}, config, adapter


def hf_parts(path: str, config: ModelConfig, wanted: set, flag: str = "--load-hf") -> Iterator[dict]:
    """The canonical tensors of `wanted` (this rank's parameters) from a local HF model directory, one
    part at a time in the file's dtype: the embeddings, final norm and head it needs, then each transformer
    layer it holds (of an MoE layer, only its own experts), so that no more than one part is ever read."""
    adapter = FAMILIES[config.family](config)
    tensors = HFTensors(path, flag)
    globals_part = adapter.globals_to_canonical(tensors, {n for n in wanted if not n.startswith("layers.")})
    tensors.release()
    yield globals_part
    del globals_part
    for i in sorted({int(n.split(".")[1]) for n in wanted if n.startswith("layers.")}):
        part = adapter.layer_to_canonical(tensors, i, wanted)
        tensors.release()  # the files' pages of this part leave the resident set
        yield part
        del part


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
