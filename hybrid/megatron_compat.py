"""Megatron-LM / Megatron-DeepSpeed flags that real run scripts carry and hybrid has no feature
behind: each one is accepted (it asks for what hybrid already does, or is at its neutral value)
or refused with one message naming the flag and why. Nothing is silently ignored; a flag that
would change the numerics or the length of the run is never accepted unless hybrid does
exactly that. The table is the README's compatibility table too (`markdown_table`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from hybrid.errors import ConfigError


@dataclass(frozen=True)
class CompatFlag:
    """One flag: how it is parsed, what is done with it, and why."""

    name: str  # the flag as scripts spell it
    treatment: str  # "accepted" | "neutral" (only its neutral value) | "refused"
    why: str  # the reason (accepted: what hybrid does instead; refused: what to use)
    nargs: Optional[str] = None  # argparse nargs: None (store_true), "?", "+", or "1" (one value)
    neutral: Optional[str] = None  # for "neutral": the one value accepted


_FLAGS = [
    # kernels, fusions and overlap: hybrid's own kernels are used either way
    CompatFlag("--use-mcore-models", "accepted", "hybrid's model is the only implementation"),
    CompatFlag("--use-legacy-models", "refused", "hybrid has one model implementation; drop the flag"),
    CompatFlag("--no-masked-softmax-fusion", "accepted", "no masked-softmax kernel is used (SDPA/flash-attn)"),
    CompatFlag("--no-bias-gelu-fusion", "accepted",
               "bias+GeLU is one elementwise expression (fused only by --torch-compile)"),
    CompatFlag("--no-bias-swiglu-fusion", "accepted", "SwiGLU/GeGLU always run as one autograd function keeping only "
                                                      "fc1's output (bitwise the unfused values)"),
    CompatFlag("--no-bias-dropout-fusion", "accepted", "bias+dropout+add is not fused"),
    CompatFlag("--no-gradient-accumulation-fusion", "accepted", "gradients accumulate in DeepSpeed's buffers"),
    CompatFlag("--no-rope-fusion", "accepted",
               "RoPE always runs as one autograd function without rotate-half copies (bitwise the unfused values)"),
    CompatFlag("--no-persist-layer-norm", "accepted", "torch's layer_norm kernels are used"),
    CompatFlag("--cross-entropy-loss-fusion", "accepted", "the single-rank cross-entropy is always fused"),
    CompatFlag("--overlap-grad-reduce", "accepted", "DeepSpeed's ZeRO reduces gradients (overlap_comm in its config)"),
    CompatFlag("--overlap-param-gather", "accepted", "DeepSpeed's ZeRO gathers parameters"),
    CompatFlag("--no-query-key-layer-scaling", "accepted", "query-key layer scaling is off unless "
               "--apply-query-key-layer-scaling"),
    CompatFlag("--deepspeed-activation-checkpointing", "accepted",
               "recompute always runs through deepspeed.checkpointing"),
    CompatFlag("--no-create-attention-mask-in-dataloader", "accepted", "no attention mask is ever materialised"),
    CompatFlag("--sync-tp-duplicated-parameters", "accepted",
               "TP-replicated parameters get identical gradients by construction"),
    CompatFlag("--abort-on-unmet-fused-kernel-constraints", "accepted", "no fused kernel has unmet constraints"),
    CompatFlag("--override-opt_param-scheduler", "accepted",
               "the LR schedule always comes from the flags; only its position is restored from a checkpoint"),
    CompatFlag("--no-save-optim", "refused", "DeepSpeed's save_checkpoint always writes the optimizer state; drop "
               "the flag (a checkpoint's weights alone: conversion/checkpoint_util.py --target-tensor-parallel-size N "
               "writes them)"),
    CompatFlag("--use-checkpoint-opt_param-scheduler", "refused",
               "the LR schedule comes from the flags; give the same LR flags as the run that saved"),
    CompatFlag("--manual-gc", "accepted", "Python's garbage collector is left as it is (no numerical effect)"),
    CompatFlag("--empty-unused-memory-level", "accepted", "the allocator's cache is not emptied "
               "(no numerical effect)", nargs="1"),
    # logging and timing
    CompatFlag("--log-throughput", "accepted", "tokens/s and TFLOP/s are always logged"),
    CompatFlag("--tensorboard-queue-size", "accepted", "TensorBoard is flushed at every log line", nargs="1"),
    CompatFlag("--log-timers-to-tensorboard", "accepted", "iteration time (elapsed_ms_per_iter) is logged"),
    CompatFlag("--log-batch-size-to-tensorboard", "accepted", "global_batch_size is logged"),
    CompatFlag("--log-validation-ppl-to-tensorboard", "accepted", "validation loss and PPL are logged"),
    CompatFlag("--log-optimizer-states-to-tensorboard", "refused",
               "optimizer-state statistics are not logged; drop the flag"),
    CompatFlag("--log-num-zeros-in-grad", "refused", "not logged; drop the flag"),
    CompatFlag("--log-params-norm", "refused", "not logged; drop the flag"),
    CompatFlag("--timing-log-level", "accepted", "one iteration timer is logged", nargs="1"),
    CompatFlag("--timing-log-option", "accepted", "one iteration timer is logged", nargs="1"),
    CompatFlag("--valid-num-workers", "accepted", "evaluation reads samples in the main process", nargs="1"),
    CompatFlag("--use-pytorch-profiler", "accepted", "--profile always runs torch.profiler (its traces for "
               "TensorBoard / Perfetto); under nsys the CUDA profiler range is opened over the same steps too"),
    CompatFlag("--codecarbon-dir", "refused", "CodeCarbon tracking is not built in; drop the flag", nargs="1"),
    # parallel sizes hybrid has at their neutral value only
    # Megatron-DeepSpeed's DeepSpeed-MoE spellings: Megatron-LM's flags are the ones built
    *[CompatFlag(name, "refused", f"Megatron-DeepSpeed's MoE flag; use Megatron-LM's {instead}", nargs=nargs)
      for name, nargs, instead in [
          ("--moe-expert-parallel-size", "1", "--expert-model-parallel-size"),
          ("--moe-loss-coeff", "1", "--moe-aux-loss-coeff"),
          ("--moe-train-capacity-factor", "1", "--moe-expert-capacity-factor"),
          ("--moe-eval-capacity-factor", "1", "--moe-expert-capacity-factor (the same in evaluation)"),
          ("--moe-min-capacity", "1", "--moe-expert-capacity-factor"),
          ("--create-moe-param-group", None, "nothing: expert parameters get DeepSpeed's MoE optimizer groups "
                                             "by themselves"),
          ("--disable-moe-token-dropping", None, "nothing: routing is dropless unless --moe-expert-capacity-factor "
                                                 "is given")]],
    CompatFlag("--enable-zbh1-pipeline", "refused", "Megatron-DeepSpeed's ZB-H1 is not used; use --pipeline-schedule "
               "zero-bubble (torch.distributed.pipelining's interleaved zero-bubble schedule)"),
    CompatFlag("--enable-zbh1-exact-semantics", "refused", "see --enable-zbh1-pipeline"),
    CompatFlag("--use-flash-attn-triton", "refused", "the Triton flash attention is not used; use --use-flash-attn "
               "(flash-attn 2) or drop the flag (SDPA)"),
    CompatFlag("--moe-shared-expert-overlap", "accepted", "the shared expert and the routed ones are computed in the "
               "same layer either way; overlapping their communication changes no value"),
    CompatFlag("--moe-layer-recompute", "refused", "recomputing only the MoE layers is not implemented; use "
               "--recompute-granularity full (every layer, the MoE layers included) or selective"),
    CompatFlag("--trust-remote-code", "refused", "hybrid runs no code from a model or tokenizer directory; use a "
               "tokenizer that transformers loads without it (tokenizer.json)"),
    CompatFlag("--attention-softmax-in-fp32", "accepted", "flash-attn and SDPA's fused kernels accumulate the "
               "softmax in fp32"),
    CompatFlag("--use-mpi", "refused", "ranks come from the torch.distributed environment (torchrun, the deepspeed "
               "launcher, accelerate); launch with one of them"),
    CompatFlag("--use-z-loss", "refused", "the z-loss auxiliary term is not implemented"),
    CompatFlag("--wandb-entity", "refused", "set the WANDB_ENTITY environment variable instead", nargs="1"),
    CompatFlag("--no-pipeline-parallel", "accepted", "with --pipeline-model-parallel-size 1 hybrid never builds "
               "pipeline stages (with a larger size it is refused)"),
    # numerics or features hybrid does not have
    CompatFlag("--transformer-impl", "neutral", "Transformer Engine is not used", nargs="1", neutral="local"),
    CompatFlag("--embed-layernorm", "refused", "a norm after the embedding (BLOOM) is not implemented"),
    CompatFlag("--decoupled-lr", "refused", "a separate embedding/output learning rate is not implemented", nargs="1"),
    CompatFlag("--decoupled-min-lr", "refused", "see --decoupled-lr", nargs="1"),
    CompatFlag("--step-batch-size-schedule", "refused", "use --rampup-batch-size START INCREMENT SAMPLES (a linear "
               "ramp) or a constant --global-batch-size", nargs="1"),
    CompatFlag("--ckpt-format", "neutral", "checkpoints are DeepSpeed's (convert with "
               "conversion/checkpoint_util.py)", nargs="1", neutral="torch"),
    CompatFlag("--tiktoken-pattern", "refused", "the TikTokenizer is not supported; use HFTokenizer with a local "
               "tokenizer directory", nargs="1"),
    CompatFlag("--pad-vocab-size-to", "refused", "use --make-vocab-size-divisible-by", nargs="1"),
    CompatFlag("--train-weighted-split-paths-path", "refused", "BigScience's split-path files are not read; use "
               "--train-data-path/--valid-data-path with weights", nargs="1"),
    CompatFlag("--valid-weighted-split-paths-path", "refused", "see --train-weighted-split-paths-path", nargs="1"),
    CompatFlag("--cpu-optimizer", "refused", "use a DeepSpeed config with offload_optimizer "
               "(ds_configs/zero1_offload.json)"),
    CompatFlag("--kill-switch-path", "refused", "use --exit-duration-in-mins or --exit-interval", nargs="1"),
    # data
    CompatFlag("--dataloader-type", "neutral", "samples are served in Megatron's sequential pretraining order "
               "(cyclic is not implemented)", nargs="1", neutral="single"),
]


@dataclass(frozen=True)
class ValueRule:
    """A flag hybrid has, accepted at some values only."""

    name: str  # the flag
    accepted: str  # which values, for the README
    refuses: Callable  # args -> bool
    message: Callable  # args -> the error


VALUE_RULES = [
    ValueRule("--no-position-embedding", "accepted with rope (--position-embedding-type rope / "
              "--use-rotary-position-embeddings), which has no learned position table",
              lambda a: a.no_position_embedding and a.position_embedding_type == "learned_absolute"
              and not a.use_rotary_position_embeddings,
              lambda a: "--no-position-embedding without rope: a model with no position information is not "
                        "implemented; add --position-embedding-type rope."),
    ValueRule("--position-embedding-type", "learned_absolute or rope (alibi is not implemented)",
              lambda a: a.position_embedding_type == "alibi",
              lambda a: "--position-embedding-type alibi is not supported: use learned_absolute or rope."),
]

COMPAT_FLAGS = {f.name: f for f in _FLAGS}


def add_compat_args(parser) -> None:
    """Register every flag of the table, in its own --help group."""
    group = parser.add_argument_group("Megatron-LM flags without a feature behind them (accepted or refused; "
                                      "see README)")
    for flag in _FLAGS:
        dest = "compat_" + flag.name.lstrip("-").replace("-", "_")
        help_text = f"{flag.treatment}: {flag.why}"
        if flag.nargs is None:
            group.add_argument(flag.name, dest=dest, action="store_true", default=None, help=help_text)
        else:
            group.add_argument(flag.name, dest=dest, default=None, help=help_text,
                               nargs=None if flag.nargs == "1" else flag.nargs)


def check_compat(args) -> list[str]:
    """Raise one ConfigError naming every refused flag given (and every neutral-only flag at
    another value), so a script is fixed in one pass; return the accepted ones, for the log."""
    accepted, refused = [], []
    for flag in _FLAGS:
        value = getattr(args, "compat_" + flag.name.lstrip("-").replace("-", "_"), None)
        if value is None:
            continue
        if flag.treatment == "refused":
            refused.append(f"{flag.name} is not supported: {flag.why}.")
        elif flag.treatment == "neutral" and str(value) != flag.neutral and \
                _as_float(value) != _as_float(flag.neutral):
            refused.append(f"{flag.name} {value} is not supported ({flag.why}); only {flag.name} "
                           f"{flag.neutral} is accepted.")
        else:
            accepted.append(flag.name)
    refused += [rule.message(args) for rule in VALUE_RULES if rule.refuses(args)]
    if refused:
        raise ConfigError(refused[0] if len(refused) == 1 else
                          f"{len(refused)} flags are not supported:\n  " + "\n  ".join(refused))
    return accepted


def _as_float(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def markdown_table() -> str:
    """The README table of these flags."""
    rows = ["| flag | treatment | why |", "|---|---|---|"]
    for flag in _FLAGS:
        treatment = f"accepted at {flag.neutral} only" if flag.treatment == "neutral" else flag.treatment
        rows.append(f"| `{flag.name}` | {treatment} | {flag.why} |")
    rows += [f"| `{rule.name}` | {rule.accepted} | a flag hybrid has, at these values |" for rule in VALUE_RULES]
    return "\n".join(rows)
