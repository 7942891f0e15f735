"""PEFT's LoRA adapter directories (`adapter_config.json` + `adapter_model.safetensors`) <-> the model's adapters
(hybrid.model.lora), and adapters merged into the base weights (PEFT's merge_and_unload).

PEFT names an adapter's tensors by the HF module they adapt: `base_model.model.model.layers.{i}.self_attn.q_proj.
lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]); ours are `layers.{i}.attention.qkv.lora.q_proj.A` / `.B`,
the same matrices whole. Only safetensors are read: an `adapter_model.bin` is a pickle, and nothing hybrid loads may
execute code."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from hybrid.checkpoint.files import atomic_directory
from hybrid.conversion.families import adapter_for_model
from hybrid.conversion.families.llama import LlamaAdapter
from hybrid.errors import ConfigError
from hybrid.model import lora
from hybrid.model.config import ModelConfig
from hybrid.model.qkv import fuse_qkv

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers."
HF_MODULE = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
             "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
             "down_proj": "mlp.down_proj"}  # a Llama-style layer's module of each projection
# PEFT's keys of the modules_to_save it writes (the `modules_to_save.<adapter>.` part dropped), by module
SAVED_KEYS = {"embed_tokens": "base_model.model.model.embed_tokens.weight",
              "lm_head": "base_model.model.lm_head.weight"}


def read_config(directory: str) -> dict:
    """An adapter directory's adapter_config.json, checked to be a LoRA this model can hold; one message if not."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"--load-lora {directory}: no {CONFIG_FILE} there; give a directory PEFT's save_pretrained "
                          f"wrote (adapter_config.json + adapter_model.safetensors).")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"--load-lora {path}: not readable as JSON ({error}).") from None
    unsupported = {"peft_type": (config.get("peft_type"), "LORA"), "bias": (config.get("bias", "none"), "none"),
                   "use_dora": (bool(config.get("use_dora")), False),
                   "fan_in_fan_out": (bool(config.get("fan_in_fan_out")), False),
                   "rank_pattern": (config.get("rank_pattern") or None, None),
                   "alpha_pattern": (config.get("alpha_pattern") or None, None),
                   "layers_to_transform": (config.get("layers_to_transform"), None)}
    for key, (value, wanted) in unsupported.items():
        if value != wanted:
            raise ConfigError(f"--load-lora {path}: {key} is {value!r}; hybrid reads plain LoRA adapters "
                              f"({key} {wanted!r}).")
    saved = [m for m in config.get("modules_to_save") or () if m not in lora.SAVED_MODULES]
    if saved:
        raise ConfigError(f"--load-lora {path}: modules_to_save names {', '.join(saved)}; hybrid trains "
                          f"{' and '.join(lora.SAVED_MODULES)} whole beside the adapters, no other module.")
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets != lora.ALL_LINEAR:
        raise ConfigError(f"--load-lora {path}: target_modules is the pattern {targets!r}; hybrid reads a list of "
                          f"projection names ({', '.join(lora.TARGETS)}) or {lora.ALL_LINEAR!r}.")
    return config


def flags_of(config: dict) -> dict:
    """The ModelConfig LoRA fields an adapter_config.json decides."""
    targets = config.get("target_modules") or ()
    targets = (lora.ALL_LINEAR,) if targets == lora.ALL_LINEAR else tuple(sorted(targets))
    return {"lora_rank": int(config["r"]), "lora_alpha": float(config.get("lora_alpha", 8)),
            "lora_dropout": float(config.get("lora_dropout", 0.0)),
            "lora_target_modules": lora.resolve_targets(targets), "lora_use_rslora": bool(config.get("use_rslora")),
            "lora_modules_to_save": tuple(sorted(config.get("modules_to_save") or ()))}


def read_adapter(directory: str, config: ModelConfig) -> dict:
    """The adapter's tensors under our canonical names (whole), each checked against the model's shape."""
    path = os.path.join(directory, WEIGHTS_FILE)
    if not os.path.isfile(path):
        pickle = os.path.join(directory, "adapter_model.bin")
        why = (f"only {pickle}, a pickle: loading it could run code; save it with safe_serialization=True"
               if os.path.isfile(pickle) else "no such file")
        raise ConfigError(f"--load-lora {path}: {why}.")
    stored = load_file(path)
    out = to_canonical(stored, config, directory)
    wanted = _shapes(config)
    missing = sorted(set(wanted) - set(out))
    if missing:
        raise ConfigError(f"--load-lora {directory}: the adapter lacks {len(missing)} of the model's adapter "
                          f"matrices (first: {missing[0]}); its target_modules differ from --lora-target-modules?")
    return out


