"""What a checkpoint directory holds, decided in one place, and its reader, one interface for every kind:
HuggingFace's (a transformers directory), hybrid's (launch/train.py's `latest` and DeepSpeed's files), Megatron-LM's
and Megatron-DeepSpeed's (hybrid.conversion.megatron). Training, evaluation and conversion call `checkpoint_kind` and
`open_source`; each source gives `config()`, `parts(config, wanted)` (its tensors a part at a time, this rank's only
where the format allows), `state(config)` (all of them), the layout it was saved at, its counters, and
`client_state()` (what a conversion of it records)."""

from __future__ import annotations

import os
from typing import Any, Iterator, Optional, Protocol

from hybrid.checkpoint.client_state import ClientState
from hybrid.checkpoint.files import read_tag
from hybrid.conversion.hf import hf_parts, read_hf_config, read_hf_dir
from hybrid.conversion.layout import hybrid_parts, open_hybrid, read_hybrid
from hybrid.conversion.megatron.lm import MegatronCheckpoint
from hybrid.conversion.megatron.megatron_deepspeed import MegatronDeepSpeedCheckpoint
from hybrid.conversion.megatron.source import megatron_kind, open_source as open_megatron_source
from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig

HF, HYBRID, MEGATRON_LM, MEGATRON_DEEPSPEED = "hf", "hybrid", MegatronCheckpoint.kind, MegatronDeepSpeedCheckpoint.kind
MEGATRON_KINDS = (MEGATRON_LM, MEGATRON_DEEPSPEED)


class CheckpointSource(Protocol):
    """What every reader open_source returns gives (HFSource, HybridSource, Megatron-LM's and Megatron-DeepSpeed's
    checkpoints): the model it holds, its tensors a part at a time or all at once, its counters, the layout it was
    saved at, and what a conversion of it records."""

    kind: str  # HF, HYBRID, MEGATRON_LM or MEGATRON_DEEPSPEED
    iteration: int
    consumed_samples: int
    args: Any  # the run's recorded flags (a dict, Megatron's Namespace), or None

    def config(self, true_vocab_size: Optional[int] = None) -> ModelConfig: ...

    def parts(self, config: ModelConfig, wanted: set) -> Iterator[dict]: ...

    def state(self, config: ModelConfig, progress=None) -> dict: ...

    def client_state(self) -> ClientState: ...

    @property
    def layout(self) -> tuple[int, int]: ...


def checkpoint_kind(path: str) -> Optional[str]:
    """HF, HYBRID, MEGATRON_LM or MEGATRON_DEEPSPEED, or None (nothing any reader takes): Megatron's pointer
    files first, then hybrid's `latest`, then a transformers `config.json`."""
    if not path or not os.path.isdir(path):
        return None
    kind = megatron_kind(path)
    if kind is not None:
        return kind
    if read_tag(path) is not None:
        return HYBRID
    if os.path.isfile(os.path.join(path, "config.json")):
        return HF
    return None


class HFSource:
    """A transformers directory: its config and safetensors (or .bin) weights; no counters."""

    kind, iteration, consumed_samples, args = HF, 0, 0, None

    def __init__(self, directory: str, flag: str):
        self.directory, self.flag = directory, flag

    def config(self, true_vocab_size: Optional[int] = None) -> ModelConfig:
        return read_hf_config(self.directory, self.flag)

    def parts(self, config: ModelConfig, wanted: set) -> Iterator[dict]:
        return hf_parts(self.directory, config, wanted, self.flag)

    def state(self, config: ModelConfig, progress=None) -> dict:
        return read_hf_dir(self.directory, progress, self.flag)[0]

    def client_state(self) -> ClientState:
        return ClientState()

    @property
    def layout(self) -> tuple[int, int]:
        return 1, 1


class HybridSource:
    """A launch/train.py checkpoint (its newest tag): the model and counters its client state records."""

    kind = HYBRID

    def __init__(self, directory: str, flag: str):
        checkpoint, _, self.saved = open_hybrid(directory, None)  # `latest`'s tag, its manifest checked
        self.directory, self.flag, self.tag = directory, flag, os.path.basename(checkpoint)

    @property
    def iteration(self) -> int:
        return int(self.saved.iteration)

    @property
    def consumed_samples(self) -> int:
        return int(self.saved.consumed_samples)

    @property
    def args(self) -> dict:
        return self.saved.args

    def config(self, true_vocab_size: Optional[int] = None) -> ModelConfig:
        return self.saved.model_config()

    def parts(self, config: ModelConfig, wanted: set) -> Iterator[dict]:
        return hybrid_parts(self.directory, self.tag, config, wanted)

    def state(self, config: ModelConfig, progress=None) -> dict:
        return read_hybrid(self.directory, self.tag, progress)[0]

    def client_state(self) -> ClientState:
        """What a conversion of it records: its counters, run summary and args."""
        return ClientState(iteration=self.saved.iteration, consumed_samples=self.saved.consumed_samples,
                           run=self.saved.run, args=self.saved.args)

    @property
    def layout(self) -> tuple[int, int]:
        return self.saved.layout.tensor_parallel, self.saved.layout.pipeline_parallel


def open_source(path: str, flag: str = "--load", kind: Optional[str] = None) -> CheckpointSource:
    """The reader of the checkpoint in `path` (`kind`: what the caller was told it is, e.g. --load-hf's HF;
    default: what checkpoint_kind finds). One message when there is none."""
    kind = kind or checkpoint_kind(path)
    if kind == HF:
        return HFSource(path, flag)
    if kind == HYBRID:
        return HybridSource(path, flag)
    if kind in MEGATRON_KINDS:
        return open_megatron_source(path, flag)
    if not os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: no such directory.")
    raise ConfigError(f"{flag} {path}: no checkpoint there: neither a hybrid checkpoint (no 'latest' file), a "
                      f"Megatron-LM one (no latest_checkpointed_iteration.txt), a Megatron-DeepSpeed one (no "
                      f"'latest' of DeepSpeed's with Megatron's args) nor a transformers directory (no config.json).")
