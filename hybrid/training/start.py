"""Where a run starts, decided once (torchtitan's checkpointer `_load`: the folder's newest step, else an initial
load, else fresh): `plan_start(flags)` classifies and opens --load and --load-hf before the run's config is built
and returns one frozen `StartPlan`; the config settles the one thing that needs the whole run (whether a universal
load can carry a checkpoint's optimizer state: `with_bridge`), and one of four loaders
(hybrid.training.resume) executes it:

  SAME_LAYOUT  DeepSpeed's own load of a hybrid checkpoint at its layout (engine, optimizer, schedule, RNG)
  UNIVERSAL    DeepSpeed's universal load at any layout, with the optimizer; a Megatron-LM checkpoint with Adam
               state and DeepSpeed pipeline-engine layer files cross through one bridge: a universal checkpoint
               written beside --save, loaded, removed
  WEIGHTS      weights only, from any source (HF, hybrid, Megatron-LM, Megatron-DeepSpeed), read a part at a time
               for this rank; the counters continue or start fresh as the plan says
  FRESH        nothing to load

Nothing else asks what a checkpoint directory holds, opens its reader or reads its client state on the way to the
first iteration. The module builds no model and loads no DeepSpeed: it sits below the config (tests/test_structure).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from hybrid.architecture import MOE_TRAINING_FLAGS
from hybrid.checkpoint.client_state import ClientState
from hybrid.checkpoint.files import LATEST, LATEST_UNIVERSAL, first_model_file, load_file, read_tag
from hybrid.checkpoint.manifest import tag_to_resume
from hybrid.conversion.megatron.args import ARCHITECTURE_FLAGS, contradictions
from hybrid.conversion import peft
from hybrid.conversion.source import (HF, HYBRID, MEGATRON_DEEPSPEED, MEGATRON_KINDS, CheckpointSource, checkpoint_kind,
                                     open_source)
from hybrid.errors import ConfigError
from hybrid.flags import build_parser
from hybrid.model import lora
from hybrid.model.config import ModelConfig
from hybrid.distributed import log

FRESH, SAME_LAYOUT, UNIVERSAL, WEIGHTS = "fresh", "same-layout", "universal", "weights"
MEGATRON_ADAM, LAYER_FILES = "megatron-adam", "layer-files"  # the checkpoints whose optimizer crosses by a bridge


@dataclasses.dataclass(frozen=True)
class StartPlan:
    """Where the run starts: which loader, from which checkpoint, with what; made by plan_start, settled by
    with_bridge, read by hybrid.training.resume's loaders."""

    loader: str = FRESH  # FRESH, SAME_LAYOUT, UNIVERSAL or WEIGHTS
    directory: Optional[str] = None  # the checkpoint directory the loader reads (--load's, or --load-hf's)
    kind: Optional[str] = None  # what it holds (hybrid.conversion.source: HF, HYBRID, MEGATRON_LM, ...)
    tag: Optional[str] = None  # hybrid: the newest complete checkpoint; universal: latest_universal's
    source: Optional[CheckpointSource] = None  # its reader (open_source), for WEIGHTS and the bridge
    saved: Optional[ClientState] = None  # a hybrid checkpoint's client state (data plan, counters, layout)
    base_model: Optional[ModelConfig] = None  # the architecture the checkpoint brings (HF, Megatron)
    flags: tuple = ()  # ((flag, value), ...) the checkpoint decides: Megatron's experts' training, the tokenizer
    counters: bool = False  # WEIGHTS: the iteration, consumed samples and LR schedule continue (else start fresh)
    bridge: Optional[str] = None  # MEGATRON_ADAM or LAYER_FILES: its optimizer state crosses as a universal checkpoint
    optimizer_problem: Optional[str] = None  # why its optimizer state is not loaded (said in the log)
    vocab_block_rows: Optional[int] = None  # a plain resume of ZeRO-3: the row blocks its vocabulary tables were in
    warning: Optional[str] = None  # FRESH although --load was given: why
    refusal: Optional[str] = None  # why this start cannot be (raised by the loader, before the engine is touched)
    adapter: Optional[str] = None  # --load-lora: a PEFT adapter directory, read with the weights (WEIGHTS)


def plan_start(args) -> StartPlan:
    """The start of the run the flags describe: --load's newest complete checkpoint (hybrid, universal, Megatron-LM,
    Megatron-DeepSpeed, DeepSpeed pipeline-engine layer files), else --load-hf's weights, else fresh; with
    --load-lora, a PEFT adapter beside the weights."""
    plan = _weights_plan(args)
    return _with_adapter(args, plan) if getattr(args, "load_lora", None) else plan


