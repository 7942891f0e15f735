"""Pipeline schedules and virtual stages, planned from the flags before anything is built.

`--pipeline-schedule 1f1b` (the default) is DeepSpeed's PipelineEngine; the others run in
`torch.distributed.pipelining` (hybrid.training.pipelining). With v virtual stages per pipeline
rank the model has S = PP x v stages of equal layer counts (Megatron-LM's interleaving: stage s
holds layers [s L/S, (s+1) L/S)), the embedding with stage 0, the final norm and head with stage
S - 1. Two placements, as torch.distributed.pipelining's schedules expect them:

- loop (interleaved 1F1B, interleaved zero-bubble): stage s runs on rank s mod PP;
- V (ZB-V, DualPipeV; v = 2): stage s on rank s for s < PP, on rank 2 PP - 1 - s after, so rank 0
  holds both ends.

No torch.distributed or DeepSpeed import here: the flags are checked first.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.errors import ConfigError

# --pipeline-schedule name -> torch.distributed.pipelining class ("1f1b" is DeepSpeed's engine)
TORCH_SCHEDULES = {
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SCHEDULE_NAMES = ("1f1b", *TORCH_SCHEDULES)
SPLIT_BACKWARD = ("zero-bubble", "zbv", "dualpipev")  # backward split into input- and weight-gradient steps
V_SHAPED = ("zbv", "dualpipev")  # first and last stage on rank 0


def resolve_virtual_stages(args, num_layers: int, pp: int) -> tuple[str, int]:
    """(--pipeline-schedule, virtual stages per rank) from the Megatron-LM flags, checked."""
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    virtual = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    schedule = getattr(args, "pipeline_schedule", None)
    if per_stage is not None and virtual is not None:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
                          "both set: give one (Megatron-LM's older and newer spelling of the same setting).")
    if per_stage is not None:
        if per_stage < 1 or pp < 1 or num_layers % (pp * per_stage) != 0:
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {per_stage}: --num-layers {num_layers} must "
                              f"be a multiple of --pipeline-model-parallel-size ({pp}) x {per_stage}.")
        virtual = num_layers // (pp * per_stage)
    if virtual is not None and virtual < 1:
        raise ConfigError(f"--num-virtual-stages-per-pipeline-rank {virtual}: expected 1 or more.")
    if schedule is None:
        schedule = "interleaved-1f1b" if virtual and virtual > 1 else "1f1b"
    if virtual is None:
        virtual = 2 if schedule in V_SHAPED else 1
    if schedule == "1f1b" and virtual > 1:
        raise ConfigError(f"--pipeline-schedule 1f1b runs one stage per pipeline rank, but {virtual} virtual stages "
                          f"per rank were asked for; use --pipeline-schedule interleaved-1f1b (or zero-bubble).")
    if schedule == "interleaved-1f1b" and virtual < 2:
        raise ConfigError("--pipeline-schedule interleaved-1f1b needs 2 or more virtual stages per pipeline rank: "
                          "add --num-virtual-stages-per-pipeline-rank 2 (or --num-layers-per-virtual-pipeline-stage).")
    if schedule != "1f1b":
        if pp < 2:
            raise ConfigError(f"--pipeline-schedule {schedule} needs --pipeline-model-parallel-size 2 or more.")
        plan_stages(num_layers, pp, virtual, schedule)  # raises on a layer count that does not split
    return schedule, virtual


def check_schedule_options(schedule: str, zero_stage: int, precision: str, recompute: str | None,
                           micro_batches: int, pp: int, torch_compile: bool = False) -> None:
    """What the torch schedules support here, refused with the reason before anything is built
    (ZeRO-2/3 with any pipeline is refused earlier, by hybrid.ds_config.zero_stage)."""
    if schedule == "1f1b":
        return
    if precision == "fp16":
        raise ConfigError(f"--pipeline-schedule {schedule} with --fp16: the torch schedules run the backward "
                          f"themselves, without DeepSpeed's loss scaling. Use --bf16.")
    if precision == "bf16" and zero_stage == 0:
        raise ConfigError(f"--pipeline-schedule {schedule} with --bf16 needs ZeRO-1 (ds_configs/zero1.json): "
                          f"DeepSpeed's bf16 optimizer without ZeRO accumulates gradients in its own backward.")
    if recompute and schedule in SPLIT_BACKWARD:
        # tried (full and selective): DeepSpeed's reentrant checkpoint raises "Checkpointing is not
        # compatible with .grad()" in the input-gradient step, which uses torch.autograd.grad
        raise ConfigError(f"--recompute-granularity with --pipeline-schedule {schedule}: activation recompute "
                          f"(DeepSpeed's reentrant checkpoint) cannot run inside a backward split into input- and "
                          f"weight-gradient steps (torch.autograd.grad). Use --pipeline-schedule interleaved-1f1b "
                          f"with recompute, or drop --recompute-granularity.")
    if torch_compile and schedule in SPLIT_BACKWARD:
        # tried: each compiled layer's backward is one graph computing input and weight gradients
        # together; run in two parts over a retained graph its gradients came out wrong (losses off by
        # 1e-3 after two steps with torch._functorch.config.donated_buffer=False, an error without)
        raise ConfigError(f"--torch-compile with --pipeline-schedule {schedule}: a compiled layer's backward is "
                          f"one graph, which a backward split into input- and weight-gradient steps cannot run "
                          f"in two parts. Use --pipeline-schedule interleaved-1f1b with --torch-compile, or drop "
                          f"--torch-compile.")
    if schedule == "dualpipev" and micro_batches < 2 * pp:
        raise ConfigError(f"--pipeline-schedule dualpipev needs at least as many micro-batches per iteration as "
                          f"stages (2 x {pp}); this run has {micro_batches} (--global-batch-size / "
                          f"(--micro-batch-size x data-parallel size)). Raise --global-batch-size.")
    if micro_batches < pp:
        raise ConfigError(f"--pipeline-schedule {schedule} needs at least as many micro-batches per iteration as "
                          f"pipeline ranks ({pp}); this run has {micro_batches} (--global-batch-size / "
                          f"(--micro-batch-size x data-parallel size)). Raise --global-batch-size.")



@dataclass(frozen=True)
class StagePlan:
    """One virtual stage: where it runs and what it holds."""

    index: int
    rank: int
    layers: range
    first: bool
    last: bool


def stage_rank(index: int, pp: int, v_shaped: bool) -> int:
    """The pipeline rank that runs virtual stage `index` (torch.distributed.pipelining's placement)."""
    if not v_shaped:
        return index % pp
    return index if index < pp else 2 * pp - 1 - index


def plan_stages(num_layers: int, pp: int, virtual: int, schedule: str) -> list[StagePlan]:
    """All S = pp x virtual stages, checked: every stage gets the same whole number of layers."""
    stages = pp * virtual
    if schedule in V_SHAPED and virtual != 2:
        raise ConfigError(f"--pipeline-schedule {schedule} runs exactly 2 virtual stages per pipeline rank "
                          f"(a V: down the ranks and back); set --num-virtual-stages-per-pipeline-rank 2 or "
                          f"--num-layers-per-virtual-pipeline-stage {max(1, num_layers // (2 * pp))}.")
    if num_layers % stages != 0:
        fits = [v for v in range(1, num_layers // pp + 1) if num_layers % (pp * v) == 0]
        raise ConfigError(f"--num-layers {num_layers} does not split into {pp} pipeline ranks x {virtual} virtual "
                          f"stages = {stages} stages of equal size (each stage needs the same number of layers); "
                          f"use --num-virtual-stages-per-pipeline-rank one of {fits}, or a --num-layers that is a "
                          f"multiple of {stages}.")
    per = num_layers // stages
    v_shaped = schedule in V_SHAPED
    return [StagePlan(s, stage_rank(s, pp, v_shaped), range(s * per, (s + 1) * per), s == 0, s == stages - 1)
            for s in range(stages)]
