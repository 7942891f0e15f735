"""The model cut into virtual pipeline stages, for the schedules of `torch.distributed.pipelining`.

With v virtual stages per pipeline rank the model has S = PP x v stages of equal layer counts
(Megatron-LM's interleaving: stage s holds layers [s L/S, (s+1) L/S)); the embedding goes with
stage 0, the final norm and output head with stage S - 1. Two placements:

- loop (interleaved 1F1B, interleaved zero-bubble): stage s runs on pipeline rank s mod PP, so the
  first and last stages are on ranks 0 and PP - 1 (a tied embedding is two copies whose gradients
  are summed, as DeepSpeed's TiedLayerSpec does);
- V (ZB-V, DualPipeV; v = 2): stage s runs on rank s for s < PP and on rank 2 PP - 1 - s after, so
  rank 0 holds both ends and a tied embedding is one parameter used twice.

A rank's parameters live in one `PipelineRankModel` under their canonical names (`embedding.*`,
`layers.{i}.*`, `final_norm.*`, `output_layer.weight`), so checkpoints, conversion and the
optimizer's parameter names are those of GPTModel; the stages are views onto its submodules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig
from hybrid.model.embedding import Embedding, OutputHead, TiedOutputEmbedding, parallel_logits
from hybrid.model.norms import build_norm
from hybrid.model.transformer import TransformerLayer

V_SHAPED = ("zbv", "dualpipev")
TIED_COPY = "tied_output"  # the last stage's copy of a tied embedding (loop placement, PP > 1)


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


class PipelineRankModel(nn.Module):
    """Every parameter one pipeline rank holds, under canonical names, and its virtual stages."""

    def __init__(self, config: ModelConfig, tp_group, plans: list[StagePlan], pp_rank: int):
        super().__init__()
        self.config, self.tp_group = config, tp_group
        self.plans = [p for p in plans if p.rank == pp_rank]
        holds_first = any(p.first for p in self.plans)
        holds_last = any(p.last for p in self.plans)
        self.embedding = Embedding(config, tp_group) if holds_first else None
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, tp_group, i)
                                     for p in self.plans for i in p.layers})
        self.final_norm = build_norm(config, tp_group) if holds_last else None
        self.output_layer = None
        self.tied_output = None
        if holds_last and not config.tied_embeddings:
            self.output_layer = OutputHead(config, tp_group)
        elif holds_last and not holds_first:
            # DeepSpeed skips parameters marked ds_pipe_replicated when it computes the gradient
            # norm, so the tied table counts once (as for its own TiedLayerSpec copies)
            self.tied_output = TiedOutputEmbedding(config, tp_group)
            self.tied_output.word_embeddings.weight.ds_pipe_replicated = True
        # plain list: the stages are views, not a second registration of the same parameters
        self.stages = [VirtualStage(self, plan) for plan in self.plans]

    def tied_weight(self):
        """This rank's copy of a tied embedding table that another rank also holds (loop placement)."""
        if not self.config.tied_embeddings or (self.embedding is not None and self.tied_output is not None):
            return None
        if self.tied_output is not None:
            return self.tied_output.word_embeddings.weight
        if self.embedding is not None and not any(p.last for p in self.plans):
            return self.embedding.word_embeddings.weight
        return None

    def logits(self, hidden):
        """final-normed hidden -> logits that feed the loss (TP-split over the vocabulary)."""
        if self.output_layer is not None:
            return self.output_layer.loss_logits(hidden)
        weight = (self.tied_output or self.embedding).word_embeddings.weight
        return parallel_logits(hidden, weight, self.tp_group, self.config.sequence_parallel, self.config.vocab_size)


class VirtualStage(nn.Module):
    """One virtual stage as the module `torch.distributed.pipelining.PipelineStage` runs."""

    def __init__(self, owner: PipelineRankModel, plan: StagePlan):
        super().__init__()
        self.plan = plan
        self.first, self.last = plan.first, plan.last
        self.embedding = owner.embedding if plan.first else None
        self.layers = nn.ModuleList(owner.layers[str(i)] for i in plan.layers)
        self.final_norm = owner.final_norm if plan.last else None
        self.head = owner.output_layer or owner.tied_output if plan.last else None
        object.__setattr__(self, "_owner", owner)  # not a child: no second path to the same parameters
        if plan.last and owner.config.tied_embeddings and owner.tied_output is None:
            # V placement: the table is the embedding's, used a second time here; name it a child so
            # this stage's parameters() (what zero-bubble's weight-gradient step differentiates) include it
            self.head = owner.embedding

    def forward(self, hidden):
        from hybrid.model.gpt import run_layers
        owner = self._owner
        if self.first:
            hidden = self.embedding(hidden)
        hidden = run_layers(list(self.layers), hidden, owner.config, owner.training)
        if self.last:
            hidden = owner.logits(self.final_norm(hidden))
        return hidden
