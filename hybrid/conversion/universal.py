"""Universal checkpoints, the DeepSpeed way: DeepSpeed's own `ds_to_universal` turns a checkpoint
(any TP/PP/DP, ZeRO-1/2/3) into one directory per parameter holding its full fp32 weights and Adam
moments; `launch/train.py --load DIR --universal-checkpoint` loads that at any other layout.

The conversion command's layer: it chooses DeepSpeed's tool (hybrid.conversion.ds_universal) for ZeRO
checkpoints, writes the same layout itself for checkpoints without ZeRO (which DeepSpeed's tool does
not read), and moves the `latest_universal` pointer Megatron-DeepSpeed uses.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil

import torch
from deepspeed.checkpoint import constants as c

from hybrid.capabilities import Setup, check
from hybrid.checkpoint.client_state import ClientState, read_client_state
from hybrid.checkpoint.files import (LATEST_UNIVERSAL, UNIVERSAL_SUFFIX, atomic_directory, first_model_file, load_file,
                                     model_file, write_atomic)
from hybrid.checkpoint.manifest import verify_manifest
from hybrid.checkpoint.tp_layout import tp_layout
from hybrid.conversion.ds_universal import UNIVERSAL_INFO, alias_model_files, normalize, run_ds_to_universal
from hybrid.conversion.layout import merge_shards, read_hybrid
from hybrid.errors import ConfigError
from hybrid.model.naming import canonical_name, global_expert_name


def _check_convertible(ckpt: str) -> None:
    if not glob.glob(os.path.join(ckpt, "*optim_states.pt")) and not _is_zero0(ckpt):
        raise ConfigError(f"{ckpt} holds no ZeRO optimizer partitions and no record of which parameter each "
                          f"optimizer state belongs to (a checkpoint without ZeRO written by an older hybrid): "
                          f"resume it once at its own layout and save again, or reshard its weights only with "
                          f"conversion/checkpoint_util.py --target-tensor-parallel-size N "
                          f"--target-pipeline-parallel-size M.")


def convert(ckpt: str, out_dir: str, config, log=print) -> None:
    """DeepSpeed's ds_to_universal (strict mode) from `ckpt` into the new directory `out_dir`, then the
    parameter directories renamed to canonical names."""
    _check_convertible(ckpt)
    if glob.glob(os.path.join(ckpt, "layer_*_expert_*_model_states.pt")):  # DeepSpeed's MoE groups (ZeRO-1/2)
        log(f"converting {ckpt} (mixture of experts: DeepSpeed's tool does not read expert groups) into DeepSpeed's "
            f"universal layout")
        _moe_zero_to_universal(ckpt, out_dir, config)
        alias_model_files(out_dir)
        return
    if _is_zero0(ckpt):
        log(f"converting {ckpt} (no ZeRO: its optimizer state is by parameter) into DeepSpeed's universal layout")
        _zero0_to_universal(ckpt, out_dir, config)
        alias_model_files(out_dir)
        return
    run_ds_to_universal(ckpt, out_dir, config, log)


def _is_zero0(ckpt: str) -> bool:
    """A checkpoint without ZeRO whose optimizer state is indexed by parameter (fp32, written with
    the canonical name of each position)."""
    if glob.glob(os.path.join(ckpt, "*optim_states.pt")):
        return False
    meta = load_file(first_model_file(ckpt))
    return bool(ClientState.from_meta(meta).optimizer_param_names) and isinstance(meta.get("optimizer"), dict)


def _zero0_to_universal(ckpt: str, out_dir: str, config) -> None:
    """What ds_to_universal does for ZeRO partitions, written here for the one case it does not
    read (DeepSpeed has no universal conversion without ZeRO): each TP/PP rank's torch optimizer
    state (position-indexed, names recorded at save time) and weights, merged over TP into one
    directory per parameter in DeepSpeed's universal layout."""

    load_dir, tag = os.path.split(ckpt.rstrip(os.sep))
    weights, meta = read_hybrid(load_dir, tag)
    saved = ClientState.from_meta(meta)
    tp, pp = saved.layout.tensor_parallel, saved.layout.pipeline_parallel
    moments = {"exp_avg": {}, "exp_avg_sq": {}}
    steps, param_groups = {}, None
    os.makedirs(out_dir, exist_ok=True)
    for stage in range(pp):
        for tp_rank in range(tp):
            path = os.path.join(ckpt, model_file(tp_rank, stage, tp))
            rank_state = load_file(path)
            shutil.copy2(path, out_dir)
            optimizer, names = rank_state["optimizer"], ClientState.from_meta(rank_state).optimizer_param_names
            if "muon" in optimizer:
                raise ConfigError(f"{ckpt}: a --optimizer muon run without ZeRO keeps torch's Muon state per HF "
                                  f"matrix, which the universal format does not hold; train with ZeRO-1/2/3 "
                                  f"(--zero-stage 1) for a universal checkpoint of Muon, or resume at this layout.")
            param_groups = param_groups or [{k: v for k, v in g.items() if k != "params"}
                                            for g in optimizer["param_groups"]]
            for group, group_names in zip(optimizer["param_groups"], names):
                for index, name in zip(group["params"], group_names):
                    state = optimizer["state"].get(index, {})
                    for key in moments:
                        if key in state:  # a tied embedding's two copies hold the same moments: keep one
                            moments[key].setdefault(name, {}).setdefault(tp_rank, state[key])
                    if "step" in state:
                        steps.setdefault(name, state["step"])
    zero = os.path.join(out_dir, "zero")
    full_moments = {key: merge_shards(by_name, config, tp, ckpt) for key, by_name in moments.items()}
    for name, weight in weights.items():
        os.makedirs(os.path.join(zero, name))
        for key, tensor in (("fp32", weight), *((k, full_moments[k].get(name)) for k in moments)):
            if tensor is not None:
                torch.save({c.PARAM: tensor}, os.path.join(zero, name, f"{key}.pt"))
        if name in steps:
            torch.save(steps[name], os.path.join(zero, name, "step.pt"))
    groups = [dict(g, params=[i]) for i, g in enumerate(param_groups or [])]
    torch.save({"param_groups": groups, "clip_grad": meta.get("ds_config", {}).get("gradient_clipping", 0.0)},
               os.path.join(zero, "optimizer_state.pt"))
    normalize(zero, config, {})


