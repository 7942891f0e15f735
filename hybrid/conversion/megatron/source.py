"""Which Megatron checkpoint a path holds, and its reader: Megatron-LM's (hybrid.conversion.megatron.lm:
`latest_checkpointed_iteration.txt`, legacy or torch_dist) or Megatron-DeepSpeed's
(hybrid.conversion.megatron.megatron_deepspeed: DeepSpeed's files with Megatron's args). Both readers have one
interface (config, parts, state, iteration, consumed_samples, optimizer, args), so training, evaluation
and conversion take either."""

from __future__ import annotations

from typing import Optional

from hybrid.conversion.megatron.lm import MegatronCheckpoint, iteration_dir, open_megatron
from hybrid.conversion.megatron.megatron_deepspeed import (MegatronDeepSpeedCheckpoint, checkpoint_dir,
                                                           open_megatron_deepspeed)


def megatron_kind(path: str) -> Optional[str]:
    """"megatron-lm", "megatron-deepspeed", or None (hybrid's own checkpoint, or none)."""
    if iteration_dir(path) is not None:
        return MegatronCheckpoint.kind
    if checkpoint_dir(path) is not None:
        return MegatronDeepSpeedCheckpoint.kind
    return None


def open_source(path: str, flag: str = "--load") -> "MegatronCheckpoint | MegatronDeepSpeedCheckpoint":
    """The reader of the Megatron checkpoint in `path` (one message when there is none)."""
    if megatron_kind(path) == MegatronDeepSpeedCheckpoint.kind:
        return open_megatron_deepspeed(path)
    return open_megatron(path, flag)
