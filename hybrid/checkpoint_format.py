"""The checkpoint format, declared once and used by training, conversion and evaluation alike.

- Files: DeepSpeed's (`mp_rank_XX_model_states.pt`; `layer_NN-model_TT-model_states.pt` for pipeline
  stages; ZeRO's `*_optim_states.pt`), a tag per iteration (`iter_0000100`), and pointer files
  (`latest`, Megatron's `latest_checkpointed_iteration.txt`, `latest_universal`) replaced atomically.
- Parameter layout: each parameter's tensor-parallel split (names: hybrid.model.naming). The TP split is read from the layers' own attributes (`partition_dim`,
  `partition_stride`, `vocab_padded`, set where each parameter is made), not restated here;
  checkpoint partitioning, DeepSpeed's `universal_checkpoint_info` and conversion all derive from it.
- Client state: what hybrid adds to DeepSpeed's files (`ClientState`), written and read only through it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import shutil
import tempfile
from typing import Optional

import torch

from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig
from hybrid.model.naming import pipeline_name

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"  # Megatron-DeepSpeed's pointer to a universal checkpoint
MEGATRON_LATEST = "latest_checkpointed_iteration.txt"
UNIVERSAL_SUFFIX = "_universal"


def tag_for(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def iteration_of(tag: str) -> Optional[int]:
    """The iteration an iter_NNNNNNN tag names (None for other names)."""
    match = re.fullmatch(r"iter_(\d{7})", tag or "")
    return int(match.group(1)) if match else None


def write_atomic(path: str, text: str) -> None:
    """Write a small file under a temporary name, then rename it into place."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_directory(target: str, replace: bool = False, flag: str = "--save-dir"):
    """Yield a new temporary directory beside `target`; when the block completes it is renamed to
    `target`, so readers see a complete directory or none (on any error it is removed). An existing
    `target` must be empty unless `replace`; `flag` names it in that error."""
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    if not replace and os.path.isdir(target) and os.listdir(target):
        raise ConfigError(f"{flag} {target} exists and is not empty; choose a new directory.")
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        yield tmp
        if os.path.isdir(target):
            shutil.rmtree(target)  # empty, or replaced on purpose
        os.replace(tmp, target)
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


# --- integrity: every checkpoint lists its files -------------------------------------------------

MANIFEST = "hybrid_manifest.json"  # in each tag's directory, written once every rank's files are complete
_SAMPLE_BYTES = 1 << 16  # the checksum covers each file's first and last 64 KiB: cheap, and catches truncation


def file_digest(path: str) -> dict:
    """Size and a CRC-32 of the head and tail of one file."""
    import zlib
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        crc = zlib.crc32(f.read(_SAMPLE_BYTES))
        if size > _SAMPLE_BYTES:
            f.seek(max(_SAMPLE_BYTES, size - _SAMPLE_BYTES))
            crc = zlib.crc32(f.read(), crc)
    return {"size": size, "crc32": crc}


def _checkpoint_files(ckpt: str) -> list[str]:
    files = []
    for folder, _, names in os.walk(ckpt):
        files += [os.path.relpath(os.path.join(folder, n), ckpt) for n in names if n != MANIFEST]
    return sorted(files)


def write_manifest(ckpt: str) -> None:
    """Record every file of the checkpoint directory `ckpt` with its size and checksum (atomically)."""
    manifest = {name: file_digest(os.path.join(ckpt, name)) for name in _checkpoint_files(ckpt)}
    write_atomic(os.path.join(ckpt, MANIFEST), json.dumps({"files": manifest}, indent=0, sort_keys=True))


