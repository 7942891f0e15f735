"""launch/train.py's entry: flags -> configs (every flag checked before a process group exists or anything is
built) -> the layout's groups -> model -> DeepSpeed engine -> the training loop -> the demo's export.
A user's mistake ends in one message and exit status 2; a dead or silent peer in one message and PEER_FAILED.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Optional

import torch.distributed as dist
from deepspeed.utils import logger as ds_logger

from hybrid.config import (RunConfig, build_run_config, data_config, sft_tutorial_defaults, tokenizer_kwargs,
                           with_flags)
from hybrid.data.batches import build_datasets
from hybrid.data.chat.dataset import train_windows
from hybrid.data.chat.template import ChatEncoder
from hybrid.data.tokenizer import build_tokenizer
from hybrid.distributed import end_distributed, init_distributed
from hybrid.dry_run import report
from hybrid.errors import ConfigError
from hybrid.flags import build_parser
from hybrid.parallel.groups import build_groups
from hybrid.parallel.random import model_parallel_seed
from hybrid.safe_loading import install_safe_torch_load
from hybrid.training import reference_logps, resume
from hybrid.training.deepspeed_fixes import release_engine
from hybrid.training.demo import finish
from hybrid.training.engine import build_engine, build_reference
from hybrid.training.logging import log
from hybrid.training.loop import Trainer
from hybrid.training.profiling import PeakResidentMemory
from hybrid.training.start import plan_start


def _timeout_of(argv) -> float:
    try:
        return build_parser().parse_args(argv).distributed_timeout_minutes
    except ConfigError:
        return float("nan")


def _quiet_deepspeed() -> None:
    if not os.environ.get("HYBRID_VERBOSE"):
        ds_logger.setLevel(logging.WARNING)


def run_training(argv: Optional[list[str]] = None) -> int:
    """Parse flags, build everything, train. Returns the process exit code."""
    args = build_parser().parse_args(argv)
    install_safe_torch_load(args.allow_unsafe_checkpoint_load)  # before anything reads a file
    plan = plan_start(args)  # where the run starts: every checkpoint classified, opened and read here, once
    args = with_flags(args, **dict(plan.flags))
    args = with_flags(args, **sft_tutorial_defaults(args))
    tokenizer = build_tokenizer(**tokenizer_kwargs(args))
    world_size = args.dry_run_world_size or int(os.environ.get("WORLD_SIZE", "1"))
    separator = _document_end(args, tokenizer)
    if args.train_epochs is not None:
        args = with_flags(args, train_samples=_epochs_as_samples(args, tokenizer))
    run = build_run_config(args, world_size, tokenizer.vocab_size, plan.base_model, separator, start=plan)
    if args.dry_run:  # the memory estimate: nothing built, no process group
        if int(os.environ.get("RANK", "0")) == 0:
            print(report(run, args.gpu_memory_gb), flush=True)
        return 0
    if not resume.already_finished(run):
        _train(run, args, tokenizer)
    return finish(run)


def _document_end(args, tokenizer) -> Optional[int]:
    """The token packed samples are split at: the tokenizer's end of document, or with --sft the separator
    between packed conversations (a special token the chat template never emits; hybrid.data.chat)."""
    if not (args.sft or args.dpo):
        return getattr(tokenizer, "eod", None)
    source = (f"--load-hf {args.load_hf}" if args.load_hf and args.tokenizer_model == args.load_hf else
              f"--tokenizer-model {args.tokenizer_model}" if args.tokenizer_model else
              f"--tokenizer-type {args.tokenizer_type or 'GPT2BPETokenizer'}")
    if not hasattr(tokenizer, "to_transformers"):
        raise ConfigError(f"--sft renders conversations with a HuggingFace tokenizer's chat template: {source} has "
                          f"none; use --load-hf DIR or --tokenizer-type HFTokenizer --tokenizer-model DIR.")
    return ChatEncoder(tokenizer.to_transformers(), source).separator


def _epochs_as_samples(args, tokenizer) -> int:
    """--train-epochs N (--sft): the run is N passes over the training windows, i.e. --train-samples N x windows
    rounded up to whole global batches (the conversations are tokenized and packed now, on rank 0, into the
    cache the run then reads)."""
    if not (args.sft or args.dpo):
        raise ConfigError("--train-epochs counts passes over chat data: it needs --sft or --dpo (pretraining runs give "
                          "--train-iters, --train-samples or --train-tokens).")
    if args.train_iters or args.train_samples or args.train_tokens or args.train_epochs < 1:
        raise ConfigError(f"--train-epochs {args.train_epochs}: a positive number of epochs, instead of "
                          f"--train-iters / --train-samples / --train-tokens (give one).")
    if args.sft_streaming:
        raise ConfigError("--train-epochs with --sft-streaming: an epoch's windows are known only once the file is "
                          "tokenized; give --train-iters or --train-samples, or drop --sft-streaming.")
    data = data_config(args)
    encoder = ChatEncoder(tokenizer.to_transformers(), "--tokenizer-model", data.chat)
    windows = train_windows(data, args.seq_length, args.seed, encoder)
    # whole iterations covering every window N times (the last one may start the next epoch)
    batch = args.global_batch_size or args.micro_batch_size or 1
    samples = -(-args.train_epochs * windows // batch) * batch
    log(f"--train-epochs {args.train_epochs}: {windows} training windows an epoch -> --train-samples {samples} "
        f"(whole global batches of {batch})")
    return samples


def _train(run: RunConfig, args, tokenizer) -> None:
    """The layout's groups, the seeds, the data, the engine, where to start, the loop."""
    init_distributed(args.distributed_timeout_minutes, args.distributed_backend)
    _quiet_deepspeed()
    groups = build_groups(run.parallel, experts=bool(run.model.num_experts))
    memory = PeakResidentMemory()
    model_parallel_seed(run.training.seed, groups.tp.rank, groups.sequence.rank)
    prompts = None
    if run.training.grpo:  # prompts instead of token windows (the engine makes its own samples)
        from hybrid.training.rollout import grpo_prompts  # not at the top: it imports transformers' sampling warpers
        prompts, datasets = grpo_prompts(run, tokenizer), (None, None, None)
    else:
        datasets = build_datasets(run.data, run.training, tokenizer.vocab_size, tokenizer)
    engine, _ = build_engine(run, groups)
    try:  # (a refused resume or reference included)
        if run.training.dpo:  # the reference model, or its values read or scored with the windows; then the start
            reference, (iteration, consumed) = reference_logps.prepare(run, groups, engine, datasets)
        else:  # --grpo-beta > 0: the KL's frozen starting model
            reference = build_reference(run, groups, engine) if run.training.grpo and run.training.grpo.beta else None
            iteration, consumed = resume.start(engine, run, groups)
        Trainer(run, groups, engine, datasets, getattr(tokenizer, "eod", None), reference,
                prompts).train(iteration, consumed)
        memory.report(dist.get_rank(), groups.pp.rank)
    finally:  # a process that trains again (an RL loop, a pool of ranks) must not keep this engine
        release_engine(engine)


