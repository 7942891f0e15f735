"""Hybrid checkpoints as full (unsharded) state dicts, and back to any TP x PP layout.

Reading understands what `launch/train.py --save` writes through DeepSpeed: `mp_rank_XX` module
files (PP = 1), per-layer `layer_NN-model_TT` files (PP > 1), and ZeRO-3's partitioned weights
(consolidated from the fp32 partitions with DeepSpeed's zero_to_fp32). Writing produces the same
DeepSpeed file layout for a target TP x PP, weights only (flagged `weights_only`, so training
loads it with a fresh optimizer, as after --finetune or --no-load-optim).
"""

from __future__ import annotations

import glob
import os
import re
from typing import Iterator, Optional

import deepspeed
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from hybrid.checkpoint.client_state import ClientState, SavedLayout, model_summary
from hybrid.checkpoint.files import (LATEST, atomic_directory, first_model_file, layer_file, load_file, model_file,
                                     read_tag, tag_for, write_latest)
from hybrid.checkpoint.manifest import verify_manifest, write_manifest
from hybrid.checkpoint.tp_layout import full_numels, join_vocab_blocks, tp_layout
from hybrid.conversion.ds_universal import read_fp32_state
from hybrid.errors import ConfigError
from hybrid.model import lora
from hybrid.model.config import ModelConfig
from hybrid.model.naming import (EMBEDDING_WEIGHT, EXPERTS, buffer_names, canonical_buffers, canonical_name,
                                 canonical_parameters, names_to_load, pipeline_index, vocab_block)
from hybrid.parallel.layers import TableBlock, shard, unshard

__all__ = ["read_hybrid", "hybrid_parts", "write_hybrid", "shard_for_rank", "partition_rule", "load_full_state",
           "resolve_tag",
           "check_target_layout"]


def resolve_tag(load_dir: str, tag: Optional[str] = None) -> str:
    """`tag`, or the one `latest` names."""
    if tag is not None:
        return tag
    latest = read_tag(load_dir, LATEST)
    if latest is None:
        raise ConfigError(f"--load-dir {load_dir}: no 'latest' file; not a hybrid checkpoint directory "
                          f"(made by launch/train.py --save).")
    return latest


def partition_rule(name: str, config: ModelConfig) -> Optional[tuple[int, int]]:
    """(dim, stride) along which `name` is split over TP, or None if replicated (from tp_layout)."""
    rule = tp_layout(config)[name]
    return None if rule.dim is None else (rule.dim, rule.stride)


def open_hybrid(load_dir: str, tag: Optional[str]) -> tuple[str, dict, ClientState]:
    """(the checkpoint's directory, rank 0's model-states file without its weights, its client state),
    after the manifest says every file is there."""
    tag = resolve_tag(load_dir, tag)
    ckpt = os.path.join(load_dir, tag)
    if not os.path.isdir(ckpt):
        raise ConfigError(f"{ckpt}: no such checkpoint directory.")
    problem = verify_manifest(ckpt)
    if problem is not None:
        raise ConfigError(f"checkpoint {ckpt} is incomplete: {problem}.")
    meta = load_file(first_model_file(ckpt), mmap=True)
    meta.pop("module", None)
    saved = ClientState.from_meta(meta)
    if not saved.model:
        raise ConfigError(f"{ckpt}: the checkpoint records no model; it was not written by hybrid.")
    return ckpt, meta, saved


