"""Interleaved and zero-bubble pipeline schedules from `torch.distributed.pipelining`, with DeepSpeed
keeping the optimizer (ZeRO-1 partitions its state over DP).

PyTorch runs the schedule (which stage computes which micro-batch when, the activations and
gradients sent between ranks, and for zero-bubble the split of each backward into its input- and
weight-gradient halves); we give it this rank's virtual stages (hybrid.model.virtual_stages) and a
loss; DeepSpeed then reduces the gradients over DP and steps, as its own PipelineEngine does
after its schedule's backward passes (`reduce_gradients(pipeline_parallel=True)` for ZeRO-1, the
bucketed all-reduce without ZeRO). DeepSpeed's own 1F1B engine stays the `1f1b` default.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid.errors import ConfigError
from hybrid.model.virtual_stages import V_SHAPED, PipelineRankModel, plan_stages

# --pipeline-schedule name -> torch.distributed.pipelining class ("1f1b" is DeepSpeed's engine)
TORCH_SCHEDULES = {
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SCHEDULE_NAMES = ("1f1b", *TORCH_SCHEDULES)
SPLIT_BACKWARD = ("zero-bubble", "zbv", "dualpipev")  # backward split into input- and weight-gradient steps


def schedule_class(name: str):
    import torch.distributed.pipelining.schedules as schedules
    return getattr(schedules, TORCH_SCHEDULES[name])


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
                           micro_batches: int, pp: int) -> None:
    """What the torch schedules support here, refused with the reason before anything is built."""
    if schedule == "1f1b":
        return
    if zero_stage >= 2:
        raise ConfigError(f"--pipeline-schedule {schedule} with ZeRO stage {zero_stage}: ZeRO-2/3 reduce each gradient "
                          f"in hooks as autograd produces it, which the pipeline's per-micro-batch (and split) "
                          f"backward passes do not fit yet. Use ZeRO-1 (ds_configs/zero1.json), which partitions "
                          f"the optimizer state over DP.")
    if precision == "fp16":
        raise ConfigError(f"--pipeline-schedule {schedule} with --fp16: the torch schedules run the backward "
                          f"themselves, without DeepSpeed's loss scaling. Use --bf16.")
    if precision == "bf16" and zero_stage == 0:
        raise ConfigError(f"--pipeline-schedule {schedule} with --bf16 needs ZeRO-1 (ds_configs/zero1.json): "
                          f"DeepSpeed's bf16 optimizer without ZeRO accumulates gradients in its own backward.")
    if recompute and schedule in SPLIT_BACKWARD:
        raise ConfigError(f"--recompute-granularity with --pipeline-schedule {schedule}: activation recompute "
                          f"reruns the forward inside one backward, which a backward split into input- and "
                          f"weight-gradient steps cannot do. Use --pipeline-schedule interleaved-1f1b with "
                          f"recompute, or drop --recompute-granularity.")
    if micro_batches < pp:
        raise ConfigError(f"--pipeline-schedule {schedule} needs at least as many micro-batches per iteration as "
                          f"pipeline ranks ({pp}); this run has {micro_batches} (--global-batch-size / "
                          f"(--micro-batch-size x data-parallel size)). Raise --global-batch-size.")


def build_rank_model(config, topology, schedule: str, virtual: int) -> PipelineRankModel:
    plans = plan_stages(config.num_layers, topology.pp_world_size, virtual, schedule)
    config.validate(topology.tp_world_size)
    return PipelineRankModel(config, topology.tp_group, plans, topology.pp_rank)


def _pack_target(labels, mask):
    """Labels and loss mask as one tensor the schedule can split per micro-batch ([b, 2s])."""
    return labels if mask is None else torch.cat([labels, mask.to(labels.dtype)], dim=1)


class TorchPipelineStep:
    """One training iteration (and evaluation) through a torch.distributed.pipelining schedule."""

    def __init__(self, engine, model: PipelineRankModel, topology, schedule: str, micro_batches: int, device):
        from torch.distributed.pipelining import PipelineStage
        from hybrid.model.embedding import LMLoss
        self.engine, self.model, self.topology, self.device = engine, model, topology, device
        self.schedule_name = schedule
        self.micro_batches = micro_batches
        num_stages = len(plan_stages(model.config.num_layers, topology.pp_world_size,
                                     len(model.stages), schedule))
        self.stages = [PipelineStage(stage, stage.plan.index, num_stages, device, group=topology.pp_group)
                       for stage in model.stages]
        self.has_first = any(s.first for s in model.stages)
        self.has_last = any(s.last for s in model.stages)
        lm_loss = LMLoss(topology.tp_group, model.config.vocab_size)
        seq = None

        def loss_fn(logits, target):
            # the mean over micro-batches is taken here (scale_grads=False), as DeepSpeed divides
            # each micro-batch's loss by the accumulation steps
            nonlocal seq
            if target.size(1) == logits.size(0):
                labels, mask = target, None
            else:
                seq = target.size(1) // 2
                labels, mask = target[:, :seq], target[:, seq:].to(logits.dtype)
            return lm_loss(logits, (labels, mask)) / micro_batches

        self.schedule = schedule_class(schedule)(self.stages, n_microbatches=micro_batches, loss_fn=loss_fn,
                                                 scale_grads=False)
        self.tie_group = self._tied_embedding_group()
        engine.set_gradient_accumulation_boundary(True)  # every engine.step() below is one optimizer step
        # the rank that computes the loss (last virtual stage), as a global rank in this PP group
        last_pp_rank = next(p.rank for p in plan_stages(model.config.num_layers, topology.pp_world_size,
                                                        len(model.stages), schedule) if p.last)
        self.loss_src = dist.get_global_rank(topology.pp_group, last_pp_rank)

    def _tied_embedding_group(self):
        """Loop placement with tied embeddings: a group per (TP, DP) position of the ranks holding
        the first and last stages, whose two table copies' gradients are summed."""
        if not self.model.config.tied_embeddings or self.schedule_name in V_SHAPED:
            return None
        mine = None
        for ranks in self.topology.ds_topology.get_axis_comm_lists("pipe"):
            pair = sorted({ranks[0], ranks[-1]})
            group = dist.new_group(ranks=pair)  # collective: every rank creates every pair
            if dist.get_rank() in pair:
                mine = group
        return mine if self.model.tied_weight() is not None else None

    def _batch(self, batches):
        parts = [next(batches) for _ in range(self.micro_batches)]
        ids = torch.cat([p[0] for p in parts])
        masks = [p[2] for p in parts]
        target = _pack_target(torch.cat([p[1] for p in parts]), None if masks[0] is None else torch.cat(masks))
        return ids, target

    def _run(self, method, ids, target, losses):
        args = (ids,) if self.has_first else ()
        kwargs = {"target": target, "losses": losses} if self.has_last else {}
        return method(*args, **kwargs)

    def train_step(self, batches) -> torch.Tensor:
        """Forward and backward of every micro-batch, tied-table and DP gradient reduction, one optimizer
        step. Returns this iteration's mean loss on the loss rank (zero elsewhere; see reduce_losses)."""
        ids, target = self._batch(batches)
        losses: list = []
        self._run(self.schedule.step, ids, target, losses)
        if self.tie_group is not None:
            weight = self.model.tied_weight()
            dist.all_reduce(weight.grad, group=self.tie_group)
        engine = self.engine
        if engine.zero_optimization_stage() == 1:
            engine.optimizer.reduce_gradients(pipeline_parallel=True)  # as DeepSpeed's PipelineEngine
        else:
            engine.allreduce_gradients()
        engine.step()
        return self._sum(losses)

    def _sum(self, losses) -> torch.Tensor:
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float().reshape(()) for loss in losses]).sum()

    @torch.no_grad()
    def eval_step(self, batches) -> torch.Tensor:
        ids, target = self._batch(batches)
        losses: list = []
        self._run(self.schedule.eval, ids, target, losses)
        return self._sum(losses)

    def reduce_losses(self, stacked: torch.Tensor) -> torch.Tensor:
        """Per-iteration losses from the loss rank to its whole pipeline, then the DP mean."""
        if self.topology.pp_world_size > 1:
            dist.broadcast(stacked, src=self.loss_src, group=self.topology.pp_group)
        if self.topology.dp_world_size > 1:
            dist.all_reduce(stacked, group=self.topology.dp_group)
            stacked = stacked / self.topology.dp_world_size
        return stacked
