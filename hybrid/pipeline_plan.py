"""Pipeline schedules and virtual stages, planned from the flags before anything is built.

Every `--pipeline-schedule` (1f1b, the default, and the others) runs on `torch.distributed.pipelining`
(hybrid.training.runtime). With v virtual stages per pipeline rank the model has S = PP x v stages of equal
layer counts (Megatron-LM's interleaving: stage s holds layers [s L/S, (s+1) L/S)), the embedding with stage 0,
the final norm and head with stage S - 1; with one stage per rank (1f1b) the layer counts may differ, as
--pipeline-partition gives them (`PipelineSchedule.stage_layers`). Two placements, as
torch.distributed.pipelining's schedules expect them:

- loop (interleaved 1F1B, interleaved zero-bubble): stage s runs on rank s mod PP;
- V (ZB-V, DualPipeV; v = 2): stage s on rank s for s < PP, on rank 2 PP - 1 - s after, so rank 0
  holds both ends.

No torch.distributed or DeepSpeed import here: the flags are checked first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hybrid.capabilities import V_SHAPED  # the schedules' names and kinds are declared there
from hybrid.errors import ConfigError


@dataclass(frozen=True)
class PipelineSchedule:
    """How the pipeline runs (with --pipeline-model-parallel-size > 1): the torch.distributed.pipelining
    schedule, its virtual stages per rank and, with one stage per rank, each stage's transformer layers."""

    schedule: str = "1f1b"  # --pipeline-schedule: a key of hybrid.capabilities.TORCH_SCHEDULES
    virtual_stages: int = 1  # virtual pipeline stages per rank
    partition: str = "parameters"  # --pipeline-partition (1f1b: how the layers are divided over the stages)
    stage_layers: Optional[tuple] = None  # 1f1b: transformer layers per stage (None: equal counts)


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


def resolve_partition(method: str, num_layers: int, pp: int) -> str:
    """--pipeline-partition -> DeepSpeed's PipelineModule `partition_method` (uniform counts transformer
    layers; an explicit list `3,5` becomes `list:3,5`, checked against --num-layers)."""
    if method in ("parameters", "uniform"):
        return method if method == "parameters" else "type:TransformerLayer"
    if method.startswith("type:"):
        return method
    counts = [int(x) for x in method.replace("list:", "").split(",")]
    if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
        raise ConfigError(f"--pipeline-partition {method!r}: expected {pp} positive layer counts "
                          f"summing to --num-layers {num_layers}, e.g. "
                          f"{','.join([str(num_layers // pp)] * pp)}.")
    return "list:" + ",".join(map(str, counts))


def list_partition_bounds(method: str, num_units: int) -> list[int]:
    """Stage boundaries over the pipeline's layer list (embedding, transformer layers, final norm,
    head) for `list:3,5`: 3 transformer layers on stage 0 (with the embedding), 5 on stage 1 (with the
    final norm and head)."""
    counts = [int(x) for x in method.split(":", 1)[1].split(",")]
    bounds = [0]
    for count in counts:
        bounds.append(bounds[-1] + count + (1 if len(bounds) == 1 else 0))
    bounds[-1] = num_units
    return bounds


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


def plan_stages(num_layers: int, pp: int, virtual: int, schedule: str,
                stage_layers: Optional[tuple] = None) -> list[StagePlan]:
    """All S = pp x virtual stages, checked: every stage gets the same whole number of layers, or with one
    stage per rank the counts of `stage_layers` (each at least 1, summing to the layers)."""
    if stage_layers is not None and virtual == 1 and len(stage_layers) == pp:
        if sum(stage_layers) != num_layers or min(stage_layers) < 1:
            raise ConfigError(f"--pipeline-partition: {pp} stages of {list(stage_layers)} transformer layers do not "
                              f"cover --num-layers {num_layers} with at least one layer each.")
        starts = [sum(stage_layers[:s]) for s in range(pp)]
        return [StagePlan(s, s, range(starts[s], starts[s] + stage_layers[s]), s == 0, s == pp - 1)
                for s in range(pp)]
    if num_layers < pp:
        raise ConfigError(f"--pipeline-model-parallel-size {pp} is larger than --num-layers {num_layers}: every "
                          f"stage needs at least one layer.")
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