def hybrid_parts(load_dir: str, tag: Optional[str], config: ModelConfig, wanted: set) -> Iterator[dict]:
    """The canonical tensors of `wanted` (this rank's parameters) from a hybrid checkpoint of any TP x PP,
    one part at a time in the file's dtype: the embeddings, final norm and head, then each transformer
    layer (of an MoE layer, the experts asked for), TP shards joined, vocabulary padding removed. Files
    are memory-mapped and opened again for each part, so a part's pages leave the resident set with it
    (for --finetune: loading adds about one layer, not the model; `load_parts` takes the parts).
    ZeRO-3 checkpoints are read whole (DeepSpeed's zero_to_fp32 consolidates all partitions at once)."""
    ckpt, _, saved = open_hybrid(load_dir, tag)
    if saved.storage == "zero3":
        state, _ = read_hybrid(load_dir, tag)
        yield {name: state.pop(name) for name in wanted if name in state}
        return
    where = _locate(ckpt, saved, config, wanted)
    missing = sorted(wanted - set(where))
    if missing:
        raise ConfigError(f"--load {load_dir}: the checkpoint lacks {missing[:5]} (a different model shape?).")
    layer_of = {name: int(name.split(".")[1]) if name.startswith("layers.") else -1 for name in where}
    for layer in sorted(set(layer_of.values())):
        part = _read_shards({name: where[name] for name in where if layer_of[name] == layer})
        part = merge_shards(part, config, saved.layout.tensor_parallel, ckpt, dtype=None)
        yield part
        del part


def read_hybrid(load_dir: str, tag: Optional[str] = None, progress=None) -> tuple[dict, dict]:
    """-> (canonical full fp32 state dict with padded vocab rows removed, rank 0's model-states file
    without its weights). How the weights are stored comes from the recorded client state."""
    ckpt, meta, saved = open_hybrid(load_dir, tag)
    config = saved.model_config()
    tp = saved.layout.tensor_parallel
    if saved.storage == "zero3":
        if tp > 1 or saved.layout.pipeline_parallel > 1:  # DeepSpeed's zero_to_fp32 handles one model-parallel
            # rank only; its ds_to_universal merges TP and PP too, from the optimizer's partitions
            if config.lora_rank:  # (which hold the adapters only: a LoRA run's frozen base is not among them)
                raise ConfigError(f"{ckpt}: a LoRA run saved under ZeRO-3 at TP {tp} x PP "
                                  f"{saved.layout.pipeline_parallel}; its frozen base is not in ZeRO's partitions, "
                                  f"which DeepSpeed's converter reads. Its adapters are in {ckpt}/adapter (a PEFT "
                                  f"directory): load the base with them (--load-hf BASE --load-lora DIR), or merge "
                                  f"them with peft's merge_and_unload.")
            if config.dsa_indexer_topk is not None:  # (DSA's frozen indexer is not among them either)
                raise ConfigError(f"{ckpt}: a DeepSeek sparse attention run saved under ZeRO-3 at TP {tp} x PP "
                                  f"{saved.layout.pipeline_parallel}; its frozen indexer is not in ZeRO's partitions, "
                                  f"which DeepSpeed's converter reads. Save it at ZeRO-0/1/2, or at TP 1 x PP 1.")
            full = read_fp32_state(ckpt, config)
        else:
            full = join_vocab_blocks(get_fp32_state_dict_from_zero_checkpoint(load_dir, tag=tag))
        shards = {name: {0: value} for name, value in full.items()}
    else:
        shards = _read_shards(_locate(ckpt, saved, config, set(tp_layout(config)) | buffer_names(config)))
    return merge_shards(shards, config, tp, ckpt, progress), meta


def _locate(ckpt: str, saved: ClientState, config: ModelConfig, wanted: set) -> dict:
    """{canonical name in `wanted`: [(file, key, TP rank)]}: where each tensor of the checkpoint is (its
    files opened memory-mapped, to read their keys)."""
    where: dict[str, list] = {}
    for path, tp_rank, to_canonical in _weight_files(ckpt, saved, config):
        for key in _tensors(path):
            name = to_canonical(key)
            # an expert is whole in each file holding it (replicated over TP): its first file counts
            if name in wanted and not (EXPERTS in name and name in where):
                where.setdefault(name, []).append((path, key, tp_rank))
    return where


def _read_shards(where: dict) -> dict:
    """{name: {TP rank: tensor}} of the located tensors, each file opened (memory-mapped) once."""
    opened: dict[str, dict] = {}
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for name, places in where.items():
        for path, key, tp_rank in places:
            if path not in opened:
                opened[path] = _tensors(path)
            shards.setdefault(name, {})[tp_rank] = opened[path][key]
    return shards


