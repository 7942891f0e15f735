"""DeepSeek's multi-token prediction layers as its checkpoints (and GLM-4.5's) store them: model.layers.{L + k}.*
are depth k's layer (named as a decoder layer) and its own tensors (hybrid.model.mtp), read as --mtp-num-layers and
written back. A component the families that store them compose (`LlamaAdapter.stores_mtp`)."""

from __future__ import annotations

import dataclasses

from hybrid.conversion.families.adapter import get
from hybrid.model.config import ModelConfig

# a multi-token prediction layer's own tensors, model.layers.{L + k}.* -> mtp.{k}.* (hybrid.model.mtp); it also
# holds copies of the word embeddings (embed_tokens) and of the head (shared_head.head), written, not read
MTP_MAP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
           "shared_head.norm.weight": "final_norm.weight"}


def with_stored_depth(config: ModelConfig, names) -> ModelConfig:
    """The checkpoint's multi-token prediction layers (model.layers.{L + k}.eh_proj, as DeepSeek stores them)
    become --mtp-num-layers."""
    depth = 0
    while f"model.layers.{config.num_layers + depth}.eh_proj.weight" in names:
        depth += 1
    return dataclasses.replace(config, mtp_num_layers=depth) if depth else config


def mtp_to_canonical(adapter, hf_state, wanted=None) -> dict:
    """The MTP layers' canonical tensors (mtp.{k}.*), each layer read by `adapter` as decoder layer L + k; those of
    `wanted` only when given; a depth the checkpoint does not store starts from its initialisation."""
    out, c = {}, adapter.config
    for k in range(c.mtp_num_layers or 0):
        hf, ours, i = f"model.layers.{c.num_layers + k}.", f"mtp.{k}.", c.num_layers + k
        if wanted is not None and not any(n.startswith(ours) for n in wanted):
            continue
        if hf + "eh_proj.weight" not in hf_state:  # none stored: they start from their initialisation
            continue
        for theirs, name in MTP_MAP.items():
            out[ours + name] = get(hf_state, hf + theirs)
        inner = None if wanted is None else {n.replace(ours + "layer.", f"layers.{i}.") for n in wanted}
        for name, t in adapter.layer_to_canonical(hf_state, i, inner).items():
            out[ours + "layer." + name[len(f"layers.{i}."):]] = t
    return out


def mtp_to_hf(adapter, state: dict, out: dict) -> None:
    """The MTP layers' HF tensors into `out` (which holds the model's embeddings and head already)."""
    c = adapter.config
    for k in range(c.mtp_num_layers or 0):
        hf, ours, i = f"model.layers.{c.num_layers + k}.", f"mtp.{k}.", c.num_layers + k
        inner, as_layer = f"mtp.{k}.layer.", f"layers.{i}."  # MTP layer k under decoder layer L + k's names
        adapter.layer_to_hf({as_layer + n[len(inner):]: t for n, t in state.items() if n.startswith(inner)}, i, out)
        for theirs, name in MTP_MAP.items():
            out[hf + theirs] = state[ours + name]
        out[hf + "embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()  # (files hold each once)
        out[hf + "shared_head.head.weight"] = out.get("lm_head.weight", out["model.embed_tokens.weight"]).clone()
