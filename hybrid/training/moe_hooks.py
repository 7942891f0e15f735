"""What each training iteration does for a model's MoE layers (hybrid.model.moe) and DSA indexers that train by
their KL loss (hybrid.model.dsa): before it, the auxiliary losses' backward factor; after the optimizer step, the
score-bias update (DeepSeek-V3's auxiliary-loss-free balancing, counts summed over every rank routing tokens of the
step); at a log line, the auxiliary losses, the expert balance and (--grpo) the routing mismatch since the last;
and the fp32 buffers after an engine's cast."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from hybrid.model.dsa import Indexer
from hybrid.model.moe.router import Router
from hybrid.parallel import collectives as C


def routers(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, Router)]


def keep_fp32_buffers(model: nn.Module) -> None:
    """The score bias and the counts back in fp32 after an engine cast the model (DeepSpeed's bf16/fp16
    engines cast every floating buffer): steps of 1e-3 on a bf16 bias and counts above 256 in bf16 would
    round away (Megatron keeps them in fp32 too)."""
    for router in routers(model):
        if router.score_bias is not None:
            router.score_bias = router.score_bias.float()
        router.tokens_per_expert = router.tokens_per_expert.float()


def aux_loss_modules(model: nn.Module) -> list:
    """The modules that attach an auxiliary loss to an output (hybrid.model.moe.router.AuxLossBackward): MoE's
    routers, and DSA's indexers that train by their KL loss (hybrid.model.dsa)."""
    return [m for m in model.modules() if isinstance(m, Router) or (isinstance(m, Indexer) and m.trains)]


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The factor each micro-batch's LM loss gets in backward, for the auxiliary losses
    (hybrid.model.moe.router.AuxLossBackward)."""
    for module in aux_loss_modules(model):
        module.aux_loss_scale = scale


def update_score_bias(model: nn.Module) -> None:
    """After an optimizer step: each router's score bias moves by the update rate towards balance,
    sign(mean count - count) per expert, counts summed over every rank routing tokens of the step
    (TP under SP, CP, DP: one all-reduce each for all layers), then the counts start again."""
    biased = [r for r in routers(model) if r.score_bias is not None]
    if not biased:
        return
    counts = torch.stack([r.tokens_per_expert for r in biased])
    groups = biased[0].groups
    if biased[0].config.sequence_parallel:
        C.all_reduce(counts, groups.tp_group)
    C.all_reduce(counts, groups.dp_cp.group)  # every rank of the step: DP x CP (or Ulysses)
    rate = biased[0].config.moe_router_bias_update_rate
    with torch.no_grad():
        for router, row in zip(biased, counts):
            router.score_bias += torch.sign(row.mean() - row) * rate
            router.tokens_per_expert.zero_()


def take_logged(model: nn.Module) -> dict:
    """The auxiliary losses summed over layers and the tokens-per-expert imbalance (max / mean count,
    worst layer) since the last call, as device tensors; empties the sums."""
    out, worst = {}, None
    for router in aux_loss_modules(model):
        for name, value in router.logged.items():
            if name in ROUTING_COUNTS:
                out[name] = value if name not in out else out[name] + value
            elif name == "tokens_per_expert":
                ratio = value.max() / value.mean().clamp_min(1e-9)
                worst = ratio if worst is None else torch.maximum(worst, ratio)
            else:
                out[name] = value if name not in out else out[name] + value
        router.logged = {}
    if worst is not None:
        out["expert_imbalance"] = worst
    return out


# the routers' counts of --grpo's recorded routing (hybrid.model.moe.router.Router.forward), summed over layers:
# tokens whose experts in the training forward differ from the generator's, tokens whose experts replay changed
# (--moe-routing-replay), tokens recorded
ROUTING_COUNTS = ("routing_differ", "routing_replayed", "routing_recorded")
RATIOS = ("expert_imbalance",)  # logged as they are, not per micro-batch


def routing_shares(values: dict, device) -> dict:
    """--grpo's routing counts of every rank since the last log line (each rank routes its own rows, its part of the
    sequence and its stages' layers: one all-reduce over the job, which every rank's log line calls) -> the shares
    `routing_mismatch` (decisions the trainer used that differ from the generator's) and `routing_replayed` (those
    replay changed); nothing where no token was recorded (not --grpo)."""
    counts = torch.stack([values.pop(name, torch.zeros((), device=device)).to(device, torch.float64)
                          for name in ROUTING_COUNTS])
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(counts)
    differ, replayed, recorded = counts.tolist()
    if not recorded:
        return {}
    return {"routing_mismatch": differ / recorded, "routing_replayed": replayed / recorded}


class MoEStepHooks:
    """What each training iteration does for a model's MoE layers (the training loop calls it): before it, the
    auxiliary losses' backward factor (sequence split / micro-batches, as the LM loss gets); after the
    optimizer step, the score-bias update; at a log line, the losses and balance since the last."""

    def __init__(self, model: nn.Module, sequence_split: int):
        self.model, self.sequence_split = model, sequence_split
        self.micro_batches = 0

    @classmethod
    def of(cls, model: nn.Module, sequence_split: int) -> Optional["MoEStepHooks"]:
        return cls(model, sequence_split) if aux_loss_modules(model) else None

    def before(self, micro_batches: int) -> None:
        set_aux_loss_scale(self.model, self.sequence_split / micro_batches)
        self.micro_batches += micro_batches

    def after(self) -> None:
        update_score_bias(self.model)

    def metrics(self, device=None) -> dict:
        """Per micro-batch means of the auxiliary losses (summed over this rank's layers) and the worst
        layer's max / mean tokens per expert, of this rank's micro-batches since the last call; with `device`
        (--grpo: every rank calls it), the routing shares of the whole job (routing_shares)."""
        values = take_logged(self.model)
        count, self.micro_batches = max(1, self.micro_batches), 0
        shares = routing_shares(values, device) if device is not None else {}
        return dict({name: float(v) / (1 if name in RATIOS else count) for name, v in values.items()}, **shares)