def _weight_files(ckpt: str, saved: ClientState, config: ModelConfig) -> list:
    """[(file, its TP rank, key -> canonical name or None)] of a checkpoint's weights: DeepSpeed's MoE
    expert files first (`layer_{l}_expert_{e}_mp_rank_XX_model_states.pt`, keys with the global expert
    index, every expert), then the dense weights as stored: `mp_rank_XX` module files (PP = 1), per-layer
    `layer_NN-model_TT` files (PP > 1; with MoE, DeepSpeed's engine writes one module file per model-
    parallel rank, stage-major, under the pipeline's names instead), or one file per TP x PP rank (the
    torch schedules' virtual stages, canonical names). Conversion's weights-only checkpoints keep their
    experts in the module files."""
    tp, pp = saved.layout.tensor_parallel, saved.layout.pipeline_parallel
    names = lambda key: canonical_name(key, config.num_layers)  # noqa: E731
    files = [(path, 0, names) for path in
             sorted(glob.glob(os.path.join(ckpt, "layer_*_expert_*_mp_rank_*_model_states.pt")))]
    layer_files = sorted(glob.glob(os.path.join(ckpt, "layer_*-model_*-model_states.pt")))
    if saved.storage == "virtual_stages":
        files += [(os.path.join(ckpt, model_file(t, stage, tp)), t, names) for stage in range(pp) for t in range(tp)]
    elif saved.storage == "layer_files" and layer_files:
        for path in layer_files:
            index, tp_rank = map(int, re.search(r"layer_(\d+)-model_(\d+)-", os.path.basename(path)).groups())
            files.append((path, tp_rank, lambda key, i=index: canonical_name(f"{i}.{key}", config.num_layers)))
    elif saved.storage == "layer_files":
        files += [(os.path.join(ckpt, model_file(m)), m % tp, names) for m in range(tp * pp)]
    else:
        files += [(os.path.join(ckpt, model_file(t)), t, names) for t in range(tp)]
    return files


def _tensors(path: str) -> dict:
    """A checkpoint file's weights by key, memory-mapped (a module file's `module`, or a layer file)."""
    content = load_file(path, mmap=True)
    return content["module"] if isinstance(content.get("module"), dict) else content


def merge_shards(shards: dict, config: ModelConfig, tp: int, ckpt: str = "", progress=None,
                 dtype: Optional[torch.dtype] = torch.float32) -> dict:
    """{canonical name: {tp_rank: shard}} -> full tensors (fp32 copies; `dtype=None`: the shards' dtype,
    a lone shard as it is), vocabulary padding removed."""
    state = {}
    layout, numels = tp_layout(config), full_numels(config)
    for name in sorted(buffer_names(config) & set(shards)):  # replicated: any TP rank's copy
        tensor = next(iter(shards.pop(name).values()))
        state[name] = tensor if dtype is None else tensor.to(dtype).clone()
    names = sorted(n for n in shards if n in layout)
    for name in (progress(names) if progress else names):
        by_rank = shards.pop(name)  # free the shards as the full tensor is built: ~one copy at a time
        pieces = [by_rank[r] for r in sorted(by_rank)]
        rule = partition_rule(name, config)
        if rule is not None and len(pieces) > 1:
            if len(pieces) != tp:
                raise ConfigError(f"{ckpt}: {name} has {len(pieces)} TP shards, expected {tp}.")
            tensor = unshard(pieces, *rule)
        else:
            tensor = pieces[0]
        if layout[name].vocab_padded:
            tensor = tensor[: config.vocab_size]
        if tensor.numel() != numels[name]:  # a shard taken for the whole tensor, or a shard of another model
            raise ConfigError(f"{ckpt}: {name} joined from {len(pieces)} TP shard(s) of shape "
                              f"{tuple(pieces[0].shape)} has {tensor.numel()} elements; the checkpoint's model "
                              f"({config.hidden_size} hidden, TP {tp}) has {numels[name]}. Files of some TP ranks "
                              f"are missing or belong to another checkpoint.")
        state[name] = tensor if dtype is None else tensor.to(dtype).clone()
    return state


