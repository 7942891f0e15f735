"""Universal checkpoints, the DeepSpeed way: DeepSpeed's own `ds_to_universal` turns a checkpoint
(any TP/PP/DP, ZeRO-1/2/3) into one directory per parameter holding its full fp32 weights and Adam
moments; `launch/train.py --load DIR --universal-checkpoint` loads that at any other layout.

What this adds to DeepSpeed's tool (and nothing else): parameter directories under canonical names,
so a checkpoint written by pipeline stages (`3.attention...`, `tied_modules.embed...`) loads at
PP = 1 and the other way round, and the `latest_universal` pointer Megatron-DeepSpeed uses.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

import torch

from hybrid.checkpoint_format import (LATEST_UNIVERSAL, UNIVERSAL_SUFFIX, atomic_directory, canonical_name,
                                      model_config_from_summary, read_meta, write_atomic)
from hybrid.errors import ConfigError

UNIVERSAL_INFO = "hybrid_universal.json"  # what the universal checkpoint was made from


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
    if _is_zero0(ckpt):
        log(f"converting {ckpt} (no ZeRO: its optimizer state is by parameter) into DeepSpeed's universal layout")
        _zero0_to_universal(ckpt, out_dir, config)
        _alias_model_files(out_dir)
        return
    log(f"converting {ckpt} with DeepSpeed's ds_to_universal (strict)")
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", ckpt,
                           "--output_folder", out_dir, "--num_extract_workers", "1", "--num_merge_workers", "1"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise ConfigError(f"DeepSpeed's ds_to_universal failed on {ckpt}:\n{proc.stderr.strip()[-3000:]}")
    zero = os.path.join(out_dir, "zero")
    for name in sorted(os.listdir(zero)):
        if not os.path.isdir(os.path.join(zero, name)):
            continue  # optimizer_state.pt
        canonical = canonical_name(name, config.num_layers)
        if canonical is not None and canonical != name:
            os.replace(os.path.join(zero, name), os.path.join(zero, canonical))
    _drop_tied_copy(zero)
    _normalize(zero, config, _param_shapes(out_dir, config))
    _alias_model_files(out_dir)


def _drop_tied_copy(zero: str) -> None:
    """Virtual pipeline stages keep a second copy of a tied embedding table on the last stage's rank;
    it received the same summed gradients and updates as the first, so its weights and Adam moments
    are the embedding's: keep one, under the canonical name."""
    from hybrid.model.virtual_stages import TIED_COPY_WEIGHT
    copy = os.path.join(zero, TIED_COPY_WEIGHT)
    if os.path.isdir(copy):
        original = os.path.join(zero, "embedding.word_embeddings.weight")
        if os.path.isdir(original):
            shutil.rmtree(copy)
        else:
            os.replace(copy, original)


def _param_shapes(out_dir: str, config) -> dict:
    """Canonical name -> shape, from the model-states files' `param_shapes` (ZeRO-3's universal files
    hold flat tensors)."""
    shapes = {}
    for name in os.listdir(out_dir):
        if name.endswith("_model_states.pt"):
            groups = torch.load(os.path.join(out_dir, name), map_location="cpu", weights_only=False).get("param_shapes")
            for group in groups or []:
                for param, shape in group.items():
                    shapes.setdefault(canonical_name(param, config.num_layers), tuple(shape))
            break
    return shapes


def _alias_model_files(out_dir: str) -> None:
    """DeepSpeed reads a universal checkpoint's metadata (client state, LR scheduler) from the
    model-states file its target stage expects: `mp_rank_XX_...` for ZeRO-1/2, `zero_pp_rank_0_mp_rank_XX_...`
    for ZeRO-3; ds_to_universal copies only the source's kind. Link the other name to it."""
    import re
    for name in os.listdir(out_dir):
        plain = re.fullmatch(r"mp_rank_(\d+)_model_states\.pt", name)
        zero3 = re.fullmatch(r"zero_pp_rank_0_mp_rank_(\d+)_model_states\.pt", name)
        other = (f"zero_pp_rank_0_mp_rank_{plain.group(1)}_model_states.pt" if plain else
                 f"mp_rank_{zero3.group(1)}_model_states.pt" if zero3 else None)
        if other and not os.path.exists(os.path.join(out_dir, other)):
            try:
                os.link(os.path.join(out_dir, name), os.path.join(out_dir, other))
            except OSError:
                shutil.copy2(os.path.join(out_dir, name), os.path.join(out_dir, other))


