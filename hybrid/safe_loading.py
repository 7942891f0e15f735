"""Nothing hybrid loads runs code: every `torch.load` unpickles with `weights_only=True` and an
allow-list of the few classes checkpoints hold, in this process and in the child processes hybrid
starts (DeepSpeed's ds_to_universal).

The ground floor: training, evaluation, conversion and the conversion child process all use this
module, and it imports nothing of hybrid's but the error type.

- `safe_load(path)`: one file, weights only, the allow-list;
- `install_safe_torch_load(allow_unsafe)`: every later `torch.load` of the process (DeepSpeed's own
  loads included) the same way, once, at an entry point;
- `python -m hybrid.safe_loading [--allow-unsafe] MODULE ARGS...`: runs MODULE as `python -m MODULE
  ARGS...` would, after installing the safe load (how conversion starts DeepSpeed's tools).
"""

from __future__ import annotations

import argparse
import importlib
import os
import pickle
import runpy
import sys

import torch

from hybrid.errors import ConfigError

# The only classes DeepSpeed 0.19.8 pickles into the checkpoints hybrid writes (found by loading every
# file of ZeRO-0/1/2/3, offload, bf16, pipeline, virtual-stage and universal checkpoints with
# weights_only=True), plus fp16's dynamic loss scaler (GPU runs). Each is rebuilt from its fields
# without running code of the file's choosing.
SAFE_CHECKPOINT_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

# Megatron-LM checkpoints store its run's arguments (an argparse.Namespace: BUILD only sets attributes) whose
# values include a few of megatron-core's enums (--attention-backend, ...): each is rebuilt as MegatronEnum,
# a plain record of its name and value, so megatron-core need not be importable and none of its code runs.
MEGATRON_ENUMS = (
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.enums.ModelType",
    "megatron.core.enums.Fp8Recipe",
)


class MegatronEnum:
    """A megatron-core enum member read from a checkpoint's args: `value` (and the class's name)."""

    def __init__(self, value=None):
        self.value = value

    def __repr__(self) -> str:
        return f"MegatronEnum({self.value!r})"


UNSAFE_FLAG = "--allow-unsafe-checkpoint-load"  # restores full unpickling, for files one trusts
_LOADS = {"unsafe": False}  # this process's choice (set once by the entry point)
_ORIGINAL_TORCH_LOAD = torch.load


class UnsafeCheckpointError(ConfigError):
    """A file asked to unpickle something outside the allow-list (code could have run)."""


def _numpy_arrays() -> list:
    """What a pickled numpy array needs (Megatron-LM's and Megatron-DeepSpeed's files keep numpy's RNG state,
    a uint32 array): the array type, its rebuild from (type, shape, dtype) and the dtypes, as torch's
    documentation allow-lists numpy arrays for weights_only loads; none of it runs code of the file's choosing."""
    import numpy as np  # (with numpy's own module layout, 1.x or 2.x)
    multiarray = getattr(np, "_core", None) or np.core
    dtypes = [type(np.dtype(name)) for name in ("uint32", "int64", "int32", "float64", "float32", "bool", "uint8")]
    return [multiarray.multiarray._reconstruct, np.ndarray, np.dtype, *dtypes]


def safe_checkpoint_classes() -> list:
    """The allow-listed classes, imported by name (DeepSpeed's, so the import waits until a load)."""
    classes = [argparse.Namespace, *((MegatronEnum, name) for name in MEGATRON_ENUMS), *_numpy_arrays()]
    for path in SAFE_CHECKPOINT_CLASSES:
        module, _, name = path.rpartition(".")
        classes.append(getattr(importlib.import_module(module), name))
    return classes


def set_unsafe_loads(allowed: bool) -> None:
    _LOADS["unsafe"] = bool(allowed)


def unsafe_loads_allowed() -> bool:
    """Whether this process was started with UNSAFE_FLAG (child tools inherit the choice)."""
    return _LOADS["unsafe"]


def refusal(path, error) -> UnsafeCheckpointError:
    """The error for a file whose unpickling was refused: the file, the class, the way out."""
    text = str(error)
    refused = text.split("GLOBAL ", 1)[1].split()[0] if "GLOBAL " in text else text.splitlines()[0][:200]
    name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else getattr(path, "name", repr(path))
    return UnsafeCheckpointError(f"{name}: refused to unpickle {refused} (not one of the classes checkpoints "
                                 f"hold; loading it could run code from the file). If you trust this file, add "
                                 f"{UNSAFE_FLAG}.")


