"""How long a run is and how its learning rate moves: Megatron's iteration-, sample- and
token-based forms, and the linear global-batch ramp-up (--rampup-batch-size).

Megatron-LM counts its LR schedule in samples whatever the flags (iterations are converted
with the global batch); Megatron-DeepSpeed adds tokens (samples x sequence length). Both are
kept here as one "unit" per run, so iteration-, sample- and token-based flags give the same
schedule where they describe the same run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from hybrid.errors import ConfigError


@dataclass(frozen=True)
class Rampup:
    """--rampup-batch-size START INCREMENT SAMPLES (Megatron's RampupBatchsizeNumMicroBatches)."""

    start: int  # global batch at the start
    increment: int  # added at each step of the ramp
    samples: int  # samples over which the batch ramps up to --global-batch-size

    def batch_size(self, consumed_samples: int, global_batch: int) -> int:
        """The global batch for the iteration that starts after `consumed_samples`."""
        if consumed_samples > self.samples:
            return global_batch
        increments = (global_batch - self.start) // self.increment
        per_increment = self.samples / increments
        return min(global_batch, self.start + int(consumed_samples / per_increment) * self.increment)


@dataclass(frozen=True)
class RunLength:
    """The resolved length and LR schedule of a run."""

    train_iters: int  # iterations to run
    train_samples: int  # samples the training split must provide
    train_tokens: Optional[int]  # --train-tokens: stop once this many tokens were consumed
    lr_unit: str  # "samples" or "tokens": what the LR schedule counts
    lr_warmup_steps: int  # warmup length, in lr_unit
    lr_decay_steps: int  # decay length, in lr_unit
    rampup: Optional[Rampup]  # --rampup-batch-size, or None


def _rampup(args, global_batch: int, micro_dp: int) -> Optional[Rampup]:
    if not args.rampup_batch_size:
        return None
    try:
        start, increment, samples = (int(x) for x in args.rampup_batch_size)
    except ValueError:
        raise ConfigError(f"--rampup-batch-size {' '.join(args.rampup_batch_size)}: expected three integers "
                          f"START INCREMENT SAMPLES, e.g. 16 16 5859375.") from None
    if start < 1 or increment < 1 or samples < 1 or (global_batch - start) % increment or start > global_batch:
        raise ConfigError(f"--rampup-batch-size {start} {increment} {samples}: --global-batch-size {global_batch} "
                          f"minus the start must be a non-negative multiple of the increment.")
    for size in range(start, global_batch + 1, increment):
        if size % micro_dp:
            raise ConfigError(f"--rampup-batch-size: a global batch of {size} on the ramp is not a multiple of "
                              f"--micro-batch-size x data-parallel size = {micro_dp}; choose START and INCREMENT "
                              f"multiples of {micro_dp}.")
    if args.train_iters is not None:
        raise ConfigError("--rampup-batch-size needs a sample-based run length (--train-samples), as in "
                          "Megatron-LM; replace --train-iters N by --train-samples N x global batch.")
    return Rampup(start, increment, samples)


def ramped_iterations(rampup: Rampup, global_batch: int, train_samples: int) -> int:
    """Iterations to consume `train_samples` with the ramp (Megatron's update_train_iters)."""
    iterations, consumed = 0, 0
    while consumed <= rampup.samples and consumed < train_samples:
        consumed += rampup.batch_size(consumed, global_batch)
        iterations += 1
    return iterations + max(0, train_samples - consumed) // global_batch


def resolve_run_length(args, global_batch: int, micro_dp: int, seq_length: int) -> RunLength:
    """--train-iters | --train-samples | --train-tokens with --lr-{warmup,decay}-{iters,samples,tokens}."""
    given = [f for f, v in (("--train-iters", args.train_iters), ("--train-samples", args.train_samples)) if v]
    if len(given) > 1:
        raise ConfigError("--train-iters and --train-samples are exclusive (Megatron-LM); give one.")
    rampup = _rampup(args, global_batch, micro_dp)
    train_tokens = args.train_tokens
    if args.train_samples:
        train_samples = int(args.train_samples)
        train_iters = (ramped_iterations(rampup, global_batch, train_samples) if rampup
                       else train_samples // global_batch)
    elif args.train_iters is not None:
        train_iters = int(args.train_iters)
        train_samples = train_iters * global_batch
    elif train_tokens:
        train_samples = math.ceil(train_tokens / seq_length)
        train_iters = (ramped_iterations(rampup, global_batch, train_samples) if rampup
                       else math.ceil(train_samples / global_batch))
    else:
        train_iters, train_samples = 100, 100 * global_batch
    if train_tokens:  # Megatron-DeepSpeed: the run also stops at this many tokens
        train_iters = min(train_iters, math.ceil(train_tokens / seq_length / global_batch)) if not rampup \
            else min(train_iters, ramped_iterations(rampup, global_batch, math.ceil(train_tokens / seq_length)))
    if train_iters < 1:
        raise ConfigError(f"the run has {train_iters} iterations: --train-iters/--train-samples/--train-tokens "
                          f"must cover at least one global batch ({global_batch} samples).")
    unit, warmup, decay = _lr_schedule(args, global_batch, seq_length, train_iters, train_samples)
    return RunLength(train_iters, train_samples, train_tokens, unit, warmup, decay, rampup)


def _lr_schedule(args, global_batch, seq_length, train_iters, train_samples) -> tuple[str, int, int]:
    """(unit, warmup, decay) as Megatron-LM's get_optimizer_param_scheduler (+ Megatron-DeepSpeed tokens)."""
    by_tokens = bool(args.lr_decay_tokens or args.lr_warmup_tokens)
    per_sample = seq_length if by_tokens else 1
    warmups = [f for f, v in (("--lr-warmup-fraction", args.lr_warmup_fraction), ("--lr-warmup-iters",
               args.lr_warmup_iters), ("--lr-warmup-samples", args.lr_warmup_samples),
               ("--lr-warmup-tokens", args.lr_warmup_tokens)) if v]
    if len(warmups) > 1:
        raise ConfigError(f"{' and '.join(warmups)} are exclusive; give one warmup length.")
    decays = [f for f, v in (("--lr-decay-iters", args.lr_decay_iters), ("--lr-decay-samples", args.lr_decay_samples),
              ("--lr-decay-tokens", args.lr_decay_tokens)) if v]
    if len(decays) > 1:
        raise ConfigError(f"{' and '.join(decays)} are exclusive; give one decay length.")
    if args.lr_decay_tokens:
        decay = int(args.lr_decay_tokens)
    elif args.lr_decay_samples:
        decay = int(args.lr_decay_samples) * per_sample
    elif args.lr_decay_iters:
        decay = int(args.lr_decay_iters) * global_batch * per_sample
    else:
        decay = (train_samples if args.train_samples or args.train_tokens else train_iters * global_batch) * per_sample
    if args.lr_warmup_fraction is not None:
        warmup = int(args.lr_warmup_fraction * decay)
    elif args.lr_warmup_tokens:
        warmup = int(args.lr_warmup_tokens)
    elif args.lr_warmup_samples:
        warmup = int(args.lr_warmup_samples) * per_sample
    else:
        warmup = int(args.lr_warmup_iters or 0) * global_batch * per_sample
    return ("tokens" if by_tokens else "samples"), warmup, decay
