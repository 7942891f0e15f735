"""`launch/train.py --dry-run`: the memory estimate of a run, per rank and pipeline stage, as a
table and as JSON, and with `--gpu-memory-gb` whether it fits and the smallest change that would.
Nothing is built and no process group is started, so a 64-GPU run can be planned on a laptop
(`--dry-run-world-size 64`)."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from typing import Optional

from hybrid.capabilities import Setup, allowed
from hybrid.config import RunConfig
from hybrid.errors import ConfigError
from hybrid.memory import GiB, MemoryPlan, ZeroSettings, estimate, format_table

# CUDA context and allocator fragmentation are not in the estimate
USABLE_FRACTION = 0.9


def plan_from_run(run: RunConfig) -> MemoryPlan:
    """The estimator's inputs from a validated run configuration."""
    ds = run.ds_config
    zero = ds.get("zero_optimization") or {}
    offload = lambda key: (zero.get(key) or {}).get("device", "none") not in ("none", None)  # noqa: E731
    grad_accum = (ds.get("data_types") or {}).get("grad_accum_dtype")
    # ZeRO partitions over DeepSpeed's data-parallel world: DP x CP (or x Ulysses)
    p, t = run.parallel, run.training
    settings = ZeroSettings(stage=run.zero_stage, dp=p.dp_cp, precision=t.precision,
                            offload_optimizer=offload("offload_optimizer"), offload_param=offload("offload_param"),
                            persistence_threshold=int(zero.get("stage3_param_persistence_threshold", 100_000)),
                            fp32_grad_accumulation=grad_accum in ("fp32", "float32"),
                            reduce_bucket_size=int(zero.get("reduce_bucket_size", 500_000_000)),
                            prefetch_bucket_size=int(zero.get("stage3_prefetch_bucket_size", 50_000_000)),
                            overlap_comm=bool(zero.get("overlap_comm", run.zero_stage == 3)),
                            contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
                            sub_group_size=int(zero.get("sub_group_size", 1_000_000_000)),
                            reduce_scatter=bool(zero.get("reduce_scatter", True)))
    return MemoryPlan(model=run.model_form, tp=p.tensor_parallel, pp=p.pipeline_parallel, dp=p.data_parallel,
                      micro_batch=t.micro_batch_size, seq_length=t.seq_length, num_micro_batches=t.grad_acc_steps,
                      zero=settings, recompute=run.model.recompute_granularity, partition=run.pipeline.partition,
                      schedule=run.pipeline.schedule, virtual=run.pipeline.virtual_stages, cp=p.context_parallel,
                      ulysses=p.ulysses, ep=p.expert_parallel, torch_compile=t.torch_compile,
                      cpu_offloading=run.cpu_offloading,
                      # --dpo's and --grpo-beta's frozen reference (with LoRA the reference is the model itself,
                      # its adapters off: no second model)
                      reference_model=bool(((t.dpo and not t.dpo.reference_logps) or (t.grpo and t.grpo.beta))
                                           and not run.model.lora_rank),
                      muon=run.optimizer.muon is not None,
                      # --grpo: a rank's rollout decodes its share of the global batch, the sequence ranks each a
                      # contiguous part (hybrid.training.rollout), in prompt + completion slots: at most
                      # --seq-length + 1; an environment's later turns take the whole --max-new-tokens again
                      decode_rows=-(-(t.global_batch_size // p.data_parallel) // p.sequence_split) if t.grpo else 0,
                      decode_slots=0 if not t.grpo else t.seq_length + (t.grpo.max_new_tokens if t.grpo.environment
                                                                         else 1))


def peak_gib(plan: MemoryPlan) -> float:
    return max(row["total"] for row in estimate(plan)) / GiB


def _with_recompute(plan: MemoryPlan, granularity: str) -> MemoryPlan:
    return replace(plan, recompute=granularity, model=replace(plan.model, recompute_granularity=granularity))


def _setup(plan: MemoryPlan):
    """The capability table's view of a plan (hybrid.capabilities)."""
    model = plan.model
    return Setup(pp=plan.pp, tp=plan.tp, schedule=plan.schedule, zero_stage=plan.zero.stage,
                 precision=plan.zero.precision, recompute=plan.recompute, micro_batches=plan.num_micro_batches,
                 cp=plan.cp, ulysses=plan.ulysses, attention_dropout=model.attention_dropout > 0,
                 documents=model.splits_documents,
                 torch_compile=plan.torch_compile, experts=bool(model.num_experts), ep=plan.ep,
                 sequence_parallel=model.sequence_parallel, seq_length=plan.seq_length,
                 heads_per_tp=model.num_attention_heads // plan.tp, groups_per_tp=model.common_query_groups // plan.tp,
                 per_layer_inputs=bool(model.per_layer_input_size), kv_shared=bool(model.kv_shared_layers),
                 # --dpo without precomputed values (with them nothing is refused)
                 dpo=plan.reference_model, optimizer="muon" if plan.muon else "adam")


def _fits_model(plan: MemoryPlan) -> bool:
    """The model's shape rules at the plan's TP (heads, query groups, ffn divisible by TP) and the parallel
    sizes' own (EP divides DP x CP); the combinations are the capability table's (`_setup`)."""
    try:
        plan.model.validate(plan.tp)
    except ConfigError:
        return False
    return (plan.dp * plan.cp * plan.ulysses) % plan.ep == 0


def _resized(plan: MemoryPlan, tp: int, pp: int, cp: int = None) -> MemoryPlan:
    """The same world and global batch at another TP x PP (x CP): DP shrinks, so each DP rank runs more
    micro-batches of the same size; ZeRO partitions over DP x CP."""
    cp = cp or plan.cp
    split = plan.cp * plan.ulysses
    world = plan.tp * plan.pp * plan.dp * split
    new_split = cp * plan.ulysses
    dp = world // (tp * pp * new_split)
    return replace(plan, tp=tp, pp=pp, dp=dp, cp=cp, zero=replace(plan.zero, dp=dp * new_split),
                   num_micro_batches=plan.num_micro_batches * plan.dp // dp)


def _proposals(plan: MemoryPlan):
    """Single changes that lower memory, in the order a user would try them: recompute, ZeRO stage,
    micro batch (global batch kept), optimizer offload, then more TP or PP (DP shrinks)."""
    world = plan.tp * plan.pp * plan.dp * plan.cp * plan.ulysses
    if plan.reference_model:  # --dpo: the reference values scored once, before training, instead of a second model
        yield "--dpo-reference-logps FILE", replace(plan, reference_model=False)
    if plan.recompute is None:
        yield "--recompute-granularity selective", _with_recompute(plan, "selective")
    if plan.recompute != "full":
        yield "--recompute-granularity full", _with_recompute(plan, "full")
    for stage in range(plan.zero.stage + 1, 4):
        yield f"ZeRO-{stage} (ds_configs/zero{stage}.json)", replace(plan, zero=replace(plan.zero, stage=stage))
    micro = plan.micro_batch // 2
    while micro >= 1:
        factor = plan.micro_batch // micro
        yield f"--micro-batch-size {micro}", replace(plan, micro_batch=micro,
                                                     num_micro_batches=plan.num_micro_batches * factor)
        micro //= 2
    if plan.zero.stage >= 1 and not plan.zero.offload_optimizer:
        yield ("optimizer offload (ds_configs/zero{}_offload.json)".format(plan.zero.stage),
               replace(plan, zero=replace(plan.zero, offload_optimizer=True)))
    if world % (plan.tp * 2 * plan.pp * plan.cp * plan.ulysses) == 0:
        yield f"--tensor-model-parallel-size {plan.tp * 2}", _resized(plan, plan.tp * 2, plan.pp)
    if plan.ulysses == 1 and world % (plan.tp * plan.pp * plan.cp * 2) == 0:  # long sequences: split them
        yield f"--context-parallel-size {plan.cp * 2}", _resized(plan, plan.tp, plan.pp, plan.cp * 2)
    pp = plan.pp * 2
    stages_fit = (plan.model.num_layers % (pp * plan.virtual) == 0 if plan.schedule != "1f1b"
                  else plan.model.num_layers >= pp)
    if world % (plan.tp * pp * plan.cp * plan.ulysses) == 0 and stages_fit:
        yield f"--pipeline-model-parallel-size {pp}", _resized(plan, plan.tp, pp)


def _candidates(plan: MemoryPlan):
    """The proposals the capability table allows and the model's shape rules accept."""
    for change, candidate in _proposals(plan):
        if allowed(_setup(candidate)) and _fits_model(candidate):
            yield change, candidate


def advise(plan: MemoryPlan, gpu_memory_gb: float) -> dict:
    """Whether the run fits in `gpu_memory_gb` GiB per device (90% of it usable) and, if not, the
    first single change from `_candidates` that makes it fit."""
    usable = gpu_memory_gb * USABLE_FRACTION
    peak = peak_gib(plan)
    result = {"gpu_memory_gb": gpu_memory_gb, "usable_gb": usable, "peak_gb": peak, "fits": peak <= usable,
              "change": None, "peak_gb_after_change": None}
    if result["fits"]:
        return result
    tried = []
    for change, candidate in _candidates(plan):
        candidate_peak = peak_gib(candidate)
        tried.append({"change": change, "peak_gb": candidate_peak})
        if candidate_peak <= usable:
            result.update(change=change, peak_gb_after_change=candidate_peak)
            break
    result["tried"] = tried
    return result


def report(run: RunConfig, gpu_memory_gb: Optional[float]) -> str:
    """The table, the advice and one line of JSON (`{"dry_run": ...}`)."""
    plan = plan_from_run(run)
    rows = estimate(plan)
    lines = [format_table(rows, plan),
             "activations: per micro-batch in flight x layers on the stage; parameters, gradients and optimizer "
             "states as DeepSpeed allocates them; buffers: ZeRO's working memory in backward (buckets, gradients "
             "waiting whole, a gathered parameter); step: the optimizer step's transients; total: the states plus "
             "the largest of buffers + activations, step and (--grpo) decoding; not included: CUDA context, "
             "allocator fragmentation."]
    advice = None
    if gpu_memory_gb:
        advice = advise(plan, gpu_memory_gb)
        if advice["fits"]:
            lines.append(f"fits: peak {advice['peak_gb']:.2f} GiB <= {advice['usable_gb']:.2f} GiB usable "
                         f"of {gpu_memory_gb:g} GiB")
        elif advice["change"]:
            lines.append(f"does not fit: peak {advice['peak_gb']:.2f} GiB > {advice['usable_gb']:.2f} GiB usable of "
                         f"{gpu_memory_gb:g} GiB; smallest change that fits: {advice['change']} "
                         f"(peak {advice['peak_gb_after_change']:.2f} GiB)")
        else:
            lines.append(f"does not fit: peak {advice['peak_gb']:.2f} GiB > {advice['usable_gb']:.2f} GiB usable; no "
                         f"single change fits: combine them (more TP/PP ranks, ZeRO-3, full recompute, micro batch 1)")
    plan_json = asdict(plan)
    lines.append(json.dumps({"dry_run": {"plan": plan_json, "stages": rows, "advice": advice}}, default=str))
    return "\n".join(lines)
