"""LoRA on the model (--lora-rank): which HF projection (PEFT's `target_modules`) is which of the engine's linears,
the adapters attached to them (hybrid.parallel.lora: one per HF projection, also inside the fused QKV and gate/up
linears), their names, and the switch that turns them off (the base model: DPO's and GRPO's reference).

Adapter parameters are named `layers.{i}.{linear}.lora.{projection}.{A,B}`, e.g.
`layers.0.attention.qkv.lora.k_proj.A` (A [r, in], B [out, r] whole, as PEFT's lora_A / lora_B weights).
"""

from __future__ import annotations

import contextlib
import math
import zlib

import torch
import torch.nn as nn

from hybrid.errors import ConfigError
from hybrid.model.naming import canonical_parameters
from hybrid.parallel.lora import COLUMN, GROUPED_QKV, ROW, SINGLE, STACKED, LoRA, LoRAPiece

# HF projection -> (the linear of a transformer layer that holds it, its place in that linear's fused layout)
TARGETS = {"q_proj": ("attention.qkv", 0), "k_proj": ("attention.qkv", 1), "v_proj": ("attention.qkv", 2),
           "o_proj": ("attention.dense", 0), "gate_proj": ("mlp.fc1", 0), "up_proj": ("mlp.fc1", 1),
           "down_proj": ("mlp.fc2", 0)}
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear of the layers (not the output head)
DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default target_modules for Llama-style models
MARKER = ".lora."  # in every adapter parameter's name
# PEFT's modules_to_save (--lora-modules-to-save) -> the module whose weights then train whole
SAVED_MODULES = {"embed_tokens": "embedding.word_embeddings", "lm_head": "output_layer"}
NO_LORA = dict(lora_rank=0, lora_alpha=8.0, lora_dropout=0.0, lora_target_modules=(), lora_use_rslora=False,
               lora_modules_to_save=())  # the base model's fields


