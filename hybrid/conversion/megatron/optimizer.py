"""Megatron's Adam state as hybrid can map it (megatron-core's model-space optimizer tensors in torch_dist), or why
it cannot be (the log says so and Adam starts fresh)."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

from hybrid.conversion.megatron.args import arg
from hybrid.conversion.megatron.dcp_files import DCPCheckpoint


OPTIMIZER_PREFIX = "optimizer.state."  # megatron-core's model-space optimizer tensors: PREFIX + kind + "." + model key
MOMENTS = ("exp_avg", "exp_avg_sq")
MASTERS = ("fp32_param", "param")  # the fp32 master weights: Float16Optimizer's, the distributed optimizer's


@dataclasses.dataclass
class MegatronOptimizer:
    """Megatron's Adam state as hybrid can map it: megatron-core's model-space form in torch_dist
    (`optimizer.state.{exp_avg,exp_avg_sq}.<model key>`, and the fp32 masters as `fp32_param` / `param`
    when the model is not fp32 itself), written by its FP32Optimizer / Float16Optimizer and by the
    distributed optimizer with --dist-ckpt-optim-fully-reshardable. `problem`: why it cannot be
    mapped (the log says so and Adam starts fresh), else None."""

    problem: Optional[str] = None
    master: Optional[str] = None  # the kind holding fp32 masters; None: the model's weights are the masters
    step: int = 0  # Adam's step count
    groups: tuple = ()  # ((lr, betas, eps, weight_decay) of the decayed group, and of the others)


def optimizer_of(ckpt) -> MegatronOptimizer:
    """What of a Megatron-LM checkpoint's (hybrid.conversion.megatron.lm.MegatronCheckpoint) Adam state maps."""
    common = ckpt.common
    if ckpt.format != "torch_dist":
        stored = "holds" if ckpt.has_optimizer else "holds no"
        return MegatronOptimizer(problem=f"the legacy format {stored} optimizer state; hybrid maps megatron-core's "
                                         f"model-space optimizer state of --ckpt-format torch_dist (re-save with "
                                         f"--ckpt-format torch_dist --dist-ckpt-optim-fully-reshardable)")
    keys = DCPCheckpoint(ckpt.directory).metadata.state_dict_metadata
    kinds = {k[len(OPTIMIZER_PREFIX):].split(".", 1)[0] for k in keys if k.startswith(OPTIMIZER_PREFIX)}
    if not set(MOMENTS) <= kinds:
        sharded = any(k.startswith("optimizer.distributed.") for k in keys)
        why = ("the distributed optimizer's buffers (Megatron-LM's default dp_reshardable form), which only "
               "Megatron-LM at the same TP / PP reads; re-save with --dist-ckpt-optim-fully-reshardable"
               if sharded else "no Adam moments")
        return MegatronOptimizer(problem=f"the checkpoint holds {why}")
    step = _optimizer_step(common.get("optimizer"))
    if step is None:
        return MegatronOptimizer(problem="its optimizer records no single step count")
    groups = _optimizer_groups(common.get("optimizer"))
    master = next((k for k in MASTERS if k in kinds), None)
    if master is None and (arg(ckpt.args, "bf16") or arg(ckpt.args, "fp16")):
        return MegatronOptimizer(problem="its optimizer state has no fp32 master weights")
    return MegatronOptimizer(master=master, step=step, groups=groups)


def _optimizer_states(node) -> Iterator[dict]:
    """Every optimizer state dict (one with param_groups) in common.pt's `optimizer` (chained: nested)."""
    if isinstance(node, dict):
        if isinstance(node.get("param_groups"), list):
            yield node
        for value in node.values():
            if isinstance(value, (dict, list)):
                yield from _optimizer_states(value)
    elif isinstance(node, list):
        for value in node:
            yield from _optimizer_states(value)


def _optimizer_step(node) -> Optional[int]:
    """The step count every parameter shares: FP32/Float16Optimizer's `common_step`, the distributed
    optimizer's per-group `step`."""
    steps = set()
    for state in _optimizer_states(node):
        inner = state.get("state") if isinstance(state.get("state"), dict) else {}
        if "common_step" in inner:
            steps.add(int(inner["common_step"]))
        steps.update(int(g["step"]) for g in state["param_groups"] if isinstance(g, dict) and "step" in g)
    return steps.pop() if len(steps) == 1 else None


def _optimizer_groups(node) -> tuple:
    """((lr, betas, eps, weight decay) of the decayed parameters, and of the others): the hyperparameters
    Megatron's scheduler left in its groups (weight decay x wd_mult, 0 on biases and norms)."""
    groups = [g for state in _optimizer_states(node) for g in state["param_groups"] if isinstance(g, dict)]
    if not groups:
        return ()

    def hyper(g):
        return (float(g.get("lr", 0.0)), tuple(g.get("betas", (0.9, 0.999))), float(g.get("eps", 1e-8)),
                float(g.get("weight_decay", 0.0)))
    decayed = next((g for g in groups if float(g.get("wd_mult", 1.0)) != 0.0), groups[0])
    others = next((g for g in groups if float(g.get("wd_mult", 1.0)) == 0.0), None)
    return (hyper(decayed), hyper(others) if others else hyper(decayed)[:3] + (0.0,))