def _with_adapter(args, plan: StartPlan) -> StartPlan:
    """--load-lora: the adapter's config decides the LoRA flags (those given must agree); only a start from
    weights reads it (a resumed LoRA run's checkpoint holds its adapters: the same command resumes)."""
    decided = peft.flags_of(peft.read_config(args.load_lora))
    given = {"lora_target_modules": lambda v: lora.resolve_targets(v),
             "lora_modules_to_save": lambda v: tuple(sorted(v))}
    conflicts = [f"--{flag.replace('_', '-')} {getattr(args, flag)} (the adapter's: {value})"
                 for flag, value in decided.items() if getattr(args, flag, None) is not None
                 and given.get(flag, lambda v: v)(getattr(args, flag)) != value]
    if conflicts:
        raise ConfigError(f"--load-lora {args.load_lora}: its adapter_config.json disagrees with {', '.join(conflicts)}"
                          f"; drop those flags (the adapter's config sets them) or load another adapter.")
    flags = tuple(plan.flags) + tuple(decided.items())
    if plan.loader == FRESH:
        raise ConfigError(f"--load-lora {args.load_lora}: an adapter needs the base model it was trained on; add "
                          f"--load-hf BASE (or --load of a checkpoint of that base).")
    if plan.loader != WEIGHTS:  # (the command that started the run, run again: it resumes)
        log(f"--load-lora {args.load_lora}: not read; the run resumes from {plan.directory}, whose checkpoint holds "
            f"the adapters it trained")
        return dataclasses.replace(plan, flags=flags)
    return dataclasses.replace(plan, adapter=args.load_lora, flags=flags)


def _weights_plan(args) -> StartPlan:
    """plan_start without the adapter."""
    load = args.load
    if load and not os.path.isdir(load) and os.path.abspath(load) != os.path.abspath(args.save or ""):
        raise ConfigError(f"--load {load}: no such directory.")
    hf_flags = _hf_flags(args)
    kind = checkpoint_kind(load) if load else None
    if args.load_hf and kind != HYBRID:  # no checkpoint of this run's to restart from: --load-hf's weights
        return StartPlan(WEIGHTS, args.load_hf, HF, source=open_source(args.load_hf, "--load-hf", kind=HF),
                         base_model=hf_flags[0], flags=hf_flags[1])
    if kind in MEGATRON_KINDS:
        return _megatron_plan(args, kind)
    if not load:
        return StartPlan(base_model=hf_flags[0], flags=hf_flags[1])
    plan = _hybrid_plan(args, load, kind == HYBRID)
    return dataclasses.replace(plan, base_model=hf_flags[0], flags=hf_flags[1])


def _hf_flags(args) -> tuple:
    """(--load-hf's architecture, the flags it decides: its tokenizer unless one is given), or (None, ())."""
    if not args.load_hf:
        return None, ()
    config = open_source(args.load_hf, "--load-hf", kind=HF).config()
    tokenizer = (("tokenizer_type", "HFTokenizer"), ("tokenizer_model", args.load_hf))
    return config, tokenizer if args.tokenizer_type is None and not args.vocab_file else ()


def _hybrid_plan(args, load: str, has_latest: bool) -> StartPlan:
    """--load of a hybrid checkpoint directory (or of a universal checkpoint made from a Megatron one)."""
    universal_tag = read_tag(load, LATEST_UNIVERSAL) if os.path.isdir(load) else None
    if args.universal_checkpoint and (universal_tag or has_latest):
        refusal = None if universal_tag else (
            f"--load {load} --universal-checkpoint: no universal checkpoint there (no '{LATEST_UNIVERSAL}' file). "
            f"Make one from its last checkpoint with: python conversion/checkpoint_util.py --saver universal "
            f"--load-dir {load}")
        # (--use-checkpoint-args reads the architecture from the newest checkpoint's client state)
        saved = _client_state(load, _complete_tag(load, read_tag(load))) if has_latest and args.use_checkpoint_args \
            else None
        return StartPlan(UNIVERSAL, load, HYBRID, universal_tag, saved=saved, refusal=refusal)
    if not has_latest:
        if args.finetune:
            raise ConfigError(f"--load {load} --finetune: no checkpoint there (no '{LATEST}' file).")
        return StartPlan(warning=f"WARNING: no checkpoint found in {load} (no '{LATEST}' file); training from "
                                 f"scratch.")
    tag = _complete_tag(load, read_tag(load))
    saved = _client_state(load, tag)
    plan = StartPlan(SAME_LAYOUT, load, HYBRID, tag, saved=saved)
    if args.finetune or saved.weights_only:
        return dataclasses.replace(plan, loader=WEIGHTS, counters=not args.finetune)
    if saved.layout.storage == "layer_files":  # DeepSpeed's pipeline engine wrote it (before the one runtime)
        problem = "--no-load-optim" if args.no_load_optim else None
        return dataclasses.replace(plan, loader=WEIGHTS, counters=True, bridge=LAYER_FILES, optimizer_problem=problem)
    if saved.layout.storage == "zero3":  # DeepSpeed's own load finds the tables in the blocks that run held
        plan = dataclasses.replace(plan, vocab_block_rows=saved.layout.vocab_block_rows)
    return plan