def safe_load(path, mmap: bool = False):
    """torch.load with weights_only=True and the allow-list: no code from the file runs. `mmap`: the
    file is memory-mapped and each tensor read when it is used."""
    # added for the process, not in torch's safe_globals context manager: its exit removes the classes
    # again, also for the process-wide allow-list install_safe_torch_load sets
    torch.serialization.add_safe_globals(safe_checkpoint_classes())
    try:
        return _ORIGINAL_TORCH_LOAD(path, map_location="cpu", weights_only=not unsafe_loads_allowed(), mmap=mmap)
    except pickle.UnpicklingError as error:
        if _refused(error):
            raise refusal(path, error) from None
        raise unreadable(path, error) from None
    except (RuntimeError, EOFError, OSError, KeyError, ValueError, IndexError) as error:
        # what torch raises for a truncated zip, a file that is no checkpoint (a text file: KeyError), a
        # legacy file asked for mmap, a missing file
        raise unreadable(path, error) from None


def _refused(error: pickle.UnpicklingError) -> bool:
    """Whether torch's weights-only unpickler refused a class (not: the bytes are no pickle at all)."""
    text = str(error)  # a class or function asked for by name; "Unsupported operand N": bytes that are no pickle
    return any(marker in text for marker in ("GLOBAL ", "unrecognized function", "Unsupported class"))


def unreadable(path, error) -> ConfigError:
    """The error for a file that is not a readable checkpoint file: the file, what was read, the way out."""
    name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else getattr(path, "name", repr(path))
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return ConfigError(f"checkpoint file {name} is unreadable ({type(error).__name__}: {first}); it is truncated, "
                       f"damaged or not a torch checkpoint file. Copy it again from where it was written.")


# What torch.distributed.checkpoint's `.metadata` pickle holds (torch 2.13; megatron-core's torch_dist adds
# only its save plans): torch reads that file with a plain pickle.load, so hybrid reads it with this allow-list
_DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
                                              "_MEM_FORMAT_ENCODING", "StorageMeta"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # megatron-core keeps its save plans in the metadata's planner_data (dataclasses of names and shapes)
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8",
              "bool", "float8_e4m3fn", "float8_e5m2"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # torch's own writer records the checkpoint's path
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name in _DCP_METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def load_dcp_metadata(path: str):
    """A torch.distributed.checkpoint `.metadata` file (its tensor shapes, chunks and where each chunk's bytes
    are), unpickled with the allow-list above: no code from the file runs."""
    with open(path, "rb") as f:
        if unsafe_loads_allowed():
            return pickle.load(f)
        try:
            return _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as error:
            raise refusal(path, error) from None


def install_safe_torch_load(allow_unsafe: bool = False) -> None:
    """Make every `torch.load` of this process (hybrid's, DeepSpeed's `load_checkpoint`, its ZeRO and
    universal-checkpoint loaders, zero_to_fp32, transformers') unpickle with `weights_only=True` and the
    allow-list, whatever the caller passes: DeepSpeed 0.19 calls `torch.load(..., weights_only=False)`
    in 20-odd places and has no hook for all of them (its checkpoint engine covers only some), so
    `torch.load` itself is replaced. A refused file raises UnsafeCheckpointError naming the file and
    the class. `allow_unsafe` (UNSAFE_FLAG) restores full unpickling, for files one trusts. Also sets
    TORCH_FORCE_WEIGHTS_ONLY_LOAD for child processes that do not install this."""
    set_unsafe_loads(allow_unsafe)
    if allow_unsafe:
        torch.load = _ORIGINAL_TORCH_LOAD
        os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        return
    torch.serialization.add_safe_globals(safe_checkpoint_classes())
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"

    def load(f, *args, weights_only=None, **kwargs):
        try:
            return _ORIGINAL_TORCH_LOAD(f, *args, weights_only=True, **kwargs)
        except pickle.UnpicklingError as error:
            if not _refused(error):  # damaged bytes: the caller's own handling, as with torch.load
                raise
            raise refusal(f, error) from None

    load.__doc__ = _ORIGINAL_TORCH_LOAD.__doc__
    torch.load = load


def child_command(module: str, *args: str) -> list:
    """The command line that runs `python -m module args...` in a child process under this process's
    loading rules (safe, or UNSAFE_FLAG's choice)."""
    unsafe = ["--allow-unsafe"] if unsafe_loads_allowed() else []
    return [sys.executable, "-m", "hybrid.safe_loading", *unsafe, module, *map(str, args)]


def main(argv: list) -> None:
    """`python -m hybrid.safe_loading [--allow-unsafe] MODULE ARGS...`: MODULE's `__main__` with every
    torch.load safe (a refused file exits with its one-line message)."""
    allow_unsafe = bool(argv) and argv[0] == "--allow-unsafe"
    argv = argv[1:] if allow_unsafe else argv
    if not argv:
        raise SystemExit("usage: python -m hybrid.safe_loading [--allow-unsafe] MODULE [ARGS...]")
    install_safe_torch_load(allow_unsafe)
    sys.argv = [argv[0], *argv[1:]]
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except UnsafeCheckpointError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main(sys.argv[1:])
