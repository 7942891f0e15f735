"""Megatron-LM's legacy `--ckpt-format torch` files, read: one file per TP x PP (x EP) rank
(`iter_N/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`), a layer's TP shards joined by hybrid's TP layout, experts in
every legacy spelling, MLA's down projections whole or split."""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import torch

from hybrid.checkpoint.files import load_file
from hybrid.conversion.megatron.args import arg
from hybrid.conversion.megatron.names import (EXPERT_KEYS, LEGACY_FILE, MLA_DOWN, canonical_of, expert_name,
                                              is_buffer, layer_scope)
from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig
from hybrid.model.naming import EXPERTS


def legacy_files(directory: str, args: argparse.Namespace) -> list:
    """[(tp_rank, pp_rank, ep_rank, path)] of a legacy checkpoint's files, sorted. Megatron-LM names them
    mp_rank_TT, then _PPP when PP > 1, then _EEE when EP > 1 (so the args say which field is which)."""
    pipeline = int(arg(args, "pipeline_model_parallel_size", 1) or 1) > 1
    expert = int(arg(args, "expert_model_parallel_size", 1) or 1) > 1
    files = []
    for path in glob.glob(os.path.join(directory, "mp_rank_*", LEGACY_FILE)):
        fields = [int(f) for f in os.path.basename(os.path.dirname(path))[len("mp_rank_"):].split("_")]
        if len(fields) != 1 + pipeline + expert:
            raise ConfigError(f"{path}: the directory name does not fit the checkpoint's args (PP "
                              f"{arg(args, 'pipeline_model_parallel_size', 1)}, EP "
                              f"{arg(args, 'expert_model_parallel_size', 1)}).")
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


class LegacyParts:
    """A legacy checkpoint's model tensors (`ckpt`: a hybrid.conversion.megatron.lm.MegatronCheckpoint), indexed
    over its rank files once, read a part (a layer, or the tensors outside the layers) at a time."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        args = ckpt.args
        self.files = legacy_files(ckpt.directory, args)
        # the layout the stored args declare, not the files found: a missing rank's file must not shrink it
        self.tp, self.pp, self.ep = (int(arg(args, f"{axis}_model_parallel_size", 1) or 1)
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
        if arg(args, "virtual_pipeline_model_parallel_size") or arg(args, "num_layers_per_virtual_pipeline_stage"):
            raise ConfigError(f"{ckpt.directory}: a legacy checkpoint of an interleaved (virtual) pipeline is not "
                              f"read; save it once as --ckpt-format torch_dist (global layer numbers), then convert.")
        if arg(args, "decoder_first_pipeline_num_layers") or arg(args, "decoder_last_pipeline_num_layers"):
            raise ConfigError(f"{ckpt.directory}: a legacy checkpoint with an uneven pipeline split is not read; save "
                              f"it once as --ckpt-format torch_dist, then convert.")
        if int(args.num_layers) % self.pp:
            raise ConfigError(f"{ckpt.directory}: {args.num_layers} layers do not split evenly over PP {self.pp}.")
        experts = int(arg(args, "num_experts") or 0)
        etp = int(arg(args, "expert_tensor_parallel_size") or self.tp)
        # expert-TP 1 at EP 1 (biased experts, GPT-OSS's, need it): every TP rank's file holds the whole experts
        self.whole_experts = bool(experts) and etp == 1 and self.ep == 1
        if experts and etp != self.tp and not self.whole_experts:
            raise ConfigError(f"{ckpt.directory}: a legacy MoE checkpoint with --expert-tensor-parallel-size {etp} "
                              f"and TP {self.tp} is not read (its files interleave expert ranks over TP); save it once "
                              f"as --ckpt-format torch_dist, then convert.")
        local = experts // self.ep if experts else 0
        self.mla = bool(arg(args, "multi_latent_attention"))
        self.per_stage = int(args.num_layers) // self.pp
        self.index = {}  # canonical name -> [(path, key, tp rank, tensor -> the weight)]
        for tp_rank, pp_rank, ep_rank, path in self.files:
            offset = pp_rank * self.per_stage
            for key in legacy_model(path):
                scope = layer_scope(key, offset)
                pieces = _expert_pieces(scope[1], ep_rank * local, local) if scope and experts else []
                for expert, fc, field, pick in ([] if self.whole_experts and tp_rank else pieces):
                    name = expert_name(scope[0], expert, fc, field)
                    self.index.setdefault(name, []).append((path, key, tp_rank, pick))
                if pieces or ep_rank > 0:  # other weights are in every EP rank's file: EP rank 0's are read
                    continue
                name = canonical_of(key, offset, self.mla)
                if name is not None and not (name == "output_layer.weight" and not
                                             arg(args, "untie_embeddings_and_output_weights", False)):
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
                    opened[path] = legacy_model(path)
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


def _rows(ckpt) -> int:
    """The vocabulary rows the checkpoint stores (Megatron's padding included)."""
    return int(ckpt.args.padded_vocab_size)


def legacy_model(path: str) -> dict:
    """A legacy file's model weights by key (memory-mapped); one message for an unreadable file."""
    content = load_file(path, mmap=True)
    models = [k for k in content if re.fullmatch(r"model\d*", k)]
    if models != ["model"]:
        raise ConfigError(f"{path}: holds {models or 'no model'}; expected one 'model' (an interleaved pipeline's "
                          f"model0, model1, ... are not read in the legacy format).")
    model = content["model"]
    if any(k.startswith("language_model.") for k in model):
        raise ConfigError(f"{path}: the layout before megatron-core (language_model.encoder.*); load and save it "
                          f"once with a recent Megatron-LM, then convert.")
    return {k: v for k, v in model.items() if torch.is_tensor(v)}