ERROR_GRACE_SECONDS = 3.0
PEER_FAILED = 4  # the exit status when a collective failed: a peer died or did not answer in time

# what torch.distributed's backends say when a peer is gone or silent (gloo: RuntimeError texts; NCCL:
# DistBackendError / its watchdog)
_PEER_FAILURE_TEXTS = ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer",
                       "Connection refused", "NCCL", "Broken pipe")


# where a collective raises: torch.distributed's and DeepSpeed's communication modules, and hybrid's that wait
# on asynchronous ones (the TP overlap, the ring, the pipeline's evaluation sends)
_COLLECTIVE_MODULES = (os.sep.join(("torch", "distributed", "")), os.sep.join(("deepspeed", "comm", "")),
                       os.sep.join(("hybrid", "parallel", "")), os.sep.join(("hybrid", "training", "pipelining.py")))


def _raised_by_a_collective(error: BaseException) -> bool:
    frame = error.__traceback__
    while frame is not None:
        if any(part in frame.tb_frame.f_code.co_filename for part in _COLLECTIVE_MODULES):
            return True
        frame = frame.tb_next
    return False


def _peer_failure(error: BaseException) -> bool:
    """A peer died or did not answer: torch's distributed errors, or a RuntimeError that a collective raised
    with a backend's words for a lost or silent peer (the same words from elsewhere, such as a data
    loader's timeout, keep their traceback)."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return (isinstance(error, RuntimeError) and any(text in str(error) for text in _PEER_FAILURE_TEXTS)
            and _raised_by_a_collective(error))


def _report_peer_failure(error: BaseException, timeout_minutes: float) -> None:
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    print(f"error: rank {rank}: a collective with another rank failed ({first}). A rank died or did not answer "
          f"within --distributed-timeout-minutes {timeout_minutes:g}; the newest complete checkpoint in --save is "
          f"intact: restart the job with --load pointing at it (torchrun --max-restarts does this by itself).",
          file=sys.stderr, flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: a user's mistake ends in one message and exit code 2, not a traceback; a dead or
    silent peer in one message and PEER_FAILED."""
    owned = not dist.is_initialized()
    try:
        code = run_training(argv)
    except RuntimeError as e:
        if not _peer_failure(e):
            raise
        _report_peer_failure(e, _timeout_of(argv))
        return PEER_FAILED  # no barrier or teardown: the groups are broken
    except ConfigError as e:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:  # every rank meets the same error; launchers kill the others when one exits: let rank 0 print
            time.sleep(ERROR_GRACE_SECONDS)
        code = 2
    # 0, or the export failure of rank 0 alone (hybrid.training.demo.EXPORT_FAILED), came after every rank's
    # last collective; 2 (a flag error) may come before some ranks' first
    end_distributed(owned, clean=code != 2)
    return code
