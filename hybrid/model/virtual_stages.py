"""The model cut into virtual pipeline stages, for the schedules of `torch.distributed.pipelining`.

The stage plan (which layers, which rank, loop or V placement) is hybrid.pipeline_plan's. With the
loop placement a tied embedding is two copies, on the ranks of the first and last stages, whose
gradients are summed (as DeepSpeed's TiedLayerSpec does); with the V placement rank 0 holds both
ends and the table is one parameter used twice.

A rank's parameters live in one `PipelineRankModel` under their canonical names (`embedding.*`,
`layers.{i}.*`, `final_norm.*`, `output_layer.weight`), so checkpoints, conversion and the
optimizer's parameter names are those of GPTModel; the stages are views onto its submodules.
"""

from __future__ import annotations

import torch.nn as nn

from hybrid.model.config import ModelConfig
from hybrid.model.embedding import Embedding, OutputHead, TiedOutputEmbedding, parallel_logits
from hybrid.model.naming import TIED_COPY
from hybrid.model.norms import build_norm
from hybrid.model.preference import PreferenceStats
from hybrid.model.recompute import run_layers
from hybrid.model.sequence import sequence_layout, stage_layout_of
from hybrid.model.transformer import TransformerLayer
from hybrid.parallel.groups import as_groups
from hybrid.pipeline_plan import StagePlan

assert TIED_COPY == "tied_output"  # the attribute below


class PipelineRankModel(nn.Module):
    """Every parameter one pipeline rank holds, under canonical names, and its virtual stages."""

    def __init__(self, config: ModelConfig, groups, plans: list[StagePlan], pp_rank: int):
        super().__init__()
        self.groups = groups = as_groups(groups)
        self.config = config
        self.plans = [p for p in plans if p.rank == pp_rank]
        holds_first = any(p.first for p in self.plans)
        holds_last = any(p.last for p in self.plans)
        self.embedding = Embedding(config, groups) if holds_first else None
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, groups, i)
                                     for p in self.plans for i in p.layers})
        self.final_norm = build_norm(config, groups) if holds_last else None
        self.output_layer = None
        self.tied_output = None
        if holds_last and not config.tied_embeddings:
            self.output_layer = OutputHead(config, groups)
        elif holds_last and not holds_first:
            # DeepSpeed skips parameters marked ds_pipe_replicated when it computes the gradient
            # norm, so the tied table counts once (as for its own TiedLayerSpec copies)
            self.tied_output = TiedOutputEmbedding(config, groups)
            self.tied_output.word_embeddings.weight.ds_pipe_replicated = True
        # plain list: the stages are views, not a second registration of the same parameters
        self.stages = [VirtualStage(self, plan) for plan in self.plans]
        self.preference_stats = PreferenceStats()  # --dpo's rewards (the last stage's), as GPTModel's

    def tied_weight(self):
        """This rank's copy of a tied embedding table that another rank also holds (loop placement)."""
        if not self.config.tied_embeddings:
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
        table = self.tied_output if self.tied_output is not None else self.embedding
        weight = table.word_embeddings.weight
        return parallel_logits(hidden, weight, self.groups, self.config.sequence_parallel, self.config.vocab_size,
                               self.config.async_tensor_model_parallel_allreduce)


class VirtualStage(nn.Module):
    """One virtual stage as the module `torch.distributed.pipelining.PipelineStage` runs."""

    def __init__(self, owner: PipelineRankModel, plan: StagePlan):
        super().__init__()
        self.plan = plan
        self.first, self.last = plan.first, plan.last
        self.embedding = owner.embedding if plan.first else None
        self.layers = nn.ModuleList(owner.layers[str(i)] for i in plan.layers)
        self.final_norm = owner.final_norm if plan.last else None
        head = owner.output_layer if owner.output_layer is not None else owner.tied_output
        self.head = head if plan.last else None
        object.__setattr__(self, "_owner", owner)  # not a child: no second path to the same parameters
        if plan.last and owner.config.tied_embeddings and owner.tied_output is None:
            # V placement: the table is the embedding's, used a second time here; name it a child so
            # this stage's parameters() (what zero-bubble's weight-gradient step differentiates) include it
            self.head = owner.embedding

    def forward(self, hidden, input_ids=None):
        """`input_ids`: the micro-batch's whole-sequence ids [b, s], given to every stage (the schedule's
        keyword arguments reach each stage) when sequences are packed documents, so each stage finds the
        documents and positions itself; between stages only the hidden states travel. The first stage
        gets the whole-sequence ids as `hidden` and takes this rank's part of them."""
        owner = self._owner
        if self.first:
            layout = sequence_layout(hidden, owner.config, owner.groups)
            hidden = self.embedding(hidden if layout is None else layout.local(hidden), layout)
        else:
            layout = stage_layout_of(hidden, input_ids, owner.config, owner.groups)
        hidden = run_layers(list(self.layers), hidden, owner.config, owner.training, layout)
        if self.last:
            hidden = owner.logits(self.final_norm(hidden))
        return hidden