def shard_for_rank(name: str, tensor: torch.Tensor, config: ModelConfig, tp: int, tp_rank: int) -> torch.Tensor:
    """The TP shard of a full canonical tensor, vocabulary padded as the model at this TP pads it (a buffer:
    the whole tensor, replicated)."""
    if name in buffer_names(config):
        return tensor
    if tp_layout(config)[name].vocab_padded:
        padded = config.padded_vocab_size(tp)
        if tensor.size(0) < padded:
            tensor = torch.cat([tensor, tensor.new_zeros((padded - tensor.size(0),) + tuple(tensor.shape[1:]))])
    rule = partition_rule(name, config)
    if rule is None:
        return tensor
    return shard(tensor, rule[0], tp_rank, tp, rule[1])


def load_full_state(model, state: dict, config: ModelConfig, groups) -> None:
    """Copy a full canonical state dict into this rank's parameters of `model` (any form: GPTModel, a
    DeepSpeed pipeline stage, virtual stages); see load_parts."""
    missing = sorted(names_to_load(model, config.num_layers, buffers=False) - set(state))
    if missing:
        raise ConfigError(f"--load: the checkpoint lacks {missing[:5]} (a different model shape?).")
    load_parts(model, [state], config, groups)


def table_block_rows(model) -> dict:
    """{id of a vocabulary table's row block (hybrid.parallel.layers.TableBlock): its rows [start, stop) within
    this TP rank's rows of the table}."""
    return {id(module.weight): module.local_rows for module in model.modules() if isinstance(module, TableBlock)}


def load_parts(model, parts, config: ModelConfig, groups, may_start_fresh: tuple = (),
               adapters_may_start_fresh: bool = False) -> list:
    """Copy full canonical tensors, given a part at a time (`parts`: dicts, such as one layer's, of any
    dtype), into this rank's parameters of `model`, each TP-sharded for this rank and cast to the
    parameter's dtype; tensors of other ranks' parameters are skipped. Only one part is held at a time and,
    under ZeRO-3, only that part's parameters are gathered (DeepSpeed's GatheredParameters: written, then
    re-partitioned). Every parameter of the rank must have been in some part but those whose names start with
    `may_start_fresh`, which keep their initialisation (returned), and with `adapters_may_start_fresh` the LoRA
    adapters (hybrid.model.lora) a checkpoint without them leaves at PEFT's initialisation. Buffers a part names (the
    routers' score biases, replicated) are copied too, and a last stage's copy of a tied table
    (hybrid.model.virtual_stages.RankModel.tied_table) gets the word embeddings where a part has them. A table
    in row blocks (ZeRO-3's form: hybrid.model.naming.vocab_block) takes each block's rows of the table."""
    params = canonical_parameters(model, config.num_layers)
    sources = {name: (vocab_block(name) or (name,))[0] for name in params}
    rows = table_block_rows(model)
    buffers = canonical_buffers(model, config.num_layers)
    copy = getattr(model, "tied_table", None)
    loaded = set()
    for part in parts:
        with torch.no_grad():
            for name in [n for n in part if n in buffers and n not in params]:
                buffers[name].copy_(part[name])
            if copy is not None and EMBEDDING_WEIGHT in part and EMBEDDING_WEIGHT not in params:
                copy.copy_(shard_for_rank(EMBEDDING_WEIGHT, part[EMBEDDING_WEIGHT], config, groups.tp.size,
                                          groups.tp.rank))
        mine = {name: param for name, param in params.items() if sources[name] in part}
        tables = {}  # this rank's shard of a blocked table, made once for all its blocks
        # DeepSpeed reads modifier_rank as the rank within each parameter's ZeRO group: its first rank writes
        with deepspeed.zero.GatheredParameters(list(mine.values()), modifier_rank=0):
            with torch.no_grad():
                for name, param in mine.items():
                    source = sources[name]
                    if id(param) not in rows:
                        value = shard_for_rank(name, part[name], config, groups.tp.size, groups.tp.rank)
                    else:
                        if source not in tables:
                            tables[source] = shard_for_rank(source, part[source], config, groups.tp.size,
                                                            groups.tp.rank)
                        value = tables[source][rows[id(param)][0]:rows[id(param)][1]]
                    if tuple(value.shape) != tuple(param.shape):
                        raise ConfigError(f"--load: {name} has shape {tuple(value.shape)} in the checkpoint but "
                                          f"{tuple(param.shape)} in the model; check the model flags.")
                    param.copy_(value)
        loaded.update(mine)
        del part, mine, tables
    missing = sorted(set(params) - loaded)
    fresh = [name for name in missing if (may_start_fresh and name.startswith(may_start_fresh))
             or (adapters_may_start_fresh and lora.is_adapter(name))]
    missing = [name for name in missing if name not in fresh]
    if missing:
        raise ConfigError(f"--load: the checkpoint lacks {missing[:5]} (a different model shape?).")
    return fresh