def _normalize(zero: str, config, shapes: dict) -> None:
    """One layout for universal checkpoints from any ZeRO stage, loadable by any stage: DeepSpeed
    0.19 writes ZeRO-3's per-parameter files as bare tensors without a step, keeps vocabulary padding,
    and its global optimizer file differs per stage (ZeRO-1/2 loads read `param_groups` and
    `ds_version`, ZeRO-3 loads read `optimizer_state_dict`). Here every file is DeepSpeed's
    ZeRO-1/2 dict form (`param`, `cat_dim`, `vocab_tensor`), vocabulary rows are padded as at TP = 1
    (ZeRO-1/2 loads pad further for their TP; ZeRO-3 loads at TP = 1 take them as they are), each
    parameter has its `step`, and the global file carries both stages' keys."""
    import deepspeed
    from deepspeed.checkpoint import constants as c

    from hybrid.checkpoint_format import tp_layout
    path = os.path.join(zero, "optimizer_state.pt")
    optim = torch.load(path, map_location="cpu", weights_only=False)
    nested = optim.get("optimizer_state_dict") or {}
    state = nested.get("state") or {}
    step = next((s["step"] for s in state.values() if "step" in s), None)
    padded = config.padded_vocab_size(1)
    for name, rule in tp_layout(config).items():
        folder = os.path.join(zero, name)
        if not os.path.isdir(folder):
            continue
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            file = os.path.join(folder, f"{key}.pt")
            value = torch.load(file, map_location="cpu", weights_only=False)
            entry = dict(value) if isinstance(value, dict) else {c.PARAM: value}
            shape = shapes.get(name)
            if entry[c.PARAM].dim() == 1 and shape and len(shape) > 1 and entry[c.PARAM].numel() == math.prod(shape):
                entry[c.PARAM] = entry[c.PARAM].view(shape)  # ZeRO-3 writes flat tensors
            entry.setdefault(c.CAT_DIM, rule.dim or 0)
            if rule.stride == 2:
                entry.setdefault(c.PARAM_N_SUB_PARAMS, 2)
            if rule.vocab_padded:
                tensor = entry[c.PARAM][: config.vocab_size]
                entry[c.PARAM] = torch.cat([tensor, tensor.new_zeros((padded - tensor.size(0),) + tensor.shape[1:])])
                entry[c.VOCAB_TENSOR] = True
            torch.save(entry, file)
        step_file = os.path.join(folder, "step.pt")
        if os.path.isfile(step_file):
            step = torch.load(step_file, map_location="cpu", weights_only=False) if step is None else step
        elif step is not None:
            torch.save(step, step_file)
    optim.pop("fp32_flat_groups", None)  # ZeRO-3's copy of every weight, already in the per-parameter files
    optim.setdefault(c.DS_VERSION, deepspeed.__version__)
    optim["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": optim["param_groups"]}
    torch.save(optim, path)


def _is_zero0(ckpt: str) -> bool:
    """A checkpoint without ZeRO whose optimizer state is indexed by parameter (fp32, written with
    the canonical name of each position)."""
    from hybrid.checkpoint_format import OPTIMIZER_PARAM_NAMES, first_model_file, load_file
    if glob.glob(os.path.join(ckpt, "*optim_states.pt")):
        return False
    meta = load_file(first_model_file(ckpt))
    return bool(meta.get(OPTIMIZER_PARAM_NAMES)) and isinstance(meta.get("optimizer"), dict)


def _zero0_to_universal(ckpt: str, out_dir: str, config) -> None:
    """What ds_to_universal does for ZeRO partitions, written here for the one case it does not
    read (DeepSpeed has no universal conversion without ZeRO): each TP/PP rank's torch optimizer
    state (position-indexed, names recorded at save time) and weights, merged over TP into one
    directory per parameter in DeepSpeed's universal layout."""
    from deepspeed.checkpoint import constants as c

    from hybrid.checkpoint_format import OPTIMIZER_PARAM_NAMES, load_file, model_file
    from hybrid.conversion.layout import merge_shards, read_hybrid
    load_dir, tag = os.path.split(ckpt.rstrip(os.sep))
    weights, meta = read_hybrid(load_dir, tag)
    tp, pp = meta["hybrid_config"]["tensor_parallel"], meta["hybrid_config"]["pipeline_parallel"]
    moments = {"exp_avg": {}, "exp_avg_sq": {}}
    steps, param_groups = {}, None
    os.makedirs(out_dir, exist_ok=True)
    for stage in range(pp):
        for tp_rank in range(tp):
            path = os.path.join(ckpt, model_file(tp_rank, stage, tp))
            rank_state = load_file(path)
            shutil.copy2(path, out_dir)
            optimizer, names = rank_state["optimizer"], rank_state[OPTIMIZER_PARAM_NAMES]
            param_groups = param_groups or [{k: v for k, v in g.items() if k != "params"} for g in optimizer["param_groups"]]
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
    _normalize(zero, config, {})


def to_universal(load_dir: str, tag: str, log=print) -> str:
    """Convert `load_dir/tag` into `load_dir/tag_universal` (atomically) and point `latest_universal`
    at it. Returns the universal tag."""
    meta = read_meta(load_dir, tag)
    config = model_config_from_summary(meta["hybrid_config"])
    out_tag = tag + UNIVERSAL_SUFFIX
    target = os.path.join(load_dir, out_tag)
    with atomic_directory(target, replace=True) as tmp:  # a new conversion of the same tag replaces the old
        convert(os.path.join(load_dir, tag), tmp, config, log)
        hybrid = meta["hybrid_config"]
        with open(os.path.join(tmp, UNIVERSAL_INFO), "w") as f:
            json.dump({"source_tag": tag, "tensor_parallel": hybrid["tensor_parallel"],
                       "pipeline_parallel": hybrid["pipeline_parallel"], "data_parallel": hybrid["data_parallel"],
                       "iteration": meta.get("iteration")}, f)
    write_atomic(os.path.join(load_dir, LATEST_UNIVERSAL), out_tag)
    log(f"wrote universal checkpoint {target}; resume at any layout with --load {load_dir} --universal-checkpoint")
    return out_tag


def read_fp32_state(ckpt: str, config) -> dict:
    """Full canonical fp32 weights of any ZeRO checkpoint (ZeRO-3 at any TP included), through a
    universal conversion in a temporary directory."""
    tmp = tempfile.mkdtemp(prefix=".tmp-consolidate-")
    try:
        convert(ckpt, os.path.join(tmp, "universal"), config, log=lambda message: None)
        zero = os.path.join(tmp, "universal", "zero")
        state = {}
        for name in os.listdir(zero):
            path = os.path.join(zero, name, "fp32.pt")
            if os.path.isfile(path):
                state[name] = torch.load(path, map_location="cpu", weights_only=False)["param"]
        return state
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def universal_source(load_dir: str, tag: str) -> Optional[dict]:
    path = os.path.join(load_dir, tag, UNIVERSAL_INFO)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