def verify_manifest(ckpt: str) -> Optional[str]:
    """None if every file the manifest lists is there with its size and checksum (or the checkpoint has
    no manifest: written before hybrid recorded one), else what is wrong, naming the file."""
    path = os.path.join(ckpt, MANIFEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        files = json.load(f)["files"]
    for name, want in files.items():
        file = os.path.join(ckpt, name)
        if not os.path.isfile(file):
            return f"{file} is missing"
        got = file_digest(file)
        if got["size"] != want["size"]:
            return f"{file} has {got['size']} bytes, {want['size']} were written (truncated or replaced)"
        if got["crc32"] != want["crc32"]:
            return f"{file} does not match the checksum written with it (corrupt or replaced)"
    return None


def has_manifest(ckpt: str) -> bool:
    return os.path.isfile(os.path.join(ckpt, MANIFEST))


def complete_tags(load_dir: str) -> list[str]:
    """The iteration tags in `load_dir` whose manifest verifies, newest first."""
    tags = [n for n in os.listdir(load_dir) if re.fullmatch(r"iter_\d{7}", n) and has_manifest(os.path.join(load_dir, n))]
    return [t for t in sorted(tags, reverse=True) if verify_manifest(os.path.join(load_dir, t)) is None]


def model_file(tp_rank: int, pp_rank: int = 0, tp: int = 1) -> str:
    return f"mp_rank_{pp_rank * tp + tp_rank:02d}_model_states.pt"


def layer_file(index: int, tp_rank: int) -> str:
    return f"layer_{index:02d}-model_{tp_rank:02d}-model_states.pt"


# The only classes DeepSpeed 0.19.8 pickles into the checkpoints hybrid writes (found by loading every
# file of ZeRO-0/1/2/3, offload, bf16, pipeline, virtual-stage and universal checkpoints with
# weights_only=True), plus fp16's dynamic loss scaler (GPU runs). Each is rebuilt from its fields
# without running code of the file's choosing. Every load in hybrid's processes uses this list
# (hybrid.training.deepspeed_fixes.install_safe_torch_load covers DeepSpeed's own loads).
SAFE_CHECKPOINT_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def safe_checkpoint_classes() -> list:
    import importlib
    classes = []
    for path in SAFE_CHECKPOINT_CLASSES:
        module, _, name = path.rpartition(".")
        classes.append(getattr(importlib.import_module(module), name))
    return classes


UNSAFE_FLAG = "--allow-unsafe-checkpoint-load"  # restores full unpickling, for files one trusts
_LOADS = {"unsafe": False}  # this process's choice (set once by the entry point)


def set_unsafe_loads(allowed: bool) -> None:
    _LOADS["unsafe"] = bool(allowed)


def unsafe_loads_allowed() -> bool:
    """Whether this process was started with UNSAFE_FLAG (child tools inherit the choice)."""
    return _LOADS["unsafe"]


class UnsafeCheckpointError(ConfigError):
    """A file asked to unpickle something outside the allow-list (code could have run)."""


def refusal(path, error) -> UnsafeCheckpointError:
    """The error for a file whose unpickling was refused: the file, the class, the way out."""
    text = str(error)
    refused = text.split("GLOBAL ", 1)[1].split()[0] if "GLOBAL " in text else text.splitlines()[0][:200]
    name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else getattr(path, "name", repr(path))
    return UnsafeCheckpointError(f"{name}: refused to unpickle {refused} (not one of the classes checkpoints "
                                 f"hold; loading it could run code from the file). If you trust this file, add "
                                 f"{UNSAFE_FLAG}.")


def safe_load(path: str):
    """torch.load with weights_only=True and the allow-list: no code from the file runs."""
    import pickle
    # added for the process, not in torch's safe_globals context manager: its exit removes the classes
    # again, also for the process-wide allow-list hybrid.training.deepspeed_fixes installs
    torch.serialization.add_safe_globals(safe_checkpoint_classes())
    try:
        return torch.load(path, map_location="cpu", weights_only=not unsafe_loads_allowed())
    except pickle.UnpicklingError as error:
        raise refusal(path, error) from None


def load_file(path: str) -> dict:
    """One DeepSpeed checkpoint file (safe_load), or a clear error when it is missing."""
    if not os.path.isfile(path):
        raise ConfigError(f"checkpoint file {path} is missing; the checkpoint is incomplete.")
    return safe_load(path)


def first_model_file(ckpt: str) -> str:
    for name in (model_file(0), "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if os.path.isfile(os.path.join(ckpt, name)):
            return os.path.join(ckpt, name)
    raise ConfigError(f"{ckpt}: no mp_rank_00 model states file; not a checkpoint written by launch/train.py --save.")


def read_meta(load_dir: str, tag: str) -> dict:
    """Client state and DeepSpeed metadata of a checkpoint (rank 0's model-states file, weights dropped)."""
    meta = load_file(first_model_file(os.path.join(load_dir, tag)))
    meta.pop("module", None)
    return meta


@dataclasses.dataclass
class ClientState:
    """What hybrid adds to DeepSpeed's checkpoint files (DeepSpeed's `client_state`, stored beside its
    own keys in every model-states file), declared once: training writes it at each save, conversion
    when it writes weights, and every reader goes through `ClientState.from_meta`."""

    iteration: int = 0  # iterations done
    consumed_samples: int = 0  # the sampler's position (hybrid.training.batches)
    hybrid_config: dict = dataclasses.field(default_factory=dict)  # hybrid.config.config_summary: model, layout
    args: dict = dataclasses.field(default_factory=dict)  # the parsed flags (--use-checkpoint-args)
    rng_states: Optional[dict] = None  # every RNG stream (hybrid.parallel.random.get_rng_states)
    universal_checkpoint_info: Optional[dict] = None  # DeepSpeed's patterns for ds_to_universal
    optimizer_param_names: Optional[list] = None  # canonical names in optimizer order (no ZeRO only)
    weights_only: bool = False  # written by conversion: weights, no optimizer state

    def to_dict(self) -> dict:
        """The client state handed to DeepSpeed's save_checkpoint."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_meta(cls, meta: Optional[dict]) -> "ClientState":
        """From a model-states file's contents (or DeepSpeed's returned client state); DeepSpeed's own
        keys are left out. Checkpoints that predate `zero_stage` in hybrid_config take it from
        DeepSpeed's recorded config."""
        meta = meta or {}
        state = cls(**{f.name: meta[f.name] for f in dataclasses.fields(cls) if meta.get(f.name) is not None})
        state.hybrid_config = dict(state.hybrid_config)
        if "zero_stage" not in state.hybrid_config:
            stage = ((meta.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0)
            state.hybrid_config["zero_stage"] = int(stage)
        return state

    # the layout the checkpoint was written at
    def layout(self, key: str, default=None):
        return self.hybrid_config.get(key, default)

    @property
    def tensor_parallel(self) -> int:
        return int(self.layout("tensor_parallel", 1))

    @property
    def pipeline_parallel(self) -> int:
        return int(self.layout("pipeline_parallel", 1))

    @property
    def zero_stage(self) -> int:
        return int(self.layout("zero_stage", 0))

    @property
    def storage(self) -> str:
        """How the weights are stored: "module" (one mp_rank file per TP rank), "zero3" (ZeRO-3
        partitions), "layer_files" (DeepSpeed's pipeline engine, and conversion at PP > 1: one file per
        layer and TP rank) or "virtual_stages" (one file per TP x PP rank, canonical names)."""
        if self.pipeline_parallel > 1:
            if self.weights_only or self.layout("pipeline_schedule", "1f1b") == "1f1b":
                return "layer_files"
            return "virtual_stages"
        if self.zero_stage == 3 and not self.weights_only:
            return "zero3"
        return "module"

    def model_config(self) -> ModelConfig:
        if "model" not in self.hybrid_config:
            raise ConfigError("the checkpoint has no hybrid_config; it was not written by hybrid.")
        return model_config_from_summary(self.hybrid_config)


def read_client_state(load_dir: str, tag: str) -> ClientState:
    """The client state of checkpoint `load_dir/tag` (from rank 0's model-states file)."""
    return ClientState.from_meta(read_meta(load_dir, tag))


def model_summary(config: ModelConfig) -> dict:
    return dataclasses.asdict(config)


def model_config_from_summary(summary: dict) -> ModelConfig:
    fields = dict(summary["model"])
    fields.pop("params_dtype", None)  # written by checkpoints before the setting was removed
    return ModelConfig(**fields)


# --- parameter layout --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TPRule:
    """How one parameter is split over TP ranks (read from the parameter's attributes)."""

    dim: Optional[int]  # the split dimension; None: replicated on every TP rank
    stride: int = 1  # 2: [gate; up] halves each split (SwiGLU's fc1)
    vocab_padded: bool = False  # vocabulary rows, padded to a multiple of make-vocab-size-divisible-by x TP


def tp_layout(config: ModelConfig) -> dict[str, TPRule]:
    """Canonical name -> TPRule for every parameter of a model with this config."""
    return dict(_tp_layout(json.dumps(dataclasses.asdict(config), sort_keys=True)))


@functools.lru_cache(maxsize=16)
def _tp_layout(config_json: str) -> tuple:
    from hybrid.model.gpt import GPTModel
    from hybrid.parallel.groups import ParallelGroups
    config = ModelConfig(**json.loads(config_json))
    # a tiny model of the same structure (names and layers depend on the options, not the sizes)
    tiny = dataclasses.replace(config, hidden_size=2 * config.num_attention_heads, ffn_hidden_size=2, vocab_size=8,
                               max_position_embeddings=2, make_vocab_size_divisible_by=1,
                               **({"moe_ffn_hidden_size": 2} if config.num_experts else {}),
                               **({"moe_shared_expert_intermediate_size": 2}
                                  if config.moe_shared_expert_intermediate_size else {}))
    rules = []
    for name, param in GPTModel(tiny, ParallelGroups.single()).named_parameters():
        split = getattr(param, "tensor_model_parallel", False)
        rules.append((name, TPRule(param.partition_dim if split else None, getattr(param, "partition_stride", 1),
                                   getattr(param, "vocab_padded", False))))
    return tuple(rules)


def universal_checkpoint_info(config: ModelConfig, tp: int, pipeline: bool, tied_copy: Optional[str] = None) -> dict:
    """DeepSpeed's `universal_checkpoint_info` for this model: one exact pattern per parameter (in
    the names DeepSpeed's files use: pipeline names when `pipeline`), derived from tp_layout, so
    `ds_to_universal` in strict mode finds every pattern used. `tied_copy`: the name of a second copy
    of the tied embedding table (virtual pipeline stages), a vocabulary parameter too."""
    from deepspeed.checkpoint import constants as c
    groups = {c.VOCABULARY_PARAMETER_PATTERNS: [], c.TP_REPLICATED_PARAMETER_PATTERNS: [],
              c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [], c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: []}
    for name, rule in tp_layout(config).items():
        pattern = "^" + re.escape(pipeline_name(name, config.num_layers, config.tied_embeddings) if pipeline
                                  else name) + "$"
        if rule.vocab_padded:
            groups[c.VOCABULARY_PARAMETER_PATTERNS].append(pattern)
        elif rule.dim is None:
            groups[c.TP_REPLICATED_PARAMETER_PATTERNS].append(pattern)
        elif rule.dim == 1:
            groups[c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS].append(pattern)
        elif rule.stride == 2:
            groups[c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0].append(pattern)
        # column-parallel (dim 0, stride 1) is DeepSpeed's default: concatenated along dim 0
    if tied_copy is not None:
        groups[c.VOCABULARY_PARAMETER_PATTERNS].append("^" + re.escape(tied_copy) + "$")
    info = {c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            c.ORIGINAL_VOCAB_SIZE: config.vocab_size, c.PADDED_VOCAB_SIZE: config.padded_vocab_size(tp),
            c.PARAMETER_TO_AVERAGE_PATTERNS: []}
    info.update({key: patterns for key, patterns in groups.items() if patterns})
    return info