def to_canonical(stored: dict, config: ModelConfig, where: str = "the adapter") -> dict:
    """PEFT's keys -> ours, shapes checked (a mismatch: an adapter trained on another base)."""
    by_module = {module: projection for projection, module in HF_MODULE.items()}
    wanted = _shapes(config)
    saved = {SAVED_KEYS[m]: f"{lora.SAVED_MODULES[m]}.weight" for m in config.lora_modules_to_save}
    out = {}
    for key, tensor in stored.items():
        if key in saved:  # a module of modules_to_save, whole
            if tuple(tensor.shape) != wanted[saved[key]]:
                raise ConfigError(f"--load-lora {where}: {key} has shape {tuple(tensor.shape)} but this base model's "
                                  f"takes {wanted[saved[key]]}: an adapter trained on another base model.")
            out[saved[key]] = tensor
            continue
        if not key.startswith(PREFIX):
            raise ConfigError(f"--load-lora {where}: tensor {key} is not a layer projection's adapter.")
        layer, rest = key[len(PREFIX):].split(".", 1)
        module, _, kind = rest.rpartition(".lora_")
        if module not in by_module or kind not in ("A.weight", "B.weight"):
            raise ConfigError(f"--load-lora {where}: tensor {key} adapts a module this model does not have as a "
                              f"projection ({', '.join(HF_MODULE.values())}).")
        projection = by_module[module]
        name = f"layers.{layer}.{lora.TARGETS[projection][0]}.lora.{projection}.{kind[0]}"
        if name not in wanted:
            raise ConfigError(f"--load-lora {where}: tensor {key} is not among the adapted projections of this "
                              f"model (--lora-target-modules, --num-layers).")
        if tuple(tensor.shape) != wanted[name]:
            raise ConfigError(f"--load-lora {where}: {key} has shape {tuple(tensor.shape)} but this base model's "
                              f"{projection} takes {wanted[name]}: an adapter trained on another base model.")
        out[name] = tensor
    return out


def peft_named(config: ModelConfig) -> bool:
    """Whether the model's HF family names its projections as PEFT's keys here do (Llama's: self_attn.q_proj, ...,
    mlp.gate_proj, ...; GPT-2's fused c_attn does not; nor does a model built from flags that no family expresses)."""
    try:
        return isinstance(adapter_for_model(config), LlamaAdapter)
    except ConfigError:  # (no family exports it: check_peft_named says so where a directory is asked for)
        return False


def check_peft_named(config: ModelConfig, what: str) -> None:
    """One message where an adapter directory cannot name this model's projections."""
    if not peft_named(config):
        raise ConfigError(f"{what}: the {config.family} family's HF modules are not named as Llama's "
                          f"(self_attn.q_proj, mlp.gate_proj, ...), so a PEFT adapter directory of this model is not "
                          f"written here; export the merged model with --saver hf.")


def peft_key(name: str) -> str:
    """PEFT's key of one of our adapter matrices (layers.0.attention.qkv.lora.k_proj.A ->
    base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight)."""
    _, layer, rest = name.split(".", 2)
    projection, matrix = rest.split(".lora.", 1)[1].split(".")
    return f"{PREFIX}{layer}.{HF_MODULE[projection]}.lora_{matrix}.weight"


def to_peft(state: dict, config: ModelConfig) -> dict:
    """Our adapter tensors (whole), and the modules of --lora-modules-to-save (their vocabulary rows) -> PEFT's keys."""
    out = {peft_key(name): tensor.contiguous() for name, tensor in state.items() if lora.is_adapter(name)}
    for module in config.lora_modules_to_save:
        out[SAVED_KEYS[module]] = state[f"{lora.SAVED_MODULES[module]}.weight"][:config.vocab_size].contiguous()
    return out


def adapter_config(config: ModelConfig, base_model: str) -> dict:
    """adapter_config.json as PEFT writes it for these adapters (what PeftModel.from_pretrained reads)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": config.lora_rank, "lora_alpha": config.lora_alpha, "lora_dropout": config.lora_dropout,
            "target_modules": sorted(lora.resolve_targets(config.lora_target_modules)),
            "use_rslora": config.lora_use_rslora, "use_dora": False, "bias": "none", "fan_in_fan_out": False,
            "init_lora_weights": True, "modules_to_save": list(config.lora_modules_to_save) or None,
            "inference_mode": True}


def write_adapter(state: dict, config: ModelConfig, directory: str, base_model: str, replace: bool = False) -> None:
    """A PEFT adapter directory from a whole canonical state's adapters (atomic: written aside, then renamed;
    `replace`: over a directory already there, as a checkpoint saved again replaces its files)."""
    with atomic_directory(directory, replace=replace, flag="--save-dir") as tmp:
        save_file(to_peft(state, config), os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "pt"})
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(adapter_config(config, base_model), f, indent=2)


def merged(state: dict, config: ModelConfig) -> dict:
    """The base weights with each adapter's s B A added (PEFT's merge_and_unload), the adapters gone."""
    out = {name: tensor for name, tensor in state.items() if not lora.is_adapter(name)}
    s = lora.scale(config)
    for i in range(config.num_layers):
        for role in dict.fromkeys(lora.TARGETS[t][0] for t in lora.resolve_targets(config.lora_target_modules)):
            _, inputs, outs, layout = lora.linear_shapes(config, role)
            deltas = []
            for projection, rows in outs.items():
                a = state.get(f"layers.{i}.{role}.lora.{projection}.A")
                b = state.get(f"layers.{i}.{role}.lora.{projection}.B")
                deltas.append(torch.zeros(rows, inputs) if a is None else (b.float() @ a.float()) * s)
            if layout == lora.GROUPED_QKV:
                delta = fuse_qkv(*deltas, config.num_query_groups)
            else:
                delta = torch.cat(deltas, dim=0)
            weight = out[f"layers.{i}.{role}.weight"]
            out[f"layers.{i}.{role}.weight"] = (weight.float() + delta).to(weight.dtype)
    return out


def _shapes(config: ModelConfig) -> dict:
    """Canonical name -> whole shape of everything an adapter directory holds for this model: the adapter matrices
    and the weights of --lora-modules-to-save."""
    out = lora.adapter_shapes(config)
    for module in config.lora_modules_to_save:
        out[f"{lora.SAVED_MODULES[module]}.weight"] = (config.vocab_size, config.hidden_size)
    return out
