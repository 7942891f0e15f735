"""Megatron-DeepSpeed's checkpoints, read: DeepSpeed's files of its GPT model, with the pipeline engine
(GPTModelPipe: `layer_NN-model_TT-model_states.pt`, one per layer spec and TP rank: the embedding, the
transformer layers in order, the final norm, an untied output layer's `lm_head`) or without it
(`--no-pipeline-parallel`: `mp_rank_TT_model_states.pt`'s `module`, `language_model.embedding.*`,
`language_model.encoder.layers.N.*`, `language_model.encoder.final_layernorm.*`,
`language_model.output_layer.*`), at any TP x PP.

Megatron-DeepSpeed keeps Megatron-LM's pre-core names (`query_key_value`, `dense_h_to_4h`, ...) and its args
spell some options differently (`normalization rmsnorm`, `num_key_value_heads`, `use_rotary_position_
embeddings`, `layernorm_epsilon`); both are translated here, and the model is built from the translated
args by Megatron-LM's rules (hybrid.conversion.megatron.args.config_from_args). Its fused QKV changed layout
once: up to its FPDT change (December 2024) each TP rank holds megatron-core's grouped layout ([q heads of
a KV group, k, v] per group), after it [all q | all k | all v] (`ds_sequence_parallel_fpdt` in the stored
args marks that version), regrouped here. Weights, the iteration and the consumed samples come across;
its ZeRO optimizer partitions do not (Adam starts fresh, the log says so). DeepSpeed MoE checkpoints are
refused by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
from typing import Iterator, Optional

import torch

from hybrid.checkpoint.files import LATEST, load_file, read_tag
from hybrid.conversion.megatron.args import config_from_args
from hybrid.conversion.megatron.lm import MegatronSource, stream_parts
from hybrid.conversion.megatron.optimizer import MegatronOptimizer
from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig

FORMAT = "megatron-deepspeed"
# inside a transformer layer: Megatron-DeepSpeed's names -> ours
LAYER_NAMES = {
    "input_layernorm": "input_norm", "self_attention.query_key_value": "attention.qkv",
    "self_attention.dense": "attention.dense", "post_attention_layernorm": "post_attention_norm",
    "mlp.dense_h_to_4h": "mlp.fc1", "mlp.dense_4h_to_h": "mlp.fc2",
}
_PIPE_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")
_MODEL_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt$")


def checkpoint_dir(path: str) -> Optional[str]:
    """The tag directory of a Megatron-DeepSpeed checkpoint `path` names (its save directory, whose `latest`
    names a tag, or the tag directory itself); None when `path` is not one (hybrid's own checkpoints record
    their model, Megatron-DeepSpeed's its args)."""
    if not os.path.isdir(path):
        return None
    directory = path
    if not glob.glob(os.path.join(path, "mp_rank_*_model_states.pt")):
        tag = read_tag(path, LATEST) if os.path.isfile(os.path.join(path, LATEST)) else None
        if tag is None:
            return None
        directory = os.path.join(path, tag)
    files = sorted(glob.glob(os.path.join(directory, "mp_rank_*_model_states.pt")))
    if not files:
        return None
    meta = _load(files[0])
    return directory if isinstance(meta.get("args"), argparse.Namespace) and "model" not in meta else None


def _load(path: str) -> dict:
    return load_file(path, mmap=True)  # one message for a missing, truncated or damaged file


# Megatron-DeepSpeed's own arguments (beyond Megatron-LM's, whose rules config_from_args applies) that change the
# model in ways hybrid's model does not compute: refused by name when set
MEGATRON_DEEPSPEED_REFUSED = {
    "num_experts_switch": "Megatron-LM's old Switch MLP (a router and that many dense experts in every layer)",
}
# the rest of its own model-describing arguments (its parser's "network size" group and DeepSpeed-MoE's settings),
# each with why it leaves a checkpoint's model as read here; tests/test_megatron_args_real.py checks the whole
# table its parser gives (tests/fixtures/megatron_deepspeed_args/arguments.json)
NOT_MODEL_ARGS_MEGATRON_DEEPSPEED = {
    "DeepSpeed-MoE settings, which act only with --num-experts > 1 (refused as a whole)": (
        "mlp_type", "topk", "expert_interval", "moe_token_dropping", "moe_train_capacity_factor",
        "moe_eval_capacity_factor", "moe_min_capacity", "moe_loss_coeff", "moe_top2_2nd_expert_sampling",
        "moe_expert_parallel_size"),
    "kernels and precision computing the same mathematics": ("mem_efficient_ln", "embedding_weights_in_fp32"),
    "run control": ("kill_switch_file",),
}


def megatron_lm_args(args: argparse.Namespace, where: str) -> argparse.Namespace:
    """Megatron-DeepSpeed's stored args in Megatron-LM's spelling (what config_from_args reads)."""
    for name, what in MEGATRON_DEEPSPEED_REFUSED.items():
        if getattr(args, name, None) not in (None, False, 0):
            raise ConfigError(f"{where}: --{name.replace('_', '-')} {getattr(args, name)}: {what}, which hybrid's "
                              f"model does not compute.")
    experts = getattr(args, "num_experts", None)
    if (isinstance(experts, (list, tuple)) and any(int(e) > 1 for e in experts)
            or isinstance(experts, int) and experts > 1):
        raise ConfigError(f"{where}: a Megatron-DeepSpeed mixture of experts (--num-experts {experts}: DeepSpeed's MoE "
                          f"layers) is not read; convert it with Megatron-DeepSpeed's own tools first.")
    if getattr(args, "use_rotary_position_embeddings", False) and getattr(args, "add_position_embedding", True):
        raise ConfigError(f"{where}: the checkpoint's model adds a learned position table to the embeddings besides "
                          f"rotary embeddings (Megatron-DeepSpeed's default without --no-position-embedding, which "
                          f"its own Llama-2 script keeps), which hybrid's model does not compute (positions are "
                          f"learned or rotary; transformers' Llama has no position table either).")
    heads = int(args.num_attention_heads)
    kv = int(getattr(args, "num_key_value_heads", None) or heads)
    normalization = str(getattr(args, "normalization", "layernorm")).lower()
    return argparse.Namespace(**dict(
        vars(args), num_experts=None, group_query_attention=kv != heads, num_query_groups=kv,
        normalization={"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(normalization, normalization),
        norm_epsilon=float(getattr(args, "layernorm_epsilon", 1e-5)),
        position_embedding_type="rope" if getattr(args, "use_rotary_position_embeddings", False) else
        "learned_absolute", rotary_base=float(getattr(args, "rope_theta", 10000) or 10000)))


@dataclasses.dataclass
class MegatronDeepSpeedCheckpoint(MegatronSource):
    """One Megatron-DeepSpeed checkpoint (its tag directory, args in Megatron-LM's spelling, rank 0's
    model-states file without weights): the interface of hybrid.conversion.megatron.lm.MegatronCheckpoint."""

    format: str = FORMAT
    kind = FORMAT  # (hybrid.conversion.source)

    @property
    def has_optimizer(self) -> bool:
        return bool(glob.glob(os.path.join(self.directory, "*optim_states.pt")))

    def optimizer(self) -> MegatronOptimizer:
        stored = "its ZeRO optimizer partitions are" if self.has_optimizer else "it holds no optimizer state, and are"
        return MegatronOptimizer(problem=f"{stored} not mapped from Megatron-DeepSpeed checkpoints")

    def config(self, true_vocab_size: Optional[int] = None) -> ModelConfig:
        return config_from_args(self.args, true_vocab_size, self.directory)

    def parts(self, config: ModelConfig, wanted: Optional[set] = None, kind: str = "model") -> Iterator[dict]:
        """Canonical full tensors a part at a time (the embeddings, final norm and head; then each layer),
        TP shards joined by hybrid's rules, vocabulary rows cut to config.vocab_size."""
        if kind != "model":
            raise ConfigError(f"{self.directory}: {self.optimizer().problem}.")
        return stream_parts(_Parts(self), config, wanted, self.directory)

    @property
    def tp(self) -> int:
        return int(getattr(self.args, "tensor_model_parallel_size", 1) or 1)

    @property
    def blocked_qkv(self) -> bool:
        """Megatron-DeepSpeed after its FPDT change: [all q | all k | all v] on each TP rank."""
        return hasattr(self.args, "ds_sequence_parallel_fpdt")


class _Parts:
    """One part's tensors: read from their files (memory-mapped), QKV regrouped where the version needs it,
    TP shards joined by hybrid's rules."""

    def __init__(self, ckpt: MegatronDeepSpeedCheckpoint):
        self.ckpt, self.index = ckpt, _index(ckpt)

    def part(self, layer: int, config: ModelConfig, wanted: set) -> dict:
        from hybrid.conversion.layout import merge_shards  # (layout imports DeepSpeed: only when reading)
        ckpt = self.ckpt
        names = [n for n in self.index if n in wanted and (n.startswith(f"layers.{layer}.") if layer >= 0
                                                           else not n.startswith("layers."))]
        opened, shards = {}, {}
        for name in names:
            for path, key, tp_rank in self.index[name]:
                if path not in opened:
                    opened[path] = _tensors(path)
                tensor = opened[path][key]
                if ckpt.blocked_qkv and ".attention.qkv." in name:
                    tensor = _grouped(tensor, config, ckpt.tp)
                shards.setdefault(name, {})[tp_rank] = tensor
        full = dataclasses.replace(config, vocab_size=int(ckpt.args.padded_vocab_size))  # rows are cut by the caller
        return merge_shards(shards, full, ckpt.tp, ckpt.directory, dtype=None)


def open_megatron_deepspeed(path: str) -> MegatronDeepSpeedCheckpoint:
    directory = checkpoint_dir(path)
    if directory is None:
        raise ConfigError(f"{path}: not a Megatron-DeepSpeed checkpoint.")
    common = _load(sorted(glob.glob(os.path.join(directory, "mp_rank_*_model_states.pt")))[0])
    common.pop("module", None)
    if float(common.get("checkpoint_version", 3.0) or 0) < 3.0:
        raise ConfigError(f"{directory}: checkpoint_version {common.get('checkpoint_version')} (a QKV layout before "
                          f"Megatron's version 3) is not read.")
    return MegatronDeepSpeedCheckpoint(directory=directory, args=megatron_lm_args(common["args"], directory),
                                       common=common)


def _canonical(key: str, layer: Optional[int]) -> Optional[str]:
    """Our canonical name of a Megatron-DeepSpeed key (inside transformer layer `layer`, or global)."""
    if layer is not None:
        module, _, field = key.rpartition(".")
        if module in LAYER_NAMES:
            return f"layers.{layer}.{LAYER_NAMES[module]}.{field}"
        return None
    return {"word_embeddings.weight": "embedding.word_embeddings.weight",
            "position_embeddings.weight": "embedding.position_embeddings.weight",
            "weight": "final_norm.weight", "bias": "final_norm.bias", "lm_head.weight": "output_layer.weight",
            "final_layernorm.weight": "final_norm.weight", "final_layernorm.bias": "final_norm.bias",
            "output_layer.weight": "output_layer.weight"}.get(key)


def _index(ckpt: MegatronDeepSpeedCheckpoint) -> dict:
    """{canonical name: [(file, key, TP rank)]} over the checkpoint's files (keys read memory-mapped)."""
    index: dict = {}
    layer_files = sorted(glob.glob(os.path.join(ckpt.directory, "layer_*-model_*-model_states.pt")))

    def add(name, path, key, tp_rank):
        if name is None:
            raise ConfigError(f"{path}: key {key!r} is not one hybrid reads from Megatron-DeepSpeed checkpoints "
                              f"(its GPT model's names only).")
        index.setdefault(name, []).append((path, key, tp_rank))
    _check_complete(ckpt, layer_files)
    if layer_files:  # the pipeline engine: layer files in spec order (embedding, layers, final norm, head)
        specs = sorted({int(_PIPE_FILE.search(p).group(1)) for p in layer_files})
        layer_of, transformer = {}, 0
        for spec in specs:
            keys = _tensors(glob.glob(os.path.join(ckpt.directory, f"layer_{spec:02d}-model_*-model_states.pt"))[0])
            if any(k.startswith("self_attention.") for k in keys):
                layer_of[spec], transformer = transformer, transformer + 1
        if transformer != int(ckpt.args.num_layers):
            raise ConfigError(f"{ckpt.directory}: layer files of {transformer} transformer layers; the args declare "
                              f"--num-layers {ckpt.args.num_layers}. The checkpoint is incomplete: copy every "
                              f"layer_*-model_*-model_states.pt file, then convert.")
        for path in layer_files:
            spec, tp_rank = map(int, _PIPE_FILE.search(path).groups())
            for key in _tensors(path):
                if spec in layer_of:
                    add(_canonical(key, layer_of[spec]), path, key, tp_rank)
                elif key == "word_embeddings.weight" and "embedding.word_embeddings.weight" in index and \
                        spec > min(specs):
                    continue  # a tied table's copy on the last stage
                else:
                    add(_canonical(key, None), path, key, tp_rank)
        return index
    for path in sorted(glob.glob(os.path.join(ckpt.directory, "mp_rank_*_model_states.pt"))):
        tp_rank = int(_MODEL_FILE.search(path).group(1))
        for key in _tensors(path):
            match = re.match(r"language_model\.encoder\.layers\.(\d+)\.(.+)$", key)
            if match:
                add(_canonical(match.group(2), int(match.group(1))), path, key, tp_rank)
            else:
                add(_canonical(re.sub(r"^language_model\.(embedding|encoder)\.|^language_model\.", "", key), None),
                    path, key, tp_rank)
    return index


def _check_complete(ckpt: MegatronDeepSpeedCheckpoint, layer_files: list) -> None:
    """Every TP rank's file of every layer spec (pipeline engine) or of the model (without it), as the args'
    TP size declares; otherwise one message naming the missing files."""
    if layer_files:
        found = {tuple(map(int, _PIPE_FILE.search(p).groups())) for p in layer_files}
        specs = sorted({spec for spec, _ in found})
        wanted = {(spec, t) for spec in specs for t in range(ckpt.tp)}
        names = [f"layer_{spec:02d}-model_{t:02d}-model_states.pt" for spec, t in sorted(wanted - found)]
        odd = [f"layer_{spec:02d}-model_{t:02d}-model_states.pt" for spec, t in sorted(found - wanted)]
    else:
        found = {int(_MODEL_FILE.search(p).group(1))
                 for p in glob.glob(os.path.join(ckpt.directory, "mp_rank_*_model_states.pt"))}
        names = [f"mp_rank_{t:02d}_model_states.pt" for t in sorted(set(range(ckpt.tp)) - found)]
        odd = [f"mp_rank_{t:02d}_model_states.pt" for t in sorted(found - set(range(ckpt.tp)))]
    if names or odd:
        raise ConfigError(f"{ckpt.directory}: the args declare TP {ckpt.tp}; "
                          + (f"missing {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}" if names else "")
                          + ("; " if names and odd else "") + (f"not of that layout: "
                                                               f"{', '.join(odd[:6])}" if odd else "")
                          + ". The checkpoint is incomplete: copy every rank's files, then convert.")


def _tensors(path: str) -> dict:
    """A file's weights by key: a layer file's own, a model-states file's `module` (nested dicts flattened)."""
    content = _load(path)
    module = content.get("module") if "module" in content else content
    flat = {}

    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif torch.is_tensor(value):
                flat[prefix + key] = value
    walk(module or {}, "")
    return flat


def _grouped(tensor: torch.Tensor, config: ModelConfig, tp: int) -> torch.Tensor:
    """One TP rank's QKV rows [all q | all k | all v] -> megatron-core's grouped [q heads of a KV group, k, v]."""
    groups, heads, dim = config.num_query_groups // tp, config.num_attention_heads // tp, config.head_dim
    q, k, v = tensor.split([heads * dim, groups * dim, groups * dim])
    rest = tuple(tensor.shape[1:])
    return torch.cat([q.reshape(groups, heads // groups * dim, *rest), k.reshape(groups, dim, *rest),
                      v.reshape(groups, dim, *rest)], dim=1).reshape(tensor.shape)
