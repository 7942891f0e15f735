"""Megatron-LM's own checkpoints, read: the legacy `--ckpt-format torch` (`iter_N/mp_rank_TT[_PPP]/
model_optim_rng.pt`) and megatron-core's `torch_dist` (`iter_N/.metadata`, `*.distcp`, `common.pt`), at
any TP x PP they were saved at, with the local spec's or Transformer Engine's key names.

The model is the one the checkpoint's stored args describe (as Megatron-LM's own converter builds it);
its weights come a transformer layer at a time (`parts`), TP shards joined by the same per-parameter
rules as hybrid's (hybrid.checkpoint.tp_layout: megatron-core's QKV grouped per query group, fc1 of a
gated MLP as [gate; up] per TP rank, the vocabulary split over TP). The vocabulary keeps every row the
checkpoint has (Megatron's padding included, as its logits do); `true_vocab_size` drops the padding.

Mixture-of-experts checkpoints come in every spelling megatron-core saves experts: torch_dist's global
`mlp.experts.experts.linear_fc{1,2}.weight` ([experts, ...] per layer; an EP rank reads its own experts'
rows only), and in the legacy files (one per TP x PP x EP rank) SequentialMLP's
`mlp.experts.local_experts.{j}.linear_fc{1,2}.weight`, TEGroupedMLP's `mlp.experts.linear_fc{1,2}.weight{j}` and
the legacy GroupedMLP's `mlp.experts.weight1/weight2` ([h, experts x f] / [experts x f, h]); the router, its
expert bias (hybrid's score bias), and shared experts with their gate.

Multi-latent attention (MLA_LAYER_NAMES): the local spec's names and Transformer Engine's (the latent norms fused
into the up projections), the down projections whole on each TP rank (TE) or split over TP (the local spec); its
rope rows are in DeepSeek's interleaved order, as in HF's DeepSeek-V3 (hybrid.conversion.families.mla_rope).
Multi-token prediction layers: `mtp.layers.{k}.` (MTP_NAMES, and `transformer_layer.` + a layer's names), on the
last pipeline stage.
GPT-OSS's: learned sinks (`core_attention.softmax_offset`), the router's and the experts' biases (legacy files at
expert-TP 1 hold the whole experts in each TP rank's file), `--enable-gpt-oss`'s YaRN.

What is refused, by name: pre-megatron-core layouts (`language_model.`), the options hybrid's model does
not compute (erf GeLU, interleaved rotary, squared ReLU, jittered routing, Sinkhorn balancing), and in the legacy
format uneven or virtual pipeline splits and an expert TP other than TP.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import math
import os
import re
from typing import Iterator, Optional

import torch

from hybrid.checkpoint.client_state import ClientState
from hybrid.checkpoint.files import LATEST, MEGATRON_LATEST, load_file
from hybrid.conversion.megatron.dcp_files import DCPCheckpoint
from hybrid.conversion.families.mla_rope import deepseek_rope_rows
from hybrid.errors import ConfigError
from hybrid.model.config import (GPT_OSS_YARN, LLAMA3_ROPE_DEFAULTS, MLA_YARN_ORIGINAL_CONTEXT, ModelConfig,
                                 yarn_scaling)
from hybrid.model.naming import EXPERTS, buffer_names

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
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# multi-token prediction (megatron-core's MultiTokenPredictionLayer, on the last stage): mtp.layers.{k}. + its norms
# and projection (MTP_NAMES), or transformer_layer. + a layer's names; ours: hybrid.model.mtp's mtp.{k}.
_MTP_KEY = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
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
    match = _LAYER_KEY.match(key)
    if match:
        return f"layers.{int(match.group(1)) + layer_offset}.", match.group(2)
    match = _MTP_KEY.match(key)
    if match and match.group(2).startswith(MTP_LAYER):
        return f"mtp.{match.group(1)}.layer.", match.group(2)[len(MTP_LAYER):]
    return None


def is_buffer(name: str) -> bool:
    return any(name.endswith("." + buffer) for buffer in BUFFERS)


def canonical_of(key: str, layer_offset: int = 0, mla: bool = False) -> Optional[str]:
    """Our canonical name of a Megatron model key (its layer number + `layer_offset`; `mla`: the checkpoint's model
    has multi-latent attention); None for state that is not a weight (`_extra_state`, the router's token counts); an
    error for a weight hybrid does not know. Expert weights are named by the readers
    (hybrid.conversion.megatron.lm._expert_tensors)."""
    if "_extra_state" in key or key.endswith("router.local_tokens_per_expert"):
        return None
    if key in GLOBAL_NAMES:
        return GLOBAL_NAMES[key]
    scope = layer_scope(key, layer_offset)
    names = {**LAYER_NAMES, **MLA_LAYER_NAMES} if mla else LAYER_NAMES
    if scope and scope[1] in names:
        return scope[0] + names[scope[1]]
    match = _MTP_KEY.match(key)
    if match and match.group(2) in MTP_NAMES:
        return f"mtp.{match.group(1)}.{MTP_NAMES[match.group(2)]}"
    raise ConfigError(f"Megatron checkpoint key {key!r} is not one hybrid reads (see hybrid/conversion/"
                      f"megatron/lm.py for the names it maps); the model has a part hybrid's does not.")


def iteration_dir(path: str) -> Optional[str]:
    """The iteration directory a Megatron-LM checkpoint path names: a save directory (its
    `latest_checkpointed_iteration.txt` points at iter_N or `release`, and it has no hybrid `latest`), or an
    iteration directory itself; None when `path` is not a Megatron-LM checkpoint."""
    if not os.path.isdir(path):
        return None
    if _format_of(path) is not None:
        return path
    pointer = os.path.join(path, MEGATRON_LATEST)
    if not os.path.isfile(pointer) or os.path.isfile(os.path.join(path, LATEST)):
        return None
    with open(pointer) as f:
        text = f.read().strip()
    tag = RELEASE if text == RELEASE else f"iter_{int(text):07d}" if text.isdigit() else None
    if tag is None:
        raise ConfigError(f"{pointer}: expected an iteration number or 'release', found {text[:40]!r}.")
    directory = os.path.join(path, tag)
    if not os.path.isdir(directory) or _format_of(directory) is None:
        raise ConfigError(f"{path}: {MEGATRON_LATEST} names {tag}, but {directory} holds no Megatron checkpoint "
                          f"(no .metadata, no mp_rank_*/{LEGACY_FILE}); the checkpoint is incomplete.")
    return directory


def _format_of(directory: str) -> Optional[str]:
    if os.path.isfile(os.path.join(directory, ".metadata")) or os.path.isfile(os.path.join(directory, "metadata.json")):
        return "torch_dist"
    if glob.glob(os.path.join(directory, "mp_rank_*", LEGACY_FILE)):
        return "torch"
    return None


@dataclasses.dataclass
class MegatronSource:
    """What both Megatron readers share (Megatron-LM's here, Megatron-DeepSpeed's in
    hybrid.conversion.megatron.megatron_deepspeed): the stored args (Megatron-LM's spelling) and counters."""

    directory: str  # the iteration (or tag) directory
    args: argparse.Namespace
    common: dict  # iteration, checkpoint_version, opt_param_scheduler, ...

    @property
    def iteration(self) -> int:
        return int(self.common.get("iteration", 0) or 0)

    @property
    def consumed_samples(self) -> int:
        return int(getattr(self.args, "consumed_train_samples", 0) or 0)

    def state(self, config: ModelConfig, progress=None) -> dict:
        """Every canonical tensor (the routers' score biases too, when the model has them)."""
        return whole_state(self, config)

    def client_state(self) -> ClientState:
        """What a hybrid checkpoint converted from it records: the counters and the run's args."""
        return ClientState(iteration=self.iteration, consumed_samples=self.consumed_samples,
                           args=megatron_run_args(self.args))

    @property
    def layout(self) -> tuple[int, int]:
        """The TP x PP it was saved at."""
        return (int(getattr(self.args, "tensor_model_parallel_size", 1) or 1),
                int(getattr(self.args, "pipeline_model_parallel_size", 1) or 1))


@dataclasses.dataclass
class MegatronCheckpoint(MegatronSource):
    """One Megatron-LM checkpoint: its format, stored args and counters; `config()`, `parts()`."""

    kind = "megatron-lm"  # (hybrid.conversion.source)

    format: str = "torch"  # "torch" (legacy) | "torch_dist"

    @property
    def has_optimizer(self) -> bool:
        return "optimizer" in self.common or bool(glob.glob(os.path.join(self.directory, "mp_rank_*",
                                                                          "distrib_optim.pt")))

    def config(self, true_vocab_size: Optional[int] = None) -> ModelConfig:
        return config_from_args(self.args, true_vocab_size, self.directory)

    def optimizer(self) -> "MegatronOptimizer":
        """What of Megatron's optimizer state can be mapped (see MegatronOptimizer)."""
        return _optimizer_of(self)

    def parts(self, config: ModelConfig, wanted: Optional[set] = None, kind: str = "model") -> Iterator[dict]:
        """Canonical full tensors, a part at a time: the embeddings, final norm and head, then each layer
        (of `wanted` only when given: a rank's parameters, its experts among them, and the routers' score
        biases when asked for), in the checkpoint's dtype, vocabulary rows cut to config.vocab_size.
        `kind`: the weights ("model"), or one of the optimizer's tensors (OPTIMIZER_KINDS; torch_dist)."""
        if kind == "model":
            reader = _DistParts(self) if self.format == "torch_dist" else _LegacyParts(self)
        else:
            reader = _DistParts(self, f"{OPTIMIZER_PREFIX}{kind}.")
        return stream_parts(reader, config, wanted, self.directory)


def _stores_own_head(ckpt: "MegatronCheckpoint") -> bool:
    """Whether a checkpoint whose args do not say if the output layer is tied holds a head of its own: megatron-core
    saves no output layer for a tied model at PP 1 (torch_dist: never), and on a later stage the tied copy equals
    the embedding (TP rank 0's shards compared). Without this, a trained head was dropped and the export tied."""
    if ckpt.format == "torch_dist":
        return "output_layer.weight" in DCPCheckpoint(ckpt.directory).tensors
    files = _legacy_files(ckpt.directory, ckpt.args)
    heads = [_legacy_model(path).get("output_layer.weight") for t, _, e, path in files if t == 0 and e == 0]
    heads = [h for h in heads if h is not None]
    if not heads:
        return False
    first = _legacy_model(files[0][3]).get("embedding.word_embeddings.weight")
    return first is None or first.shape != heads[-1].shape or not torch.equal(first, heads[-1])


def stream_parts(reader, config: ModelConfig, wanted: Optional[set], directory: str) -> Iterator[dict]:
    """A reader's parts (`reader.part(layer, config, wanted)`: -1 for the tensors outside the layers), of
    `wanted` only (default: every parameter), vocabulary rows cut to config.vocab_size; an error naming what
    the checkpoint lacks."""
    expected = _expected(config)
    names = set(expected) | buffer_names(config)
    wanted = set(expected) if wanted is None else wanted & names
    seen = set()
    for layer in [-1, *range(config.num_layers)]:
        part = {name: tensor for name, tensor in reader.part(layer, config, wanted).items() if name in wanted}
        for name, tensor in part.items():
            if expected.get(name) and tensor.size(0) > config.vocab_size:
                part[name] = tensor[: config.vocab_size]
        seen.update(part)
        if part:
            yield deepseek_rope_rows(part, config, to_halves=True)  # (MLA's: megatron-core keeps DeepSeek's order)
    missing = sorted(wanted - seen)
    if missing:
        raise ConfigError(f"{directory}: the checkpoint lacks {missing[:5]}; its args describe another model than "
                          f"its weights (or it is incomplete).")


def whole_state(source, config: ModelConfig) -> dict:
    """Every canonical tensor of a source's parts (the routers' score biases too, when the model has them)."""
    state = {}
    for part in source.parts(config, set(_expected(config)) | buffer_names(config)):
        state.update(part)
    return state


OPTIMIZER_PREFIX = "optimizer.state."  # megatron-core's model-space optimizer tensors: PREFIX + kind + "." + model key
MOMENTS = ("exp_avg", "exp_avg_sq")
MASTERS = ("fp32_param", "param")  # the fp32 master weights: Float16Optimizer's, the distributed optimizer's


@dataclasses.dataclass
class MegatronOptimizer:
    """Megatron's Adam state as hybrid can map it: megatron-core's model-space form in torch_dist
    (`optimizer.state.{exp_avg,exp_avg_sq}.<model key>`, and the fp32 masters as `fp32_param` / `param`
    when the model is not fp32 itself), written by its FP32Optimizer / Float16Optimizer and by the
    distributed optimizer with --dist-ckpt-optim-fully-reshardable. `problem`: why it cannot be
    mapped (the log says so and Adam starts fresh), else None."""

    problem: Optional[str] = None
    master: Optional[str] = None  # the kind holding fp32 masters; None: the model's weights are the masters
    step: int = 0  # Adam's step count
    groups: tuple = ()  # ((lr, betas, eps, weight_decay) of the decayed group, and of the others)


def _optimizer_of(ckpt: "MegatronCheckpoint") -> MegatronOptimizer:
    common = ckpt.common
    if ckpt.format != "torch_dist":
        stored = "holds" if ckpt.has_optimizer else "holds no"
        return MegatronOptimizer(problem=f"the legacy format {stored} optimizer state; hybrid maps megatron-core's "
                                         f"model-space optimizer state of --ckpt-format torch_dist (re-save with "
                                         f"--ckpt-format torch_dist --dist-ckpt-optim-fully-reshardable)")
    keys = DCPCheckpoint(ckpt.directory).metadata.state_dict_metadata
    kinds = {k[len(OPTIMIZER_PREFIX):].split(".", 1)[0] for k in keys if k.startswith(OPTIMIZER_PREFIX)}
    if not set(MOMENTS) <= kinds:
        sharded = any(k.startswith("optimizer.distributed.") for k in keys)
        why = ("the distributed optimizer's buffers (Megatron-LM's default dp_reshardable form), which only "
               "Megatron-LM at the same TP / PP reads; re-save with --dist-ckpt-optim-fully-reshardable"
               if sharded else "no Adam moments")
        return MegatronOptimizer(problem=f"the checkpoint holds {why}")
    step = _optimizer_step(common.get("optimizer"))
    if step is None:
        return MegatronOptimizer(problem="its optimizer records no single step count")
    groups = _optimizer_groups(common.get("optimizer"))
    master = next((k for k in MASTERS if k in kinds), None)
    if master is None and (_arg(ckpt.args, "bf16") or _arg(ckpt.args, "fp16")):
        return MegatronOptimizer(problem="its optimizer state has no fp32 master weights")
    return MegatronOptimizer(master=master, step=step, groups=groups)


def _optimizer_states(node) -> Iterator[dict]:
    """Every optimizer state dict (one with param_groups) in common.pt's `optimizer` (chained: nested)."""
    if isinstance(node, dict):
        if isinstance(node.get("param_groups"), list):
            yield node
        for value in node.values():
            if isinstance(value, (dict, list)):
                yield from _optimizer_states(value)
    elif isinstance(node, list):
        for value in node:
            yield from _optimizer_states(value)


def _optimizer_step(node) -> Optional[int]:
    """The step count every parameter shares: FP32/Float16Optimizer's `common_step`, the distributed
    optimizer's per-group `step`."""
    steps = set()
    for state in _optimizer_states(node):
        inner = state.get("state") if isinstance(state.get("state"), dict) else {}
        if "common_step" in inner:
            steps.add(int(inner["common_step"]))
        steps.update(int(g["step"]) for g in state["param_groups"] if isinstance(g, dict) and "step" in g)
    return steps.pop() if len(steps) == 1 else None


def _optimizer_groups(node) -> tuple:
    """((lr, betas, eps, weight decay) of the decayed parameters, and of the others): the hyperparameters
    Megatron's scheduler left in its groups (weight decay x wd_mult, 0 on biases and norms)."""
    groups = [g for state in _optimizer_states(node) for g in state["param_groups"] if isinstance(g, dict)]
    if not groups:
        return ()

    def hyper(g):
        return (float(g.get("lr", 0.0)), tuple(g.get("betas", (0.9, 0.999))), float(g.get("eps", 1e-8)),
                float(g.get("weight_decay", 0.0)))
    decayed = next((g for g in groups if float(g.get("wd_mult", 1.0)) != 0.0), groups[0])
    others = next((g for g in groups if float(g.get("wd_mult", 1.0)) == 0.0), None)
    return (hyper(decayed), hyper(others) if others else hyper(decayed)[:3] + (0.0,))


def _expected(config: ModelConfig) -> dict:
    """Canonical names of the model -> whether the tensor has vocabulary rows."""
    # not at the top: loads the model and DeepSpeed (args need neither)
    from hybrid.checkpoint.tp_layout import tp_layout
    return {name: rule.vocab_padded for name, rule in tp_layout(config).items()}


def open_megatron(path: str, flag: str = "--load") -> MegatronCheckpoint:
    directory = iteration_dir(path)
    if directory is None:
        raise ConfigError(f"{flag} {path}: not a Megatron-LM checkpoint (no {MEGATRON_LATEST} pointing at an "
                          f"iter_N directory with .metadata or mp_rank_*/{LEGACY_FILE}).")
    fmt = _format_of(directory)
    if fmt == "torch_dist":
        common_path = os.path.join(directory, "common.pt")
        if not os.path.isfile(common_path):
            raise ConfigError(f"{directory}: no common.pt; the torch_dist checkpoint is incomplete (it holds the "
                              f"run's args).")
        common = _load(common_path)
    else:
        common = _load(sorted(glob.glob(os.path.join(directory, "mp_rank_*", LEGACY_FILE)))[0], mmap=True)
        common = {k: v for k, v in common.items() if not k.startswith("model")}
    args = common.get("args")
    if not isinstance(args, argparse.Namespace):
        raise ConfigError(f"{directory}: the checkpoint stores no args (Megatron-LM's --no-save-args?); hybrid "
                          f"builds the model from them, as Megatron-LM's converter does.")
    if float(common.get("checkpoint_version", 3.0) or 0) < 3.0:
        raise ConfigError(f"{directory}: checkpoint_version {common.get('checkpoint_version')} is the layout before "
                          f"megatron-core (language_model.encoder.*); load and save it once with a recent "
                          f"Megatron-LM, then convert.")
    ckpt = MegatronCheckpoint(directory=directory, format=fmt, args=args, common=common)
    if not hasattr(args, "untie_embeddings_and_output_weights"):  # args of an older Megatron-LM: the files say
        args.untie_embeddings_and_output_weights = _stores_own_head(ckpt)
    return ckpt


def _load(path: str, mmap: bool = False):
    return load_file(path, mmap=mmap)  # one message for a missing, truncated or damaged file


def _arg(args, name, default=None):
    return getattr(args, name, default)


def config_from_args(args: argparse.Namespace, true_vocab_size: Optional[int] = None, where: str = "") -> ModelConfig:
    """The model Megatron-LM's args describe (its argparse names), or one message naming what hybrid does
    not compute."""
    def refuse(what: str, why: str):
        raise ConfigError(f"{where}: the checkpoint's model has {what}, which hybrid's model does not compute "
                          f"({why}).")
    for name, why in REFUSED_ARGS.items():  # (first: a model hybrid does not build may lack the shape args too)
        value = _arg(args, name)
        if value not in (None, False, 0, [], ()) and not _refusal_is_default(name, value):
            refuse(f"--{name.replace('_', '-')} {value}", why)
    missing = [name for name in REQUIRED_ARGS if _arg(args, name) is None]
    if missing:
        raise ConfigError(f"{where}: the checkpoint's args lack {', '.join(missing)}, which the model's shape needs "
                          f"(saved with --no-save-args, or edited?); hybrid builds the model from them, as "
                          f"Megatron-LM's converter does.")
    if _arg(args, "rotary_interleaved"):
        refuse("--rotary-interleaved", "rotary embeddings rotate halves, as transformers' Llama")
    if _arg(args, "squared_relu"):
        refuse("--squared-relu", "the MLP is SwiGLU, GeGLU or tanh-GeLU")
    if _arg(args, "heterogeneous_layers_config_path") or _arg(args, "heterogeneous_layers_config_encoded_json"):
        refuse("heterogeneous layers", "every layer has the same shape")
    swiglu, quick = bool(_arg(args, "swiglu", False)), bool(_arg(args, "quick_geglu", False))
    bias = bool(_arg(args, "add_bias_linear", True))
    if (not swiglu and not quick and not _arg(args, "openai_gelu")
            and not (bias and _arg(args, "bias_gelu_fusion", True))):
        refuse("the exact (erf) GeLU", "the GeLU MLP is the tanh approximation, which Megatron computes with "
               "--openai-gelu or with its fused bias + GeLU (--add-bias-linear, bias_gelu_fusion)")
    heads = int(args.num_attention_heads)
    kv_channels = _arg(args, "kv_channels")
    if kv_channels and int(kv_channels) * heads == int(args.hidden_size):
        kv_channels = None
    mla = bool(_arg(args, "multi_latent_attention"))
    rope = _arg(args, "position_embedding_type", "learned_absolute") in ("rope", "yarn") or \
        bool(_arg(args, "use_rotary_position_embeddings")) or mla or bool(_arg(args, "enable_gpt_oss"))
    if not rope and (_arg(args, "position_embedding_type") == "none" or _arg(args, "add_position_embedding") is False):
        refuse("no position embedding (--no-position-embedding without rotary embeddings)",
               "positions come from a learned table or rotary embeddings")
    if mla and (_arg(args, "rope_type") or "yarn") != "yarn" and (_arg(args, "use_rope_scaling") or
                                                                  _arg(args, "rotary_seq_len_interpolation_factor")):
        refuse("--use-rope-scaling / --rotary-seq-len-interpolation-factor with MLA's --rope-type rope",
               "megatron-core's MLA builds its rope without them, so the checkpoint's model never applied them")
    rope_scaling = _megatron_yarn(args, mla)
    if rope_scaling is not None and (_arg(args, "use_rope_scaling")
                                     or _arg(args, "rotary_seq_len_interpolation_factor")):
        refuse("YaRN with --use-rope-scaling / --rotary-seq-len-interpolation-factor", "one rope scaling per model")
    if rope_scaling is not None:
        pass
    elif _arg(args, "use_rope_scaling"):
        rope_scaling = {"rope_type": "llama3", "factor": float(_arg(args, "rope_scaling_factor", 8.0)),
                        **LLAMA3_ROPE_DEFAULTS}
    elif _arg(args, "rotary_seq_len_interpolation_factor"):
        rope_scaling = {"rope_type": "linear", "factor": float(args.rotary_seq_len_interpolation_factor)}
    rows = int(_arg(args, "padded_vocab_size") or 0)
    if not rows:
        raise ConfigError(f"{where}: the checkpoint's args have no padded_vocab_size (the embedding's rows).")
    if true_vocab_size is not None and not 0 < true_vocab_size <= rows:
        raise ConfigError(f"--true-vocab-size {true_vocab_size}: must be between 1 and the checkpoint's "
                          f"{rows} embedding rows.")
    window = _arg(args, "window_size")
    skip_freq = _arg(args, "window_attn_skip_freq", None)  # Megatron's: every N-th layer full, or 1 = windowed
    dtype = "bfloat16" if _arg(args, "bf16") else "float16" if _arg(args, "fp16") else None
    return ModelConfig(
        num_layers=int(args.num_layers), hidden_size=int(args.hidden_size), num_attention_heads=heads,
        vocab_size=true_vocab_size or rows,
        max_position_embeddings=int(_arg(args, "max_position_embeddings") or _arg(args, "seq_length")),
        ffn_hidden_size=_arg(args, "ffn_hidden_size"),
        num_query_groups=int(args.num_query_groups) if _arg(args, "group_query_attention") and not mla else None,
        position_embedding_type="rope" if rope else "learned_absolute",
        rotary_base=float(_arg(args, "rotary_base", 10000)),
        rotary_percent=float(_arg(args, "rotary_percent", 1.0) or 1.0),
        normalization=_arg(args, "normalization", "LayerNorm"),
        norm_epsilon=float(_arg(args, "norm_epsilon", None) or _arg(args, "layernorm_epsilon", None) or 1e-5),
        swiglu=swiglu, add_bias_linear=bias, quick_geglu=quick,
        glu_linear_offset=float(_arg(args, "glu_linear_offset", 0.0) or 0.0),
        activation_func_clamp_value=_arg(args, "activation_func_clamp_value"),
        attention_sinks=_arg(args, "softmax_type", "vanilla") == "learnable",
        untie_embeddings_and_output_weights=bool(_arg(args, "untie_embeddings_and_output_weights", False)),
        hidden_dropout=float(_arg(args, "hidden_dropout", 0.1)),
        attention_dropout=0.0 if _arg(args, "softmax_type") == "learnable" else  # (sinks run without it here)
        float(_arg(args, "attention_dropout", 0.1)),
        init_method_std=float(_arg(args, "init_method_std", 0.02)), kv_channels=None if mla else kv_channels,
        add_qkv_bias=bool(_arg(args, "add_qkv_bias", False)), qk_layernorm=bool(_arg(args, "qk_layernorm", False)),
        sliding_window=None if not window or window[0] == -1 else int(window[0]) + 1, rope_scaling=rope_scaling,
        window_attn_skip_freq=skip_freq if window and window[0] != -1 else None,
        apply_layernorm_1p=bool(_arg(args, "apply_layernorm_1p", False) or _arg(args, "layernorm_zero_centered_gamma")),
        make_vocab_size_divisible_by=int(_arg(args, "make_vocab_size_divisible_by", 128) or 128), hf_dtype=dtype,
        mtp_num_layers=int(_arg(args, "mtp_num_layers", 0) or 0) or None,
        mtp_loss_scaling_factor=float(_arg(args, "mtp_loss_scaling_factor", None) if
                                      _arg(args, "mtp_loss_scaling_factor", None) is not None else 0.1),
        **_mla_fields(args, mla), **_moe_fields(args, refuse))


def _megatron_yarn(args: argparse.Namespace, mla: bool) -> Optional[dict]:
    """YaRN as megatron-core computes it: MLA's rope (--rope-type, default yarn) from its MLATransformerConfig
    (--rotary-scaling-factor, --mscale, --mscale-all-dim; its original context and betas are the config's
    defaults, which no argument sets), or --position-embedding-type yarn from the --yarn-* arguments."""
    if _arg(args, "enable_gpt_oss"):  # Megatron-LM's post-training switch: GPT-OSS's YaRN, set on the model's config
        return yarn_scaling(*GPT_OSS_YARN)
    if mla and (_arg(args, "rope_type") or "yarn") == "yarn":
        return yarn_scaling(float(_arg(args, "rotary_scaling_factor", 1.0) or 1.0), MLA_YARN_ORIGINAL_CONTEXT,
                            mscale=float(_arg(args, "mscale", 1.0)),
                            mscale_all_dim=float(_arg(args, "mscale_all_dim", 0.0)))
    if _arg(args, "position_embedding_type") != "yarn":
        return None
    round_to_int = _arg(args, "yarn_correction_range_round_to_int")
    return yarn_scaling(float(_arg(args, "rotary_scaling_factor", 1.0) or 1.0),
                        int(_arg(args, "yarn_original_max_position_embeddings") or MLA_YARN_ORIGINAL_CONTEXT),
                        float(_arg(args, "yarn_beta_fast") or 32.0), float(_arg(args, "yarn_beta_slow") or 1.0),
                        float(_arg(args, "mscale", 1.0)), float(_arg(args, "mscale_all_dim", 0.0)),
                        True if round_to_int is None else bool(round_to_int))


def megatron_rope_args(config: ModelConfig) -> dict:
    """Megatron-LM's args for the model's YaRN rope (the inverse of _megatron_yarn: MLA's --rope-type yarn, else
    --position-embedding-type yarn with the --yarn-* arguments), and MLA's --rope-type; {} for other ropes. An error
    where Megatron-LM's arguments cannot say it (MLA's YaRN has a fixed original context and betas)."""
    scaling = config.rope_scaling or {}
    mla = config.multi_latent_attention
    if mla and scaling and scaling.get("rope_type") != "yarn":
        raise ConfigError(f"the model's MLA rope has {scaling.get('rope_type')} scaling, which megatron-core's MLA "
                          f"does not compute (its rope is plain or YaRN, --rope-type); export with --saver hf instead.")
    if scaling.get("rope_type") != "yarn":
        return {"rope_type": "rope"} if mla else {}
    factor = float(scaling["factor"])
    if "mscale_all_dim" in scaling:
        mscale, all_dim = float(scaling["mscale"]), float(scaling["mscale_all_dim"])
    elif "attention_factor" in scaling and factor > 1:  # (yarn_mscale inverted)
        mscale, all_dim = (float(scaling["attention_factor"]) - 1.0) / (0.1 * math.log(factor)), 0.0
    else:
        mscale, all_dim = 1.0, 0.0
    args = dict(rotary_scaling_factor=factor, mscale=mscale, mscale_all_dim=all_dim)
    if mla:
        args["rope_type"] = "yarn"
    else:
        args.update(position_embedding_type="yarn",
                    yarn_original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                    yarn_beta_fast=float(scaling["beta_fast"]), yarn_beta_slow=float(scaling["beta_slow"]),
                    yarn_correction_range_round_to_int=bool(scaling.get("truncate", True)))
    back = _megatron_yarn(argparse.Namespace(**args), mla)
    if set(back) != set(scaling) or any(not math.isclose(float(back[k]), float(scaling[k]), rel_tol=1e-12)
                                        if isinstance(back[k], (int, float)) else back[k] != scaling[k] for k in back):
        raise ConfigError(f"the model's YaRN rope {scaling} has no Megatron-LM arguments that say it (they read back "
                          f"as {back}; " + (f"MLA's YaRN is megatron-core's MLATransformerConfig's, with original "
                                            f"context {MLA_YARN_ORIGINAL_CONTEXT} and betas 32 / 1" if mla else
                                            "--yarn-* cover factor, original context, betas, mscale") +
                          "); export with --saver hf instead.")
    return args


def _mla_fields(args: argparse.Namespace, mla: bool) -> dict:
    """Multi-latent attention's sizes (Megatron-LM's names, as hybrid's flags)."""
    if not mla:
        return {}
    return dict(multi_latent_attention=True, q_lora_rank=_arg(args, "q_lora_rank"),
                kv_lora_rank=int(_arg(args, "kv_lora_rank", 32)), qk_head_dim=int(_arg(args, "qk_head_dim", 128)),
                qk_pos_emb_head_dim=int(_arg(args, "qk_pos_emb_head_dim", 64)),
                v_head_dim=int(_arg(args, "v_head_dim", 128)))


# the args without which no model can be built (one message, not an AttributeError)
REQUIRED_ARGS = ("num_layers", "hidden_size", "num_attention_heads")
# Megatron-LM's args that change the model's mathematics in ways hybrid's model does not compute, each refused by
# name with why (a value that is the argument's "off" value passes); the args it maps are read by
# config_from_args and _moe_fields below, and tests/test_megatron_checkpoints.py gives every one of them a value
# other than its default
REFUSED_ARGS = {  # (names as megatron-core's TransformerConfig and Megatron-LM's arguments.py spell them)
    "no_rope_freq": "rotary embeddings left out of some layers; hybrid rotates every layer",
    "mtp_hsm": "hidden-state mixing across the multi-token prediction depths",
    "mtp_use_repeated_layer": "one multi-token prediction layer repeated over the depths",
    "mtp_hybrid_override_pattern": "a hybrid (Mamba) multi-token prediction layer",
    "mtp_detach_heads": "multi-token prediction heads detached from the embeddings and output layer",
    "experimental_attention_variant": "an attention other than softmax attention (gated delta net, DSA)",
    "linear_attention_freq": "linear attention layers among the softmax ones",
    "hybrid_override_pattern": "a hybrid (Mamba / attention) layer pattern",
    "softmax_type": "a softmax with an offset of one (off-by-one); learned sinks (learnable) are read",
    "attention_output_gate": "a gate on the attention output",
    "qk_l2_norm": "L2-normalized queries and keys",
    "hybrid_layer_pattern": "a hybrid (Mamba / attention) layer pattern",
    "is_hybrid_model": "a hybrid (Mamba / attention) model",
    "use_fused_weighted_squared_relu": "squared-ReLU experts weighted before the activation",
    "moe_apply_probs_on_input": "router probabilities applied to the experts' input",
    "moe_mlp_glu_interleave_size": "experts whose gate and up rows are interleaved in blocks",
    "moe_shared_expert_glu_interleave_size": "a shared expert whose gate and up rows are interleaved in blocks",
    "moe_expert_rank_capacity_factor": "tokens dropped over a per-rank budget",
    "moe_router_force_biased": "random biases on the router's logits",
    "moe_router_padding_for_quantization": "routing padded for quantized experts",
    "moe_router_quantile_balancing_ema": "quantile-balancing expert biases",
    "apply_residual_connection_post_layernorm": "residuals taken after the layer norm",
    "use_mup": "muP's scaled embeddings, attention and output",
    "enable_mhc_connections": "manifold hyper-connections",
    "mrope_section": "multimodal rotary sections",
    "spec": "a layer spec of the run's own",
}
_OFF_VALUES = {"softmax_type": ("vanilla", "learnable"), "experimental_attention_variant": ("none",)}

# The rest of Megatron-LM's arguments that could describe the model (those of its parser groups "network size",
# "transformer configuration", "mla", "moe", "experimental", "heterogeneous architecture" and
# "experimental_attention_variant"), each with why it leaves a checkpoint's model as config_from_args reads it:
# how the model is computed or run (kernels, parallelism, memory, precision), training alone, another model kind,
# or a setting that only acts with an argument refused above. With the names config_from_args reads and
# REFUSED_ARGS this covers every such argument of Megatron-LM's parser (tests/test_megatron_args_real.py, against
# the table its own parser gives: tests/fixtures/megatron_lm_args/arguments.json).
NOT_MODEL_ARGS = {
    "parallelism and communication (the same model at any layout)": (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
        "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
        "hierarchical_context_parallel_sizes", "hybrid_context_parallel", "max_seqlen_per_dp_cp_rank",
        "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
        "microbatch_group_size_per_vp_stage", "overlap_p2p_comm_warmup_flush", "pipeline_model_parallel_comm_backend",
        "use_ring_exchange_p2p", "symmetric_ar_type", "tp_comm_bootstrap_backend", "tp_comm_bulk_dgrad",
        "tp_comm_bulk_wgrad", "tp_comm_overlap", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
        "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_split_rs", "tensor_parallel_num_weight_shards",
        "expert_tensor_parallel_num_weight_shards", "gtp_remat_opt_in_modules", "high_priority_a2a_comm_stream",
        "ep_overlap_early_attn_memory_release", "overlap_moe_expert_parallel_comm",
        "overlap_dispatch_backward_with_experts_wgrad", "moe_token_dispatcher_type", "moe_enable_deepep",
        "moe_deepep_num_sms", "moe_flex_dispatcher_backend", "moe_flex_dispatcher_num_sms",
        "moe_hybridep_num_blocks_permute", "moe_hybridep_num_blocks_unpermute", "moe_hybridep_num_sms",
        "moe_hybridep_num_sms_preprocessing", "moe_hybridep_pad_uneven_dispatch_inputs", "moe_ncclep_zero_copy",
        "moe_shared_expert_overlap", "megatron_fsdp_enable_fine_grained_param_gather", "megatron_fsdp_grad_comm_dtype",
        "megatron_fsdp_main_grads_dtype", "megatron_fsdp_main_params_dtype", "megatron_fsdp_max_pool_double_buffer",
        "fsdp_db_use_persist_buf_on_alloc_fail"),
    "kernels and fusions computing the same mathematics": (
        "attention_backend", "flash_attention_version", "transformer_impl", "use_te_activation_func",
        "use_transformer_engine_op_fuser", "use_kitchen_attention", "kitchen_attention_backend",
        "cross_entropy_fusion_impl", "cross_entropy_loss_fusion", "fused_residual_rmsnorm", "moe_permute_fusion",
        "moe_permute_fusion_into_hybridep", "moe_router_fusion", "moe_use_grouped_tensor", "moe_single_grouped_bias",
        "moe_single_grouped_weight", "use_grouped_gemm_for_dense_mlp", "use_grouped_gemm_for_shared_expert",
        "mlp_chunks_for_training", "mlp_chunks_for_prefill", "batch_invariant_backend", "batch_invariant_mode",
        "deterministic_mode", "mla_down_proj_fusion", "use_mamba_mem_eff_path", "gdp_cutedsl_kernel",
        "dsa_kernel_backend", "apply_query_key_layer_scaling"),
    "memory: recomputation, offloading, initialization placement": (
        "recompute_granularity", "recompute_method", "recompute_modules", "recompute_num_layers",
        "distribute_saved_activations", "moe_layer_recompute", "cpu_offloading_num_layers",
        "cpu_offloading_retain_pinned_cpu_buffers", "activation_offload_fraction", "fine_grained_activation_offloading",
        "fine_grained_offloading_max_inflight_offloads", "offload_modules", "min_offloaded_tensor_size",
        "delta_offload_bytes_across_pp_ranks", "delay_offload_until_cuda_graph", "moe_paged_stash",
        "moe_paged_stash_buffer_size_factor_cpu", "moe_paged_stash_buffer_size_factor_cuda",
        "moe_paged_stash_page_size", "defer_embedding_wgrad_compute", "delay_wgrad_compute", "wgrad_deferral_limit",
        "clone_scatter_output_in_embedding", "init_model_with_meta_device", "use_cpu_initialization",
        "perform_initialization", "gdp_num_chunk_states_to_recompute", "mhc_recompute_layer_num"),
    "CUDA graphs and inference serving": (
        "cuda_graph_impl", "cuda_graph_warmup_steps", "enable_cuda_graph", "external_cuda_graph",
        "inference_cuda_graph_scope", "inference_disable_triton_nvls_kernels", "inference_fuse_tp_communication",
        "inference_grouped_gemm_backend", "inference_moe_disable_fused_quant_kernels",
        "inference_moe_token_dispatcher_type", "flash_decode", "nccl_all_reduce_for_prefill",
        "moe_pad_experts_for_cuda_graph_inference", "cache_mla_latents"),
    "precision: the run's own (hybrid's --bf16 / --fp16 / --fp8-format); the checkpoint's weights are the same": (
        "fp8", "fp8_recipe", "fp8_margin", "fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo",
        "fp8_wgrad", "fp8_output_proj", "fp8_quantizer_factory", "fp4", "fp4_recipe", "fp4_quantizer_factory",
        "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
        "disable_bf16_reduced_precision_matmul", "fp32_residual_connection",
        "moe_combine_bwd_dtype", "moe_dispatch_fwd_dtype", "main_grads_dtype", "main_params_dtype", "exp_avg_dtype",
        "exp_avg_sq_dtype", "use_precision_aware_optimizer"),
    "training alone (the loss's reduction, initialization, optimizer-side clipping, logging, upcycling)": (
        "calculate_per_token_loss", "embedding_init_method_std", "qk_clip", "qk_clip_alpha", "qk_clip_threshold",
        "moe_enable_routing_replay", "moe_per_layer_logging", "config_logger_dir", "moe_use_upcycling",
        "moe_upcycling_granularity", "enable_experimental", "yaml_cfg"),
    "BERT and T5 models (hybrid reads GPT models)": (
        "bert_binary_head", "encoder_num_layers", "decoder_num_layers", "relative_attention_max_distance",
        "relative_attention_num_buckets", "onnx_safe"),
    "where the multi-token prediction layers run (a pipeline placement)": ("mtp_standalone",),
    "read with --position-embedding-type yarn (_megatron_yarn; megatron-core's MLA takes its config's defaults)": (
        "yarn_beta_fast", "yarn_beta_slow", "yarn_correction_range_round_to_int",
        "yarn_original_max_position_embeddings"),
    "only with --experimental-attention-variant or --linear-attention-freq (refused)": (
        "dsa_indexer_head_dim", "dsa_indexer_k_norm_epsilon", "dsa_indexer_k_norm_fp32", "dsa_indexer_loss_coeff",
        "dsa_indexer_n_heads", "dsa_indexer_rope_interleaved", "dsa_indexer_rotate_activation",
        "dsa_indexer_scoring_relu", "dsa_indexer_skip_topk_offset", "dsa_indexer_topk", "dsa_indexer_topk_freq",
        "dsa_indexer_use_sparse_loss", "gdp_num_householder", "linear_conv_kernel_dim", "linear_key_head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim"),
    "only with a hybrid (Mamba) layer pattern (refused)": (
        "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "mamba_state_dim"),
    "only with --use-mup or --enable-mhc-connections (refused)": (
        "mup_attn_scale_power", "mup_base_head_dim", "mup_base_hidden_size", "mup_embedding_mult", "mup_output_mult",
        "mup_width_mult", "mhc_init_gating_factor", "mhc_num_residual_streams", "mhc_sinkhorn_iterations"),
}


def _refusal_is_default(name: str, value) -> bool:
    """Whether a refused argument holds the value that means "off" (Megatron stores some as strings or 1.0)."""
    return value in _OFF_VALUES.get(name, ())


def _moe_fields(args: argparse.Namespace, refuse) -> dict:
    """The ModelConfig fields of Megatron-LM's MoE args (the same names, as hybrid's flags have them)."""
    experts = _arg(args, "num_experts") or _arg(args, "num_moe_experts")
    if not experts:
        return {}
    for name, why in (("moe_input_jitter_eps", "input jitter"), ("moe_router_force_load_balancing", "forced routing"),
                      ("moe_latent_size", "latent MoE projections"), ("moe_router_padding_for_fp8", "FP8 padding")):
        if _arg(args, name):
            refuse(f"--{name.replace('_', '-')} {_arg(args, name)}", f"{why} is not implemented")
    balancing = _arg(args, "moe_router_load_balancing_type", "aux_loss")
    coeff = _arg(args, "moe_aux_loss_coeff", 0.0)
    # Megatron-LM's parser takes a list of each (nargs="+"): one element is that one loss
    balancing, coeff = (v[0] if isinstance(v, (list, tuple)) and len(v) == 1 else v for v in (balancing, coeff))
    if isinstance(balancing, (list, tuple)) or isinstance(coeff, (list, tuple)):
        refuse(f"--moe-router-load-balancing-type {balancing}", "one balancing loss per router")
    if balancing not in ("aux_loss", "seq_aux_loss", "none"):
        refuse(f"--moe-router-load-balancing-type {balancing}", "aux_loss, seq_aux_loss or none")
    freq = _arg(args, "moe_layer_freq", 1)
    return dict(
        num_experts=int(experts), moe_layer_freq=list(freq) if isinstance(freq, (list, tuple)) else int(freq),
        moe_ffn_hidden_size=_arg(args, "moe_ffn_hidden_size"), moe_router_topk=int(_arg(args, "moe_router_topk", 2)),
        moe_router_score_function=_arg(args, "moe_router_score_function", "softmax") or "softmax",
        moe_router_pre_softmax=bool(_arg(args, "moe_router_pre_softmax", False)),
        moe_router_topk_scaling_factor=_arg(args, "moe_router_topk_scaling_factor"),
        moe_router_num_groups=_arg(args, "moe_router_num_groups"),
        moe_router_group_topk=_arg(args, "moe_router_group_topk"),
        moe_router_load_balancing_type=balancing, moe_aux_loss_coeff=float(coeff or 0.0),
        moe_z_loss_coeff=_arg(args, "moe_z_loss_coeff"),
        moe_router_enable_expert_bias=bool(_arg(args, "moe_router_enable_expert_bias", False)),
        moe_router_dtype=_arg(args, "moe_router_dtype"),  # (fp64: refused by ModelConfig, one message)
        moe_router_bias_update_rate=float(_arg(args, "moe_router_bias_update_rate", 1e-3) or 1e-3),
        moe_shared_expert_intermediate_size=_arg(args, "moe_shared_expert_intermediate_size"),
        moe_shared_expert_gate=bool(_arg(args, "moe_shared_expert_gate", False)),
        moe_expert_capacity_factor=_arg(args, "moe_expert_capacity_factor"),
        moe_token_drop_policy=_arg(args, "moe_token_drop_policy", "probs") or "probs",
        moe_pad_expert_input_to_capacity=bool(_arg(args, "moe_pad_expert_input_to_capacity", False))
        and _arg(args, "moe_expert_capacity_factor") is not None,
        moe_grouped_gemm=bool(_arg(args, "moe_grouped_gemm", False)))


def megatron_run_args(args: argparse.Namespace) -> dict:
    """A Megatron-LM run's args as hybrid records a run's flags (the same names; plain values only), so an
    export finds its tokenizer and --use-checkpoint-args its architecture."""
    out = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
    out["disable_bias_linear"] = not bool(getattr(args, "add_bias_linear", True))
    return out


# the architecture flags a run's own flags may not contradict (launch/train.py --load, evaluate.py):
# flag namespace attribute -> the stored args' attribute
ARCHITECTURE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups",
                      "normalization", "swiglu", "untie_embeddings_and_output_weights", "position_embedding_type",
                      "qk_layernorm", "add_qkv_bias", "rotary_base", "rotary_percent", "max_position_embeddings",
                      "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                      "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                      "v_head_dim", "mtp_num_layers")


def contradictions(flags: argparse.Namespace, defaults: dict, args: argparse.Namespace) -> list[str]:
    """The architecture flags given (not left at their defaults) whose values differ from the checkpoint's."""
    out = []
    for name in ARCHITECTURE_FLAGS:
        given, stored = getattr(flags, name, None), getattr(args, name, None)
        if given is None or given == defaults.get(name) or stored is None:
            continue
        if name == "position_embedding_type" and getattr(args, "use_rotary_position_embeddings", False):
            stored = "rope"
        if type(stored)(given) != stored:
            out.append(f"--{name.replace('_', '-')} {given} (the checkpoint: {stored})")
    if getattr(flags, "disable_bias_linear", False) and getattr(args, "add_bias_linear", True):
        out.append("--disable-bias-linear (the checkpoint has biases)")
    return out


# --- the legacy format: one file per TP x PP (x EP) rank -------------------------------------------


def _legacy_files(directory: str, args: argparse.Namespace) -> list:
    """[(tp_rank, pp_rank, ep_rank, path)] of a legacy checkpoint's files, sorted. Megatron-LM names them
    mp_rank_TT, then _PPP when PP > 1, then _EEE when EP > 1 (so the args say which field is which)."""
    pipeline = int(_arg(args, "pipeline_model_parallel_size", 1) or 1) > 1
    expert = int(_arg(args, "expert_model_parallel_size", 1) or 1) > 1
    files = []
    for path in glob.glob(os.path.join(directory, "mp_rank_*", LEGACY_FILE)):
        fields = [int(f) for f in os.path.basename(os.path.dirname(path))[len("mp_rank_"):].split("_")]
        if len(fields) != 1 + pipeline + expert:
            raise ConfigError(f"{path}: the directory name does not fit the checkpoint's args (PP "
                              f"{_arg(args, 'pipeline_model_parallel_size', 1)}, EP "
                              f"{_arg(args, 'expert_model_parallel_size', 1)}).")
        files.append((fields[0], fields[1] if pipeline else 0, fields[-1] if expert else 0, path))
    return sorted(files)


def _legacy_dir_name(tp_rank: int, pp_rank: int, ep_rank: int, pp: int, ep: int) -> str:
    """Megatron-LM's directory of one legacy rank file (see _legacy_files)."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")


def _expert_pieces(rest: str, first: int, local: int) -> list:
    """[(global expert, fc, field, tensor -> that expert's [out, in] weight or its bias)] of one legacy expert key
    (the name inside its layer), or [] when the key is not an expert's. `first`: this EP rank's first expert."""
    for spelling, pattern in EXPERT_KEYS.items():
        match = pattern.match(rest)
        if match is None or spelling == "dist":
            continue
        if spelling == "sequential":
            return [(first + int(match.group(1)), match.group(2), match.group(3), lambda t: t)]
        if spelling == "te_grouped":
            return [(first + int(match.group(3)), match.group(1), match.group(2), lambda t: t)]
        if match.group(1) == "1":  # [h, experts x out]: expert j is view(E, h, out)[j], transposed
            return [(first + j, "fc1", "weight", lambda t, j=j: t.view(local, t.size(0), -1)[j].t())
                    for j in range(local)]
        return [(first + j, "fc2", "weight", lambda t, j=j: t.view(local, -1, t.size(1))[j].t()) for j in range(local)]
    return []


def _join_expert(name: str, shards: list, config: ModelConfig) -> torch.Tensor:
    """An expert's weight or bias from its expert-TP shards: fc1's by rows ([gate; up] per shard when gated), fc2's
    weight by columns and its bias whole on every shard, as Megatron splits a dense MLP (hybrid's experts are whole
    on every rank)."""
    from hybrid.parallel.layers import unshard  # (it loads DeepSpeed: only when reading weights)
    if len(shards) == 1 or name.endswith("fc2.bias"):
        return shards[0]
    if name.endswith(("fc1.weight", "fc1.bias")):
        return unshard(shards, 0, 2 if config.gated_linear_unit else 1)
    return unshard(shards, 1)


class _LegacyParts:
    def __init__(self, ckpt: MegatronCheckpoint):
        self.ckpt = ckpt
        args = ckpt.args
        self.files = _legacy_files(ckpt.directory, args)
        # the layout the stored args declare, not the files found: a missing rank's file must not shrink it
        self.tp, self.pp, self.ep = (int(_arg(args, f"{axis}_model_parallel_size", 1) or 1)
                                     for axis in ("tensor", "pipeline", "expert"))
        found = {(t, p, e) for t, p, e, _ in self.files}
        wanted = {(t, p, e) for t in range(self.tp) for p in range(self.pp) for e in range(self.ep)}
        if found != wanted:
            missing = [os.path.join(_legacy_dir_name(t, p, e, self.pp, self.ep), LEGACY_FILE)
                       for t, p, e in sorted(wanted - found)]
            odd = [path for t, p, e, path in self.files if (t, p, e) not in wanted]
            raise ConfigError(f"{ckpt.directory}: the args declare TP {self.tp} x PP {self.pp} x EP {self.ep}; "
                              + (f"missing {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}" if missing
                                 else "") + ("; " if missing and odd else "")
                              + (f"not of that layout: {', '.join(odd[:6])}" if odd else "")
                              + ". The checkpoint is incomplete: copy every rank's file, then convert.")
        if _arg(args, "virtual_pipeline_model_parallel_size") or _arg(args, "num_layers_per_virtual_pipeline_stage"):
            raise ConfigError(f"{ckpt.directory}: a legacy checkpoint of an interleaved (virtual) pipeline is not "
                              f"read; save it once as --ckpt-format torch_dist (global layer numbers), then convert.")
        if _arg(args, "decoder_first_pipeline_num_layers") or _arg(args, "decoder_last_pipeline_num_layers"):
            raise ConfigError(f"{ckpt.directory}: a legacy checkpoint with an uneven pipeline split is not read; save "
                              f"it once as --ckpt-format torch_dist, then convert.")
        if int(args.num_layers) % self.pp:
            raise ConfigError(f"{ckpt.directory}: {args.num_layers} layers do not split evenly over PP {self.pp}.")
        experts = int(_arg(args, "num_experts") or 0)
        etp = int(_arg(args, "expert_tensor_parallel_size") or self.tp)
        # expert-TP 1 at EP 1 (biased experts, GPT-OSS's, need it): every TP rank's file holds the whole experts
        self.whole_experts = bool(experts) and etp == 1 and self.ep == 1
        if experts and etp != self.tp and not self.whole_experts:
            raise ConfigError(f"{ckpt.directory}: a legacy MoE checkpoint with --expert-tensor-parallel-size {etp} "
                              f"and TP {self.tp} is not read (its files interleave expert ranks over TP); save it once "
                              f"as --ckpt-format torch_dist, then convert.")
        local = experts // self.ep if experts else 0
        self.mla = bool(_arg(args, "multi_latent_attention"))
        self.per_stage = int(args.num_layers) // self.pp
        self.index = {}  # canonical name -> [(path, key, tp rank, tensor -> the weight)]
        for tp_rank, pp_rank, ep_rank, path in self.files:
            offset = pp_rank * self.per_stage
            for key in _legacy_model(path):
                scope = layer_scope(key, offset)
                pieces = _expert_pieces(scope[1], ep_rank * local, local) if scope and experts else []
                for expert, fc, field, pick in ([] if self.whole_experts and tp_rank else pieces):
                    name = expert_name(scope[0], expert, fc, field)
                    self.index.setdefault(name, []).append((path, key, tp_rank, pick))
                if pieces or ep_rank > 0:  # other weights are in every EP rank's file: EP rank 0's are read
                    continue
                name = canonical_of(key, offset, self.mla)
                if name is not None and not (name == "output_layer.weight" and not
                                             _arg(args, "untie_embeddings_and_output_weights", False)):
                    if name == "embedding.word_embeddings.weight" and pp_rank > 0:
                        continue  # the last stage's copy of a tied table
                    self.index.setdefault(name, []).append((path, key, tp_rank, None))

    def part(self, layer: int, config: ModelConfig, wanted: set) -> dict:
        from hybrid.conversion.layout import merge_shards  # (layout imports DeepSpeed: only when reading)
        mine = {name: places for name, places in self.index.items() if name in wanted and
                (name.startswith(f"layers.{layer}.") if layer >= 0 else not name.startswith("layers."))}
        opened, shards, whole = {}, {}, {}
        for name, places in mine.items():
            for path, key, tp_rank, pick in places:
                if path not in opened:
                    opened[path] = _legacy_model(path)
                tensor = opened[path][key]
                shards.setdefault(name, {})[tp_rank] = tensor if pick is None else pick(tensor)
        for name in [n for n in shards if EXPERTS in n or is_buffer(n) or n.endswith(MLA_DOWN)]:  # joined here, not
            by_rank = shards.pop(name)                                                      # by the TP layout
            ordered = [by_rank[r] for r in sorted(by_rank)]
            whole[name] = _join_expert(name, ordered, config) if EXPERTS in name else \
                _join_latent_down(name, ordered, config, self.ckpt.directory) if not is_buffer(name) else ordered[0]
        full = dataclasses.replace(config, vocab_size=_rows(self.ckpt))  # rows are cut in parts()
        return {**merge_shards(shards, full, self.tp, self.ckpt.directory, dtype=None), **whole}


def _join_latent_down(name: str, shards: list, config: ModelConfig, directory: str) -> torch.Tensor:
    """An MLA down projection from its legacy files: whole in each (Transformer Engine's TELinear, duplicated), or
    split by rows over TP (the local spec's ColumnParallelLinear)."""
    rows = config.q_lora_rank if name.endswith("q_down.weight") else config.kv_lora_rank + config.qk_pos_emb_head_dim
    if shards[0].size(0) == rows:
        return shards[0]
    joined = torch.cat(shards)
    if joined.size(0) != rows:
        raise ConfigError(f"{directory}: {name}'s TP shards hold {joined.size(0)} rows, the args say {rows}.")
    return joined


def _rows(ckpt: MegatronCheckpoint) -> int:
    return int(ckpt.args.padded_vocab_size)


def _legacy_model(path: str) -> dict:
    """A legacy file's model weights by key (memory-mapped); one message for an unreadable file."""
    content = _load(path, mmap=True)
    models = [k for k in content if re.fullmatch(r"model\d*", k)]
    if models != ["model"]:
        raise ConfigError(f"{path}: holds {models or 'no model'}; expected one 'model' (an interleaved pipeline's "
                          f"model0, model1, ... are not read in the legacy format).")
    model = content["model"]
    if any(k.startswith("language_model.") for k in model):
        raise ConfigError(f"{path}: the layout before megatron-core (language_model.encoder.*); load and save it "
                          f"once with a recent Megatron-LM, then convert.")
    return {k: v for k, v in model.items() if torch.is_tensor(v)}


# --- torch_dist: global tensors, every layer's weight of one kind stacked ---------------------------


class _DistParts:
    """A torch_dist checkpoint's model tensors, or (`prefix` "optimizer.state.exp_avg." and so on) the
    optimizer's tensors of one kind, which megatron-core keys by the model's sharded keys."""

    def __init__(self, ckpt: MegatronCheckpoint, prefix: str = ""):
        self.ckpt = ckpt
        self.dcp = DCPCheckpoint(ckpt.directory)
        self.layers = int(ckpt.args.num_layers)
        self.mla = bool(_arg(ckpt.args, "multi_latent_attention"))
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
                match = _LAYER_KEY.match(key)
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