def resolve_targets(names) -> tuple:
    """--lora-target-modules as the HF projections adapted, in TARGETS' order (all-linear: all of them)."""
    names = tuple(names or DEFAULT_TARGETS)
    if ALL_LINEAR in names:
        return tuple(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise ConfigError(f"--lora-target-modules {' '.join(unknown)}: not a projection of this model; the model's "
                          f"projections are {', '.join(TARGETS)} (or {ALL_LINEAR}).")
    return tuple(n for n in TARGETS if n in names)


def scale(config) -> float:
    """The adapters' output factor: lora_alpha / r (PEFT), lora_alpha / sqrt(r) with --lora-use-rslora."""
    return config.lora_alpha / (math.sqrt(config.lora_rank) if config.lora_use_rslora else config.lora_rank)


def is_adapter(name: str) -> bool:
    """Whether a canonical parameter name is an adapter's (A or B)."""
    return MARKER in name


def trains(name: str, config) -> bool:
    """Whether a canonical parameter trains under LoRA: an adapter, or a weight of --lora-modules-to-save (under
    ZeRO-3 a table's row blocks too)."""
    return is_adapter(name) or any(name.startswith(SAVED_MODULES[m] + ".") for m in config.lora_modules_to_save)


def linear_shapes(config, role: str) -> tuple:
    """(kind, in features, {projection: full out features} in the fused layout's order, layout) of a layer's linear."""
    h, d, groups = config.hidden_size, config.head_dim, config.num_query_groups
    if role == "attention.qkv":
        return COLUMN, h, {"q_proj": config.num_attention_heads * d, "k_proj": groups * d, "v_proj": groups * d}, \
            GROUPED_QKV
    if role == "attention.dense":
        return ROW, config.num_attention_heads * d, {"o_proj": h}, SINGLE
    if role == "mlp.fc1":
        f = config.ffn_hidden_size
        if config.gated_linear_unit:
            return COLUMN, h, {"gate_proj": f, "up_proj": f}, STACKED
        return COLUMN, h, {"up_proj": f}, SINGLE
    return ROW, config.ffn_hidden_size, {"down_proj": h}, SINGLE


def check(config, tp: int = 1) -> None:
    """Every LoRA rule (ModelConfig.validate calls it when --lora-rank is set); errors name the flag."""
    targets = resolve_targets(config.lora_target_modules)
    if config.multi_latent_attention and any(TARGETS[t][0].startswith("attention.") for t in targets):
        raise ConfigError("--lora-target-modules: LoRA on multi-latent attention's projections is not implemented; "
                          "target the MLP only (gate_proj up_proj down_proj).")
    if config.dsa_indexer_loss_coeff:
        raise ConfigError("--lora-rank with --dsa-indexer-loss-coeff: LoRA freezes the base, DSA's indexer included, "
                          "which that loss trains; train the indexer without LoRA, or LoRA without the loss.")
    if config.kv_shared_layers:  # (its sharing layers project queries only, their MLPs may be twice as wide)
        raise ConfigError("--lora-rank with --num-kv-shared-layers (Gemma 4 E2B/E4B): adapters on layers of two "
                          "shapes are not implemented; fine-tune the model whole (without --lora-rank).")
    shaped_by_layer = config.global_kv_channels or config.global_num_query_groups or config.attention_k_eq_v
    if shaped_by_layer and any(TARGETS[t][0].startswith("attention.") for t in targets):
        raise ConfigError("--lora-target-modules: LoRA on the attention of a model whose full-attention layers have "
                          "their own shapes (--global-kv-channels, --global-num-query-groups, --attention-k-eq-v; "
                          "Gemma 4) is not implemented; target the MLP only (gate_proj up_proj down_proj).")
    if "gate_proj" in config.lora_target_modules and not config.gated_linear_unit:  # (all-linear: those it has)
        raise ConfigError("--lora-target-modules gate_proj: this model's MLP has no gate (not --swiglu/--geglu).")
    unknown = [m for m in config.lora_modules_to_save if m not in SAVED_MODULES]
    if unknown:
        raise ConfigError(f"--lora-modules-to-save {' '.join(unknown)}: the modules that can train whole beside the "
                          f"adapters are {' '.join(SAVED_MODULES)}.")
    if config.lora_modules_to_save and config.tied_embeddings:
        raise ConfigError("--lora-modules-to-save with tied embeddings: PEFT trains a copy of the module, which "
                          "unties the table from the head; untie them (--untie-embeddings-and-output-weights) or "
                          "train the adapters only.")
    moe = [i for i in range(config.num_layers) if config.mlp_type_of(i) == "moe"]
    if moe and any(TARGETS[t][0].startswith("mlp.") for t in targets):
        raise ConfigError(f"--lora-target-modules {' '.join(t for t in targets if TARGETS[t][0].startswith('mlp.'))}: "
                          f"layers {moe[:4]} are MoE layers, and LoRA on experts is not implemented; target the "
                          f"attention's projections (q_proj k_proj v_proj o_proj).")
    for role in dict.fromkeys(TARGETS[t][0] for t in targets):
        _, inputs, outs = linear_shapes(config, role)[:3]
        for name, out in outs.items():
            if name in targets and config.lora_rank > min(inputs, out):
                raise ConfigError(f"--lora-rank {config.lora_rank} is larger than {name}'s dimensions ({out} x "
                                  f"{inputs}): a rank above min(out, in) adds parameters, not capacity; use at most "
                                  f"{min(inputs, out)}.")


def attach(layers: dict, config, groups) -> None:
    """Attach the adapters of --lora-target-modules to each layer of `layers` ({index: TransformerLayer}), A drawn
    from a generator seeded by its canonical name (PEFT's kaiming-uniform: the same at any TP), B zero."""
    targets = resolve_targets(config.lora_target_modules)
    tp = groups.tp_size
    for i, layer in layers.items():
        for role in dict.fromkeys(TARGETS[t][0] for t in targets):
            linear = layer.get_submodule(role)
            kind, inputs, outs, layout = linear_shapes(config, role)
            name = f"layers.{i}.{role}.lora"
            pieces = {p: LoRAPiece(kind, inputs, out, config.lora_rank, scale(config), config.lora_dropout, groups,
                                   _seed(config.seed, f"{name}.{p}.A"), linear.weight.dtype, linear.weight.device)
                      for p, out in outs.items() if p in targets}
            widths = {p: out // tp if kind == COLUMN else out for p, out in outs.items()}
            shape = (config.num_attention_heads // config.num_query_groups, config.head_dim)
            linear.lora = LoRA(pieces, widths, layout, shape if layout == GROUPED_QKV else None)


def adapter_shapes(config) -> dict:
    """Canonical name -> whole shape of every adapter matrix of a model with this config."""
    targets = resolve_targets(config.lora_target_modules)
    out = {}
    for i in range(config.num_layers):
        for projection in targets:
            role = TARGETS[projection][0]
            _, inputs, outs, _ = linear_shapes(config, role)
            if projection in outs:
                name = f"layers.{i}.{role}.lora.{projection}"
                out[f"{name}.A"], out[f"{name}.B"] = (config.lora_rank, inputs), (outs[projection], config.lora_rank)
    return out


def freeze_base(model: nn.Module, config) -> None:
    """No gradient (so no optimizer state) for anything but the adapters and --lora-modules-to-save."""
    for name, param in canonical_parameters(model, config.num_layers).items():
        if not trains(name, config):
            param.requires_grad_(False)


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The base model while inside (every adapter skipped): the reference of DPO and GRPO with LoRA."""
    pieces = [m for m in model.modules() if isinstance(m, LoRAPiece)]
    for piece in pieces:
        piece.enabled = False
    try:
        yield model
    finally:
        for piece in pieces:
            piece.enabled = True


class BaseModel:
    """The model with its adapters off, forward only and in eval mode: DPO's and GRPO's reference under LoRA, so no
    second copy of the weights is held. Called as the frozen reference model is: `base(ids, stage=0)` -> logits."""

    def __init__(self, model: nn.Module):
        self.model = model

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        was_training = self.model.training
        self.model.eval()
        try:
            with adapters_off(self.model):
                return self.model(*args, **kwargs)
        finally:
            self.model.train(was_training)


def _seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)
