"""Megatron-LM's own checkpoints, opened: which iteration directory a path names, its format (the legacy
`--ckpt-format torch`: `iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt`; megatron-core's `torch_dist`: `iter_N/.metadata`,
`*.distcp`, `common.pt`), its stored args and counters, and its weights a part at a time, at any TP x PP it was saved
at, with the local spec's or Transformer Engine's key names.

The model is the one the checkpoint's stored args describe (hybrid.conversion.megatron.args, as Megatron-LM's own
converter builds it); its weights come a transformer layer at a time (`parts`: hybrid.conversion.megatron.legacy and
torch_dist read them, names mapped by hybrid.conversion.megatron.names), TP shards joined by the same per-parameter
rules as hybrid's (hybrid.checkpoint.tp_layout: megatron-core's QKV grouped per query group, fc1 of a gated MLP as
[gate; up] per TP rank, the vocabulary split over TP). The vocabulary keeps every row the checkpoint has (Megatron's
padding included, as its logits do); `true_vocab_size` drops the padding. Its Adam state: optimizer.

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
import os
from typing import Iterator, Optional

import torch

from hybrid.checkpoint.client_state import ClientState
from hybrid.checkpoint.files import LATEST, MEGATRON_LATEST, load_file
from hybrid.conversion.families.mla_rope import deepseek_rope_rows
from hybrid.conversion.megatron.args import config_from_args, megatron_run_args
from hybrid.conversion.megatron.dcp_files import DCPCheckpoint
from hybrid.conversion.megatron.legacy import LegacyParts, legacy_files, legacy_model
from hybrid.conversion.megatron.names import LEGACY_FILE, RELEASE
from hybrid.conversion.megatron.optimizer import OPTIMIZER_PREFIX, MegatronOptimizer, optimizer_of
from hybrid.conversion.megatron.torch_dist import DistParts
from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig
from hybrid.model.naming import buffer_names


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
        return optimizer_of(self)

    def parts(self, config: ModelConfig, wanted: Optional[set] = None, kind: str = "model") -> Iterator[dict]:
        """Canonical full tensors, a part at a time: the embeddings, final norm and head, then each layer
        (of `wanted` only when given: a rank's parameters, its experts among them, and the routers' score
        biases when asked for), in the checkpoint's dtype, vocabulary rows cut to config.vocab_size.
        `kind`: the weights ("model"), or one of the optimizer's tensors (OPTIMIZER_KINDS; torch_dist)."""
        if kind == "model":
            reader = DistParts(self) if self.format == "torch_dist" else LegacyParts(self)
        else:
            reader = DistParts(self, f"{OPTIMIZER_PREFIX}{kind}.")
        return stream_parts(reader, config, wanted, self.directory)


def _stores_own_head(ckpt: "MegatronCheckpoint") -> bool:
    """Whether a checkpoint whose args do not say if the output layer is tied holds a head of its own: megatron-core
    saves no output layer for a tied model at PP 1 (torch_dist: never), and on a later stage the tied copy equals
    the embedding (TP rank 0's shards compared). Without this, a trained head was dropped and the export tied."""
    if ckpt.format == "torch_dist":
        return "output_layer.weight" in DCPCheckpoint(ckpt.directory).tensors
    files = legacy_files(ckpt.directory, ckpt.args)
    heads = [legacy_model(path).get("output_layer.weight") for t, _, e, path in files if t == 0 and e == 0]
    heads = [h for h in heads if h is not None]
    if not heads:
        return False
    first = legacy_model(files[0][3]).get("embedding.word_embeddings.weight")
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
        common = load_file(common_path)
    else:
        common = load_file(sorted(glob.glob(os.path.join(directory, "mp_rank_*", LEGACY_FILE)))[0], mmap=True)
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