def check_target_layout(config: ModelConfig, tp: int, pp: int) -> None:
    config.validate(tp)
    if pp < 1 or pp > config.num_layers:
        raise ConfigError(f"--target-pipeline-parallel-size {pp}: must be between 1 and --num-layers "
                          f"{config.num_layers}.")


def write_hybrid(state: dict, config: ModelConfig, tp: int, pp: int, save_dir: str, client_state: ClientState,
                 progress=None) -> str:
    """Write `state` (canonical, full) as a hybrid checkpoint at TP x PP; atomic (temp dir + rename).

    PP > 1 checkpoints hold one file per pipeline layer and TP rank, so launch/train.py can load them
    with any --pipeline-partition.
    """
    check_target_layout(config, tp, pp)
    expected = _expected_names(config)
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ConfigError(f"state dict does not fit the model: missing {sorted(missing)[:5]}, "
                          f"unexpected {sorted(unexpected)[:5]}.")
    iteration = int(client_state.iteration)
    tag = tag_for(iteration)
    with atomic_directory(save_dir) as tmp:
        ckpt = os.path.join(tmp, tag)
        os.makedirs(ckpt)
        # weights only, stored as DeepSpeed's PP = 1 engine or its pipeline engine stores them
        written = ClientState(iteration=iteration, consumed_samples=client_state.consumed_samples,
                              model=model_summary(config), layout=SavedLayout(tensor_parallel=tp, pipeline_parallel=pp),
                              run=client_state.run, args=client_state.args, weights_only=True)
        common = dict(written.to_dict(), dp_world_size=1, mp_world_size=tp * pp, ds_version=deepspeed.__version__,
                      global_steps=iteration, skipped_steps=0, buffer_names=[], optimizer=None, lr_scheduler=None)
        names = sorted(state)
        if pp == 1:
            for tp_rank in range(tp):
                module = {n: shard_for_rank(n, state[n], config, tp, tp_rank).contiguous().clone() for n in
                          (progress(names) if progress and tp_rank == 0 else names)}
                torch.save(dict(common, module=module), os.path.join(ckpt, model_file(tp_rank)))
        else:
            _write_pipeline(state, config, tp, pp, ckpt, common, progress)
        write_manifest(ckpt)
        write_latest(tmp, tag)
    return tag


def _write_pipeline(state, config, tp, pp, ckpt, common, progress):
    files: dict[int, dict[str, str]] = {}  # LayerSpec index -> {key in that layer: canonical name}
    for name in state:
        index, key = pipeline_index(name, config.num_layers)
        files.setdefault(index, {})[key] = name
    if config.tied_embeddings:  # the last stage's copy of the word embeddings
        files.setdefault(config.num_layers + 2, {})["word_embeddings.weight"] = EMBEDDING_WEIGHT
    indices = sorted(files)
    for index in (progress(indices) if progress else indices):
        for tp_rank in range(tp):
            layer_state = {key: shard_for_rank(name, state[name], config, tp, tp_rank).contiguous().clone()
                           for key, name in files[index].items()}
            torch.save(layer_state, os.path.join(ckpt, layer_file(index, tp_rank)))
    for stage in range(pp):
        for tp_rank in range(tp):
            torch.save(dict(common, module=None), os.path.join(ckpt, model_file(tp_rank, stage, tp)))


def _expected_names(config: ModelConfig) -> set:
    """Canonical parameter and buffer names of a model with this config's structure."""
    return set(tp_layout(config)) | buffer_names(config)
