"""Checkpoint files and pointers: the names DeepSpeed gives each file, a tag per iteration
(`iter_0000100`), the pointer files (`latest`, Megatron's `latest_checkpointed_iteration.txt`,
`latest_universal`) replaced atomically, and reading one file safely.

- DeepSpeed's files: `mp_rank_XX_model_states.pt` (one per TP x PP rank), `layer_NN-model_TT-model_states.pt`
  (its pipeline engine: one per layer and TP rank), ZeRO's `*_optim_states.pt`, MoE's expert files.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from typing import Optional

from hybrid.errors import ConfigError
from hybrid.safe_loading import safe_load

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"  # Megatron-DeepSpeed's pointer to a universal checkpoint
MEGATRON_LATEST = "latest_checkpointed_iteration.txt"
UNIVERSAL_SUFFIX = "_universal"


def tag_for(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def iteration_of(tag: str) -> Optional[int]:
    """The iteration an iter_NNNNNNN tag names (None for other names)."""
    match = re.fullmatch(r"iter_(\d{7,})", tag or "")  # (tag_for writes 8 digits from iteration 10,000,000)
    return int(match.group(1)) if match else None


def write_atomic(path: str, text: str) -> None:
    """Write a small file under a temporary name, then rename it into place."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_latest(directory: str, tag: str) -> None:
    """Point `directory`'s `latest` at `tag`, and Megatron-LM's latest_checkpointed_iteration.txt at its iteration
    (what Megatron's tools read); each replaced atomically."""
    write_atomic(os.path.join(directory, LATEST), tag)
    write_atomic(os.path.join(directory, MEGATRON_LATEST), str(iteration_of(tag)))


@contextlib.contextmanager
def atomic_directory(target: str, replace: bool = False, flag: str = "--save-dir"):
    """Yield a new temporary directory beside `target`; when the block completes it is renamed to
    `target`, so readers see a complete directory or none (on any error it is removed); a `target` replaced is
    moved aside whole first and removed once the new one is in place, so no crash leaves a part of either. An existing
    `target` must be empty unless `replace`; `flag` names it in that error."""
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    if not replace and os.path.isdir(target) and os.listdir(target):
        raise ConfigError(f"{flag} {target} exists and is not empty; choose a new directory.")
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        yield tmp
        aside = None
        if os.path.isdir(target):  # empty, or replaced on purpose: moved aside whole, removed once the new one is in
            aside = tempfile.mkdtemp(prefix=".old-", dir=parent)
            os.replace(target, os.path.join(aside, "old"))
        try:
            os.replace(tmp, target)
        except BaseException:
            if aside is not None:  # the old one back where it was
                os.replace(os.path.join(aside, "old"), target)
                os.rmdir(aside)
            raise
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_tag(load_dir: str, pointer: str = LATEST) -> Optional[str]:
    """The tag a pointer file names (None without the file); the tag's directory must exist."""
    path = os.path.join(load_dir, pointer)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    if not os.path.isdir(os.path.join(load_dir, tag)):
        raise ConfigError(f"--load {load_dir}: '{pointer}' names {tag!r}, which does not exist; the checkpoint "
                          f"directory is incomplete.")
    return tag


def model_file(tp_rank: int, pp_rank: int = 0, tp: int = 1) -> str:
    return f"mp_rank_{pp_rank * tp + tp_rank:02d}_model_states.pt"


def layer_file(index: int, tp_rank: int) -> str:
    return f"layer_{index:02d}-model_{tp_rank:02d}-model_states.pt"


def load_file(path: str, mmap: bool = False) -> dict:
    """One DeepSpeed checkpoint file (hybrid.safe_loading.safe_load; `mmap`: its tensors read when used),
    or a clear error when it is missing."""
    if not os.path.isfile(path):
        raise ConfigError(f"checkpoint file {path} is missing; the checkpoint is incomplete.")
    return safe_load(path, mmap=mmap)


def first_model_file(ckpt: str) -> str:
    for name in (model_file(0), "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if os.path.isfile(os.path.join(ckpt, name)):
            return os.path.join(ckpt, name)
    raise ConfigError(f"{ckpt}: no mp_rank_00 model states file; not a checkpoint written by launch/train.py --save.")
