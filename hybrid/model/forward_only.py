"""Forward passes without a backward through one rank's stages (evaluation, scoring), the same at every layout:
PP = 1 runs its one stage, a pipeline runs each rank's virtual stages in stage order with the hidden states
sent between ranks. The training runtime (hybrid.training.runtime) and evaluation (hybrid.evaluation) both run
forward-only passes through here."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid.model.virtual_stages import RankModel


def hidden_shape(config, groups, micro_batch: int, seq_length: int) -> tuple:
    """The hidden states one stage sends the next: [s, b, h], s this rank's part under CP / Ulysses and SP."""
    seq = seq_length // groups.sequence_split
    seq = seq // groups.tp.size if config.sequence_parallel else seq
    return seq, micro_batch, config.hidden_size


@torch.no_grad()
def forward_only(model: RankModel, groups, device, ids: list, on_output, call=None, inputs=None) -> list:
    """Every micro-batch of `ids` ([b, s] each) through this rank's virtual stages in stage order; `on_output(mb,
    logits)` on the last stage's outputs, their values returned in order (empty on the other ranks). Written
    here because torch 2.13's `schedule.eval()` runs the backward actions of its V-shaped schedules ("can't
    steal_bwd_input if this stage doesn't have backward"); each rank runs its stages in stage order and sends
    asynchronously, so no rank waits on a later one. At PP = 1: the one stage, micro-batch by micro-batch.
    `call`: what runs a stage, `call(hidden, stage=, batch_ids=)` (the DeepSpeed engine around `model`; default
    the model itself); `inputs`: each micro-batch's other keyword arguments of the model's forward
    (Objective.model_inputs), or None."""
    group, sends, local, outputs = groups.pp.group, [], {}, []
    call = call or model
    config = model.config
    rank_of = {p.index: p.rank for p in model.all_plans}
    dtype = next(model.parameters()).dtype
    for position, stage in sorted(enumerate(model.stages), key=lambda item: item[1].plan.index):
        index = stage.plan.index
        for mb in range(len(ids)):
            batch_ids = ids[mb] if config.splits_documents else None
            if stage.first:
                hidden = ids[mb]
            elif rank_of[index - 1] == groups.pp.rank:
                hidden = local.pop((index, mb))
            else:
                hidden = torch.empty(hidden_shape(config, groups, ids[mb].size(0), ids[mb].size(1)), dtype=dtype,
                                     device=device)
                dist.irecv(hidden, group=group, group_src=rank_of[index - 1]).wait()
            out = call(hidden, stage=position, batch_ids=batch_ids, **(inputs[mb] if inputs else {}))
            if stage.last:
                outputs.append(on_output(mb, out))
            elif rank_of[index + 1] == groups.pp.rank:
                local[(index + 1, mb)] = out
            else:
                sends.append(dist.isend(out.contiguous(), group=group, group_dst=rank_of[index + 1]))
    for work in sends:
        work.wait()
    return outputs
