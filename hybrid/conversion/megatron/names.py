"""Megatron's names: its checkpoint files (the legacy rank file, `release`) and its tensors' keys, local spec's and
Transformer Engine's (decoder layers, MLA, MoE experts in every spelling megatron-core saves, MTP layers), mapped to
hybrid's canonical names and back."""

from __future__ import annotations

import re
from typing import Optional

from hybrid.errors import ConfigError
from hybrid.model.naming import EXPERTS

RELEASE = "release"  # Megatron-LM's name for a checkpoint without an iteration
LEGACY_FILE = "model_optim_rng.pt"
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")

# inside decoder.layers.{i}.: Megatron's names (local spec, and Transformer Engine's fused norm + linear) -> ours
LAYER_NAMES = {
    "input_layernorm.weight": "input_norm.weight", "input_layernorm.bias": "input_norm.bias",
    "self_attention.linear_qkv.layer_norm_weight": "input_norm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_norm.bias",
    "self_attention.linear_qkv.weight": "attention.qkv.weight", "self_attention.linear_qkv.bias": "attention.qkv.bias",
    "self_attention.q_layernorm.weight": "attention.q_norm.weight",
    "self_attention.q_layernorm.bias": "attention.q_norm.bias",
    "self_attention.k_layernorm.weight": "attention.k_norm.weight",
    "self_attention.k_layernorm.bias": "attention.k_norm.bias",
    "self_attention.linear_proj.weight": "attention.dense.weight",
    "self_attention.linear_proj.bias": "attention.dense.bias",
    "pre_mlp_layernorm.weight": "post_attention_norm.weight", "pre_mlp_layernorm.bias": "post_attention_norm.bias",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_norm.weight",
    "mlp.linear_fc1.layer_norm_bias": "post_attention_norm.bias",
    "mlp.linear_fc1.weight": "mlp.fc1.weight", "mlp.linear_fc1.bias": "mlp.fc1.bias",
    "mlp.linear_fc2.weight": "mlp.fc2.weight", "mlp.linear_fc2.bias": "mlp.fc2.bias",
    # an MoE layer's router, its expert bias (a buffer: hybrid's score bias) and shared experts
    "mlp.router.weight": "mlp.router.weight", "mlp.router.expert_bias": "mlp.router.score_bias",
    "mlp.router.bias": "mlp.router.bias",  # (--add-bias-linear: GPT-OSS's)
    "self_attention.core_attention.softmax_offset": "attention.sinks",  # --softmax-type learnable
    "mlp.shared_experts.linear_fc1.weight": "mlp.shared_mlp.fc1.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_mlp.fc2.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_gate",
}
# multi-latent attention's (hybrid.model.mla), over LAYER_NAMES when the args say --multi-latent-attention: the latent
# norms are what megatron-core's q_layernorm / kv_layernorm are then (the local spec), which Transformer Engine fuses
# into the up projections; the down projections are split over TP by the local spec, whole on every rank with TE
MLA_LAYER_NAMES = {
    "self_attention.linear_q_proj.weight": "attention.q.weight",
    "self_attention.linear_q_down_proj.weight": "attention.q_down.weight",
    "self_attention.linear_q_up_proj.weight": "attention.q_up.weight",
    "self_attention.linear_kv_down_proj.weight": "attention.kv_down.weight",
    "self_attention.linear_kv_up_proj.weight": "attention.kv_up.weight",
    **{f"self_attention.{norm}_layernorm.{field}": f"attention.{norm}_down_norm.{field}"
       for norm in ("q", "kv") for field in ("weight", "bias")},
    **{f"self_attention.linear_{norm}_up_proj.layer_norm_{field}": f"attention.{norm}_down_norm.{field}"
       for norm in ("q", "kv") for field in ("weight", "bias")},
}
MLA_NORM_NAMES = {"local": {"q_down_norm": "self_attention.q_layernorm.",
                            "kv_down_norm": "self_attention.kv_layernorm."},
                  "transformer_engine": {"q_down_norm": "self_attention.linear_q_up_proj.layer_norm_",
                                         "kv_down_norm": "self_attention.linear_kv_up_proj.layer_norm_"}}
MLA_DOWN = ("attention.q_down.weight", "attention.kv_down.weight")  # (canonical, inside a layer)
BUFFERS = ("mlp.router.score_bias",)  # canonical names (inside a layer) of state that is not a parameter
GLOBAL_NAMES = {
    "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "decoder.final_layernorm.weight": "final_norm.weight", "decoder.final_layernorm.bias": "final_norm.bias",
    "output_layer.weight": "output_layer.weight",
}
# the norms as each spelling names them (writing): the local spec's modules, or TE's fused ones
NORM_NAMES = {
    "local": {"input_norm": "input_layernorm.", "post_attention_norm": "pre_mlp_layernorm."},
    "transformer_engine": {"input_norm": "self_attention.linear_qkv.layer_norm_",
                           "post_attention_norm": "mlp.linear_fc1.layer_norm_"},
}
LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# multi-token prediction (megatron-core's MultiTokenPredictionLayer, on the last stage): mtp.layers.{k}. + its norms
# and projection (MTP_NAMES), or transformer_layer. + a layer's names; ours: hybrid.model.mtp's mtp.{k}.
MTP_KEY = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
MTP_LAYER = "transformer_layer."
MTP_NAMES = {f"{theirs}.{field}": f"{ours}.{field}" for theirs, ours in (
    ("enorm", "enorm"), ("hnorm", "hnorm"), ("final_layernorm", "final_norm")) for field in ("weight", "bias")}
