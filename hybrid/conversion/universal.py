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
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

import torch

from hybrid.checkpoint_format import (LATEST_UNIVERSAL, UNIVERSAL_SUFFIX, canonical_name, model_config_from_summary,
                                      read_meta, write_atomic)
from hybrid.errors import ConfigError

UNIVERSAL_INFO = "hybrid_universal.json"  # what the universal checkpoint was made from


def _check_convertible(ckpt: str) -> None:
    if not glob.glob(os.path.join(ckpt, "*optim_states.pt")):
        raise ConfigError(f"{ckpt} holds no ZeRO optimizer files (a ZeRO-0 fp32 run): DeepSpeed's universal "
                          f"checkpoints are made from ZeRO-1/2/3 (or bf16) optimizer partitions. Train with "
                          f"ds_configs/zero1.json, or reshard the weights only with conversion/checkpoint_util.py "
                          f"--target-tensor-parallel-size N --target-pipeline-parallel-size M.")


def convert(ckpt: str, out_dir: str, config, log=print) -> None:
    """DeepSpeed's ds_to_universal (strict mode) from `ckpt` into the new directory `out_dir`, then the
    parameter directories renamed to canonical names."""
    _check_convertible(ckpt)
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


def to_universal(load_dir: str, tag: str, log=print) -> str:
    """Convert `load_dir/tag` into `load_dir/tag_universal` (atomically) and point `latest_universal`
    at it. Returns the universal tag."""
    meta = read_meta(load_dir, tag)
    config = model_config_from_summary(meta["hybrid_config"])
    out_tag = tag + UNIVERSAL_SUFFIX
    target = os.path.join(load_dir, out_tag)
    tmp = tempfile.mkdtemp(prefix=".tmp-universal-", dir=load_dir)
    try:
        convert(os.path.join(load_dir, tag), tmp, config, log)
        hybrid = meta["hybrid_config"]
        with open(os.path.join(tmp, UNIVERSAL_INFO), "w") as f:
            json.dump({"source_tag": tag, "tensor_parallel": hybrid["tensor_parallel"],
                       "pipeline_parallel": hybrid["pipeline_parallel"], "data_parallel": hybrid["data_parallel"],
                       "iteration": meta.get("iteration")}, f)
        if os.path.exists(target):
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