def _moe_zero_to_universal(ckpt: str, out_dir: str, config) -> None:
    """What ds_to_universal does, for ZeRO-1/2 checkpoints of MoE models, which it cannot read: each
    rank's fp32 partition and Adam moments of every parameter group (DeepSpeed's MoE groups hold the
    experts of that rank's EP rank, partitioned over the expert-data-parallel ranks) are cut into
    parameters by the recorded `param_slice_mappings`, a local expert renamed by its global index (data
    rank d is EP rank d % EP), the fragments of a parameter joined in data-rank order (partitions follow
    their group's ranks), then merged over TP into one directory per canonical parameter. The model
    files and DeepSpeed's expert files (global indices: any EP reads them) go along."""

    meta = load_file(first_model_file(ckpt))
    saved = ClientState.from_meta(meta)
    tp, ep = saved.layout.tensor_parallel, saved.layout.expert_parallel
    try:
        check(Setup(pp=saved.layout.pipeline_parallel, experts=True, universal_checkpoint=True),
              only=("moe-universal-pipeline",))
    except ConfigError as error:
        raise ConfigError(f"{ckpt}: {error}") from None
    local_experts = config.num_experts // ep
    if not glob.glob(os.path.join(ckpt, "zero_pp_rank_*_mp_rank_*_optim_states.pt")):
        raise ConfigError(f"{ckpt}: universal checkpoints of MoE models are made from ZeRO-1/2 checkpoints; this "
                          f"one has no ZeRO partitions. Train with --deepspeed ds_configs/zero1.json (or zero2).")
    pieces: dict = {}  # (canonical name, tp rank) -> key -> [(data rank, fragment)]
    steps, param_groups = {}, None
    for path in sorted(glob.glob(os.path.join(ckpt, "zero_pp_rank_*_mp_rank_*_optim_states.pt"))):
        data_rank, tp_rank = map(int, re.search(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_", os.path.basename(path)).groups())
        state = load_file(path)["optimizer_state_dict"]
        base = state["base_optimizer_state"]
        param_groups = param_groups or [{k: v for k, v in g.items() if k not in ("params", "name", "moe")}
                                        for g in base["param_groups"]]
        for i, mapping in enumerate(state["param_slice_mappings"]):
            flat = {"fp32": state["single_partition_of_fp32_groups"][i], **{
                key: base["state"][i][key] for key in ("exp_avg", "exp_avg_sq") if key in base["state"].get(i, {})}}
            if "exp_avg" in flat and "exp_avg_sq" not in flat:  # a --optimizer muon group: its momentum under
                flat["exp_avg_sq"] = torch.zeros_like(flat["exp_avg"])  # exp_avg, no second moment (as _adam_view)
            for name, fragment in mapping.items():
                full = canonical_name(global_expert_name(name, {}, (data_rank % ep) * local_experts),
                                      config.num_layers)
                for key, tensor in flat.items():
                    piece = tensor.narrow(0, fragment.start, fragment.numel)
                    pieces.setdefault((full, tp_rank), {}).setdefault(key, []).append((data_rank, piece))
                if "step" in base["state"].get(i, {}):
                    steps.setdefault(full, base["state"][i]["step"])
    shapes = {}  # the TP shard shapes: the model files' (dense), the config's (experts, whole at every TP)
    for tp_rank in range(tp):
        for group in load_file(os.path.join(ckpt, model_file(tp_rank))).get("param_shapes") or []:
            for name, shape in group.items():
                shapes[(canonical_name(name, config.num_layers), tp_rank)] = tuple(shape)
    for name in tp_layout(config):
        if ".deepspeed_moe." in name:
            h, f = config.hidden_size, config.moe_ffn_hidden_size
            shape = (f * (2 if config.gated_linear_unit else 1), h) if ".fc1." in name else (h, f)
            for tp_rank in range(tp):
                shapes[(name, tp_rank)] = shape
    by_key: dict = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for (name, tp_rank), keyed in pieces.items():
        for key, fragments in keyed.items():
            joined = torch.cat([t for _, t in sorted(fragments, key=lambda x: x[0])])
            by_key[key].setdefault(name, {})[tp_rank] = joined.view(shapes[(name, tp_rank)])
    full = {key: merge_shards(named, config, tp, ckpt) for key, named in by_key.items()}
    os.makedirs(out_dir, exist_ok=True)
    for path in glob.glob(os.path.join(ckpt, "*model_states.pt")):  # mp_rank files and the expert files
        shutil.copy2(path, out_dir)
    zero = os.path.join(out_dir, "zero")
    for name, weight in full["fp32"].items():
        os.makedirs(os.path.join(zero, name))
        for key in by_key:
            if name in full[key]:
                torch.save({c.PARAM: full[key][name]}, os.path.join(zero, name, f"{key}.pt"))
        if name in steps:
            torch.save(steps[name], os.path.join(zero, name, "step.pt"))
    torch.save({"param_groups": [dict(g, params=[i]) for i, g in enumerate(param_groups or [])],
                "clip_grad": meta.get("ds_config", {}).get("gradient_clipping", 0.0)},
               os.path.join(zero, "optimizer_state.pt"))
    normalize(zero, config, {})


def to_universal(load_dir: str, tag: str, log=print) -> str:
    """Convert `load_dir/tag` into `load_dir/tag_universal` (atomically) and point `latest_universal`
    at it. Returns the universal tag."""
    problem = verify_manifest(os.path.join(load_dir, tag))
    if problem is not None:
        raise ConfigError(f"checkpoint {os.path.join(load_dir, tag)} is incomplete: {problem}.")
    saved = read_client_state(load_dir, tag)
    config = saved.model_config()
    out_tag = tag + UNIVERSAL_SUFFIX
    target = os.path.join(load_dir, out_tag)
    with atomic_directory(target, replace=True) as tmp:  # a new conversion of the same tag replaces the old
        convert(os.path.join(load_dir, tag), tmp, config, log)
        with open(os.path.join(tmp, UNIVERSAL_INFO), "w") as f:
            json.dump({"source_tag": tag, "tensor_parallel": saved.layout.tensor_parallel,
                       "pipeline_parallel": saved.layout.pipeline_parallel, "data_parallel": saved.layout.data_parallel,
                       "iteration": saved.iteration}, f)
    write_atomic(os.path.join(load_dir, LATEST_UNIVERSAL), out_tag)
    log(f"wrote universal checkpoint {target}; resume at any layout with --load {load_dir} --universal-checkpoint")
    return out_tag