MTP_NAMES["eh_proj.weight"] = "eh_proj.weight"
# experts inside decoder.layers.{i}. (group 1: the expert index, local or global as the spelling has it)
EXPERT_KEYS = {  # (the weight or, with --add-bias-linear, the bias: GPT-OSS's)
    "sequential": re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_(fc[12])\.(weight|bias)$"),  # local index
    "te_grouped": re.compile(r"^mlp\.experts\.linear_(fc[12])\.(weight|bias)(\d+)$"),  # local index (groups swapped)
    "grouped": re.compile(r"^mlp\.experts\.weight([12])$"),  # every local expert in one tensor
    "dist": re.compile(r"^mlp\.experts\.experts\.linear_(fc[12])\.(weight|bias)$"),  # torch_dist: [experts, ...]
}


def megatron_layer_key(canonical_rest: str, spelling: str, mla: bool = False, moe: bool = False) -> str:
    """The name inside decoder.layers.{i}. of one of our layer parameters (`attention.qkv.weight`, ...), the
    norms spelled as `spelling` (local | transformer_engine) names them. A norm with no linear layer after it to fuse
    into stays a norm of its own (Transformer Engine's TENorm): an MoE layer's before its router, and with
    multi-latent attention the input norm."""
    module, _, field = canonical_rest.partition(".")
    if moe and module == "post_attention_norm":
        return "pre_mlp_layernorm." + field
    if module in NORM_NAMES[spelling] and not (mla and module == "input_norm"):
        return NORM_NAMES[spelling][module] + field
    if mla and module == "attention" and field.partition(".")[0] in MLA_NORM_NAMES[spelling]:
        norm, _, field = field.partition(".")
        return MLA_NORM_NAMES[spelling][norm] + field
    return (_MLA_UNNORMED if mla and canonical_rest in _MLA_UNNORMED else _UNNORMED)[canonical_rest]


_UNNORMED = {ours: theirs for theirs, ours in LAYER_NAMES.items() if not ours.startswith(tuple(NORM_NAMES["local"]))}
_UNNORMED["input_norm.weight"], _UNNORMED["input_norm.bias"] = "input_layernorm.weight", "input_layernorm.bias"
_MLA_UNNORMED = {ours: theirs for theirs, ours in MLA_LAYER_NAMES.items() if "norm" not in ours}


def megatron_global_key(name: str) -> str:
    return {ours: theirs for theirs, ours in GLOBAL_NAMES.items()}[name]


def expert_name(scope: str, expert: int, fc: str, field: str = "weight") -> str:
    """Our canonical name of one expert's fc1 / fc2 weight or bias (the expert's global index) in a layer (`scope`:
    its canonical prefix, `layers.{i}.` or an MTP layer's `mtp.{k}.layer.`)."""
    return f"{scope}mlp{EXPERTS}{expert}.{fc}.{field}"


def layer_scope(key: str, layer_offset: int = 0) -> Optional[tuple]:
    """(our prefix, the name inside the layer) of a Megatron key inside a transformer layer: a decoder layer's
    (its number + `layer_offset`) or an MTP layer's; None for other keys."""
    match = LAYER_KEY.match(key)
    if match:
        return f"layers.{int(match.group(1)) + layer_offset}.", match.group(2)
    match = MTP_KEY.match(key)
    if match and match.group(2).startswith(MTP_LAYER):
        return f"mtp.{match.group(1)}.layer.", match.group(2)[len(MTP_LAYER):]
    return None


def is_buffer(name: str) -> bool:
    return any(name.endswith("." + buffer) for buffer in BUFFERS)


def canonical_of(key: str, layer_offset: int = 0, mla: bool = False) -> Optional[str]:
    """Our canonical name of a Megatron model key (its layer number + `layer_offset`; `mla`: the checkpoint's model
    has multi-latent attention); None for state that is not a weight (`_extra_state`, the router's token counts); an
    error for a weight hybrid does not know. Expert weights are named by the readers
    (hybrid.conversion.megatron.legacy and torch_dist)."""
    if "_extra_state" in key or key.endswith("router.local_tokens_per_expert"):
        return None
    if key in GLOBAL_NAMES:
        return GLOBAL_NAMES[key]
    scope = layer_scope(key, layer_offset)
    names = {**LAYER_NAMES, **MLA_LAYER_NAMES} if mla else LAYER_NAMES
    if scope and scope[1] in names:
        return scope[0] + names[scope[1]]
    match = MTP_KEY.match(key)
    if match and match.group(2) in MTP_NAMES:
        return f"mtp.{match.group(1)}.{MTP_NAMES[match.group(2)]}"
    raise ConfigError(f"Megatron checkpoint key {key!r} is not one hybrid reads (see hybrid/conversion/"
                      f"megatron/names.py for the names it maps); the model has a part hybrid's does not.")
