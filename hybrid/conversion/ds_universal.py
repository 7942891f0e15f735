"""DeepSpeed's universal checkpoint layout (one directory per parameter with its full fp32 weights and
Adam moments), as DeepSpeed's own `ds_to_universal` writes it, made loadable at any layout:
parameter directories under canonical names (hybrid.model.naming), one file form for every ZeRO
stage, and the model-states files under both stages' names. The lower layer of universal checkpoints:
it reads checkpoint files and runs DeepSpeed's tool, and never reads a hybrid checkpoint as a whole
(that is hybrid.conversion.layout, which uses `read_fp32_state` from here).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import tempfile
from typing import Optional

import deepspeed
import torch
from deepspeed.checkpoint import constants as c

from hybrid.checkpoint.tp_layout import join_vocab_blocks, tp_layout
from hybrid.errors import ConfigError
from hybrid.model.naming import EMBEDDING_WEIGHT, TIED_COPY_WEIGHT, canonical_name, vocab_block
from hybrid.safe_loading import child_command, safe_load

UNIVERSAL_INFO = "hybrid_universal.json"  # what the universal checkpoint was made from


def run_ds_to_universal(ckpt: str, out_dir: str, config, log=print) -> None:
    """DeepSpeed's ds_to_universal (strict mode) from the ZeRO checkpoint `ckpt` into the new directory
    `out_dir`, then the parameter directories renamed to canonical names and normalised. ZeRO-3 under a pipeline:
    stage by stage (`_zero3_stages`)."""
    stages = _zero3_stages(ckpt)
    if stages > 1:
        _zero3_per_stage(ckpt, out_dir, config, stages, log)
        return
    _run_tool(ckpt, out_dir, config, log)


def _run_tool(ckpt: str, out_dir: str, config, log) -> None:
    """DeepSpeed's ds_to_universal on one checkpoint as its tool reads it, then canonical names. A --optimizer
    muon checkpoint: from a view of it whose Muon partitions carry zero second moments (`_adam_view`)."""
    if _muon_checkpoint(ckpt):
        work = tempfile.mkdtemp(prefix=".tmp-muon-", dir=os.path.dirname(os.path.abspath(out_dir)))
        try:
            _run_tool_on(_adam_view(ckpt, work), out_dir, config, log)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    _run_tool_on(ckpt, out_dir, config, log)


def _muon_checkpoint(ckpt: str) -> bool:
    """Whether a ZeRO checkpoint was written by a --optimizer muon run (its client state's flags)."""
    files = sorted(n for n in os.listdir(ckpt) if n.endswith("_model_states.pt"))
    return bool(files) and (safe_load(os.path.join(ckpt, files[0]), mmap=True).get("args") or {}).get(
        "optimizer") == "muon"


def _adam_view(ckpt: str, work: str) -> str:
    """A copy of a --optimizer muon checkpoint as DeepSpeed's ds_to_universal reads Adam's (it takes exp_avg and
    exp_avg_sq of every group): the Muon groups' state is their momentum under `exp_avg` (an exponential average
    of the gradients, hybrid.training.muon) and no second moment, given zeros here; every other file linked."""
    view = os.path.join(work, os.path.basename(os.path.normpath(ckpt)))
    os.makedirs(view)
    for name in os.listdir(ckpt):
        source = os.path.abspath(os.path.join(ckpt, name))
        if not name.endswith("optim_states.pt"):
            os.symlink(source, os.path.join(view, name))
            continue
        state = safe_load(source)
        _add_second_moments(state)
        torch.save(state, os.path.join(view, name))
    return view


def _add_second_moments(value) -> None:
    """Zeros beside every exp_avg that has no exp_avg_sq (the Muon groups' optimizer state), in place."""
    if isinstance(value, dict):
        if torch.is_tensor(value.get("exp_avg")) and "exp_avg_sq" not in value:
            value["exp_avg_sq"] = torch.zeros_like(value["exp_avg"])
        for inner in value.values():
            _add_second_moments(inner)
    elif isinstance(value, (list, tuple)):
        for inner in value:
            _add_second_moments(inner)


def _run_tool_on(ckpt: str, out_dir: str, config, log) -> None:
    log(f"converting {ckpt} with DeepSpeed's ds_to_universal (strict)")
    # DeepSpeed's tool, in a process whose every torch.load is weights-only with the allow-list: it
    # reads the checkpoint's files
    proc = subprocess.run(child_command("deepspeed.checkpoint.ds_to_universal", "--input_folder", ckpt,
                                        "--output_folder", out_dir, "--num_extract_workers", 1,
                                        "--num_merge_workers", 1), capture_output=True, text=True)
    if proc.returncode != 0:
        refused = [line for line in proc.stderr.splitlines() if line.startswith("error: ") and "refused" in line]
        if refused:
            raise ConfigError(refused[-1][len("error: "):])
        raise ConfigError(f"DeepSpeed's ds_to_universal failed on {ckpt}:\n{proc.stderr.strip()[-3000:]}")
    zero = os.path.join(out_dir, "zero")
    for name in sorted(os.listdir(zero)):
        if not os.path.isdir(os.path.join(zero, name)):
            continue  # optimizer_state.pt
        if name == TIED_COPY_WEIGHT:
            continue  # the second copy of a tied table: drop_tied_copy keeps one of the two
        canonical = canonical_name(name, config.num_layers)
        if canonical is not None and canonical != name:
            os.replace(os.path.join(zero, name), os.path.join(zero, canonical))
    drop_tied_copy(zero)
    shapes = _param_shapes(out_dir, config)
    join_block_folders(zero, shapes)
    normalize(zero, config, shapes)
    alias_model_files(out_dir)


def _zero3_stages(ckpt: str) -> int:
    """The pipeline stages of a ZeRO-3 checkpoint (1 for every other kind): its recorded PP size."""
    files = [n for n in os.listdir(ckpt) if re.fullmatch(r"zero_pp_rank_0_mp_rank_\d+_model_states\.pt", n)]
    if not files:
        return 1
    layout = safe_load(os.path.join(ckpt, sorted(files)[0])).get("layout") or {}
    return int(layout.get("pipeline_parallel", 1) or 1)


def _zero3_per_stage(ckpt: str, out_dir: str, config, stages: int, log) -> None:
    """DeepSpeed 0.19.8's ds_to_universal reads a ZeRO-3 checkpoint's `mp_rank` as the TP rank (ZeRO-3 never ran
    under DeepSpeed's pipeline), so a pipeline's stages (mp_rank = stage x TP + TP rank) would be merged as TP
    shards. Each stage is converted on its own, from a directory of links naming its files as a one-stage
    checkpoint's, and the stages' parameter directories (disjoint canonical names) are put together."""
    names = os.listdir(ckpt)
    ranks = sorted({int(m.group(1)) for n in names if (m := re.fullmatch(r"zero_pp_rank_\d+_mp_rank_(\d+)_.*", n))})
    tp = len(ranks) // stages
    os.makedirs(out_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".tmp-stages-", dir=os.path.dirname(os.path.abspath(out_dir)))
    try:
        for stage in range(stages):
            view = os.path.join(work, f"stage{stage}", os.path.basename(ckpt))
            os.makedirs(view)
            for name in names:
                m = re.fullmatch(r"(zero_pp_rank_\d+_mp_rank_)(\d+)(_.*)", name)
                if m and stage * tp <= int(m.group(2)) < (stage + 1) * tp:
                    os.symlink(os.path.abspath(os.path.join(ckpt, name)),
                               os.path.join(view, f"{m.group(1)}{int(m.group(2)) - stage * tp:02d}{m.group(3)}"))
            for name in ("latest",):
                if os.path.exists(os.path.join(os.path.dirname(ckpt), name)):
                    shutil.copy2(os.path.join(os.path.dirname(ckpt), name), os.path.dirname(view))
            part = os.path.join(work, f"stage{stage}_universal")
            log(f"converting stage {stage} of {stages} of {ckpt} with DeepSpeed's ds_to_universal (strict)")
            _run_tool(view, part, config, log=lambda message: None)
            for name in os.listdir(os.path.join(part, "zero")):
                target = os.path.join(out_dir, "zero", name)
                if name == "optimizer_state.pt" and stage > 0:
                    continue  # the same hyperparameters and step on every stage: the first's
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.replace(os.path.join(part, "zero", name), target)
            for name in os.listdir(part):  # the model-states files (client state, schedule), under global mp ranks
                m = re.fullmatch(r"(.*mp_rank_)(\d+)(_model_states\.pt)", name)
                if m:
                    os.replace(os.path.join(part, name),
                               os.path.join(out_dir, f"{m.group(1)}{int(m.group(2)) + stage * tp:02d}{m.group(3)}"))
                elif name != "zero" and stage == 0:
                    os.replace(os.path.join(part, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def drop_tied_copy(zero: str) -> None:
    """Virtual pipeline stages keep a second copy of a tied embedding table on the last stage's rank;
    it received the same summed gradients and updates as the first, so its weights and Adam moments
    are the embedding's: keep one, under the canonical name."""
    copy = os.path.join(zero, TIED_COPY_WEIGHT)
    if os.path.isdir(copy):
        original = os.path.join(zero, EMBEDDING_WEIGHT)
        if os.path.isdir(original):
            shutil.rmtree(copy)
        else:
            os.replace(copy, original)


def join_block_folders(zero: str, shapes: dict) -> None:
    """A vocabulary table that ZeRO-3 held in row blocks (hybrid.model.naming.vocab_block) as the one directory of
    the table: its weights and moments joined (hybrid.checkpoint.tp_layout.join_vocab_blocks; each block's TP
    slices, which ds_to_universal put one after the other, counted from the block's shape in `shapes`), its step
    the blocks' one step."""
    tables: dict[str, list] = {}
    for name in sorted(os.listdir(zero)):
        if vocab_block(name) is not None and os.path.isdir(os.path.join(zero, name)):
            tables.setdefault(vocab_block(name)[0], []).append(name)
    for table, blocks in tables.items():
        folder = os.path.join(zero, table)
        os.makedirs(folder)
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            pieces, tp = {}, 1
            for name in blocks:
                value = safe_load(os.path.join(zero, name, f"{key}.pt"))
                tensor = value[c.PARAM] if isinstance(value, dict) else value
                rows, width = shapes[name]
                pieces[name] = tensor.reshape(-1, width)  # ZeRO-3 writes flat tensors
                tp = pieces[name].size(0) // rows
            torch.save({c.PARAM: join_vocab_blocks(pieces, tp)[table], c.CAT_DIM: 0}, os.path.join(folder, f"{key}.pt"))
        step = os.path.join(zero, blocks[0], "step.pt")
        if os.path.isfile(step):
            shutil.copy2(step, os.path.join(folder, "step.pt"))
        for name in blocks:
            shutil.rmtree(os.path.join(zero, name))


def _param_shapes(out_dir: str, config) -> dict:
    """Canonical name -> shape, from the model-states files' `param_shapes` (ZeRO-3's universal files
    hold flat tensors)."""
    shapes = {}
    for name in os.listdir(out_dir):
        if name.endswith("_model_states.pt"):
            groups = safe_load(os.path.join(out_dir, name)).get("param_shapes")
            for group in groups or []:
                for param, shape in group.items():
                    shapes.setdefault(canonical_name(param, config.num_layers), tuple(shape))
            break
    return shapes


def alias_model_files(out_dir: str) -> None:
    """DeepSpeed reads a universal checkpoint's metadata (client state, LR scheduler) from the
    model-states file its target stage expects: `mp_rank_XX_...` for ZeRO-1/2, `zero_pp_rank_0_mp_rank_XX_...`
    for ZeRO-3; ds_to_universal copies only the source's kind. Link the other name to it."""
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


def normalize(zero: str, config, shapes: dict) -> None:
    """One layout for universal checkpoints from any ZeRO stage, loadable by any stage: DeepSpeed
    0.19 writes ZeRO-3's per-parameter files as bare tensors without a step, keeps vocabulary padding,
    and its global optimizer file differs per stage (ZeRO-1/2 loads read `param_groups` and
    `ds_version`, ZeRO-3 loads read `optimizer_state_dict`). Here every file is DeepSpeed's
    ZeRO-1/2 dict form (`param`, `cat_dim`, `vocab_tensor`), vocabulary rows are padded as at TP = 1
    (ZeRO-1/2 loads pad further for their TP; ZeRO-3 loads at TP = 1 take them as they are), each
    parameter has its `step`, and the global file carries both stages' keys."""

    path = os.path.join(zero, "optimizer_state.pt")
    optim = safe_load(path)
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
            value = safe_load(file)
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
            step = safe_load(step_file) if step is None else step
        elif step is not None:
            torch.save(step, step_file)
    optim.pop("fp32_flat_groups", None)  # ZeRO-3's copy of every weight, already in the per-parameter files
    optim.setdefault(c.DS_VERSION, deepspeed.__version__)
    optim["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": optim["param_groups"]}
    torch.save(optim, path)


def read_fp32_state(ckpt: str, config) -> dict:
    """Full canonical fp32 weights of any ZeRO checkpoint (ZeRO-3 at any TP included), through a
    universal conversion in a temporary directory."""
    tmp = tempfile.mkdtemp(prefix=".tmp-consolidate-")
    try:
        run_ds_to_universal(ckpt, os.path.join(tmp, "universal"), config, log=lambda message: None)
        zero = os.path.join(tmp, "universal", "zero")
        state = {}
        for name in os.listdir(zero):
            path = os.path.join(zero, name, "fp32.pt")
            if os.path.isfile(path):
                state[name] = safe_load(path)["param"]
        return state
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def universal_source(load_dir: str, tag: str) -> Optional[dict]:
    path = os.path.join(load_dir, tag, UNIVERSAL_INFO)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