def _client_state(load_dir: str, tag: str) -> ClientState:
    """Checkpoint `load_dir/tag`'s client state (rank 0's model-states file, memory-mapped: its weights unread)."""
    return ClientState.from_meta(load_file(first_model_file(os.path.join(load_dir, tag)), mmap=True))


def _complete_tag(load_dir: str, tag: str) -> str:
    """`tag` if its files are as its manifest lists them; else the newest older complete checkpoint (said
    in the log), or an error naming the file when there is none."""
    chosen, problem = tag_to_resume(load_dir, tag)
    if problem is None:
        return tag
    if not chosen:
        raise ConfigError(f"--load {load_dir}: checkpoint {tag} is incomplete: {problem}; no complete older "
                          f"checkpoint is there to resume from.")
    log(f"WARNING: checkpoint {tag} in {load_dir} is incomplete ({problem}); resuming from {chosen}, the newest "
        f"complete checkpoint")
    return chosen


def _megatron_plan(args, kind: str) -> StartPlan:
    """--load names a Megatron-LM or Megatron-DeepSpeed checkpoint: the model its stored args describe (as
    Megatron-LM's converter builds it), the experts' training flags the run does not give (the checkpoint's), and
    whether its Adam state maps. Architecture flags that contradict the checkpoint are one message naming both."""
    source = open_source(args.load, kind=kind)
    parser = build_parser()
    problems = contradictions(args, {name: parser.get_default(name) for name in ARCHITECTURE_FLAGS}, source.args)
    if problems:
        raise ConfigError(f"--load {args.load}: the Megatron-LM checkpoint's model differs from the flags: "
                          f"{'; '.join(problems)}. Drop those flags (the model comes from the checkpoint) or load "
                          f"another checkpoint.")
    # dropout is the run's (Megatron-LM's --use-checkpoint-args takes the architecture, not the regularisation)
    config = dataclasses.replace(source.config(), hidden_dropout=args.hidden_dropout,
                                 attention_dropout=args.attention_dropout)
    if config.mtp_num_layers and args.mtp_loss_scaling_factor != parser.get_default("mtp_loss_scaling_factor"):
        config = dataclasses.replace(config, mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)  # (a weight)
    flags = ()  # how the experts train: the flags given, else the checkpoint's (its expert bias)
    if config.num_experts:
        flags = tuple((name, getattr(config, name)) for name in MOE_TRAINING_FLAGS
                      if getattr(args, name) == parser.get_default(name))
    problem = source.optimizer().problem
    if problem is None and (args.finetune or args.no_load_optim):
        problem = "--finetune" if args.finetune else "--no-load-optim"
    return StartPlan(WEIGHTS, source.directory, kind, source=source, base_model=config, flags=flags,
                     counters=not args.finetune, bridge=None if problem else MEGATRON_ADAM, optimizer_problem=problem)


def with_bridge(plan: StartPlan, save: Optional[str], universal_problem) -> StartPlan:
    """The plan with its bridge settled: a checkpoint whose optimizer state maps crosses as a universal checkpoint
    written under --save when this run can take one (`universal_problem()`: None, or why the capability table
    refuses this run a universal load); else its weights load and the reason is kept for the log."""
    if plan.bridge is None:
        return plan
    problem = plan.optimizer_problem
    if problem is None and not save:
        problem = ("there is no --save directory to write it in as " +
                   ("DeepSpeed's universal checkpoint" if plan.bridge == MEGATRON_ADAM else "a universal checkpoint"))
    if problem is None:
        refused = universal_problem()
        if refused is not None:
            problem = (f"DeepSpeed loads it as a universal checkpoint, which this run cannot: {refused}"
                       if plan.bridge == MEGATRON_ADAM else
                       f"this run cannot load it as a universal checkpoint: {refused}")
    if problem is not None:
        return dataclasses.replace(plan, bridge=None, optimizer_problem=problem)
    return dataclasses.replace(plan, loader=UNIVERSAL, optimizer_problem=None)


def reference_plan(load_hf: str) -> StartPlan:
    """The weights of --load-hf's model alone (a pipeline scoring DPO's reference before its checkpoint loads)."""
    return StartPlan(WEIGHTS, load_hf, HF, source=open_source(load_hf, "--load-hf", kind=HF))


def describe(plan: StartPlan) -> str:
    """What a Megatron checkpoint is, for the log lines (its kind, directory and format)."""
    source = plan.source
    return (f"Megatron-DeepSpeed checkpoint {source.directory}" if plan.kind == MEGATRON_DEEPSPEED else
            f"Megatron-LM checkpoint {source.directory} (--ckpt-format {source.format})")
