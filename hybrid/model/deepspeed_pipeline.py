"""The model as the stages DeepSpeed's PipelineEngine runs (PP > 1, its 1F1B schedule): the one adapter
between DeepSpeed's pipeline conventions and the model's plain modules.

DeepSpeed's conventions, kept here and nowhere else:
- a stage is a list of `LayerSpec`s (the tied embedding a `TiedLayerSpec` on the first and last stage),
  each layer called with one value: the previous layer's output. With packed documents that value is
  `(hidden, whole-sequence ids)`, so each layer finds the documents; otherwise the hidden states alone,
  and with a sequence split (CP / Ulysses) a stage derives this rank's part from their length;
- the loss is `loss_fn(outputs, labels)` with the micro-batch's whole-sequence labels (this rank's part
  is taken here), its per-token scale (--calculate-per-token-loss) set on the loss by the step;
- full recompute: DeepSpeed's `activation_checkpoint_interval` (uniform) or a layer that recomputes
  itself (block), since the engine calls each layer itself;
- parameters are named by the layer's index in the LayerSpec list (hybrid.model.naming maps them).
The embedding, layers, norm and head themselves (hybrid.model.*) see plain tensors.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from hybrid.errors import ConfigError
from hybrid.model import preference
from hybrid.model.config import ModelConfig
from hybrid.model.embedding import Embedding, OutputHead, TiedOutputEmbedding
from hybrid.model.loss import LMLoss
from hybrid.model.naming import TIED_KEY
from hybrid.model.norms import build_norm
from hybrid.model.preference import DPOOptions, PreferenceStats
from hybrid.model.recompute import checkpoint
from hybrid.model.sequence import sequence_layout, stage_layout_of
from hybrid.model.transformer import TransformerLayer
from hybrid.pipeline_plan import resolve_partition


def _pack(hidden, ids):
    """What travels to the next layer: the hidden states, and with packed documents the ids too."""
    return hidden if ids is None else (hidden, ids)


class PipelineEmbedding(Embedding):
    """The first stage's embedding: whole-sequence ids [b, s] -> this rank's hidden states (its part of
    the sequence under CP / Ulysses), with the ids alongside when documents are packed."""

    def forward(self, ids):
        layout = sequence_layout(ids, self.config, self.groups)
        hidden = super().forward(ids if layout is None else layout.local(ids), layout)
        return _pack(hidden, ids if self.config.splits_documents else None)


class PipelineTransformerLayer(TransformerLayer):
    """A transformer layer as one pipeline layer. `recompute_whole`: it recomputes itself in backward
    (full recompute, block method)."""

    recompute_whole = False

    def forward(self, inputs):
        hidden, ids = inputs if self.config.splits_documents else (inputs, None)
        layout = stage_layout_of(hidden, ids, self.config, self.groups)
        if self.recompute_whole and self.training and torch.is_grad_enabled():
            return _pack(checkpoint(super().forward, hidden, layout), ids)
        return _pack(super().forward(hidden, layout), ids)


class PipelineFinalNorm(nn.Module):
    """The final norm as a pipeline layer; named `final_norm` like GPTModel's. The ids stop here."""

    def __init__(self, config: ModelConfig, groups):
        super().__init__()
        self.carries_ids = config.splits_documents
        self.final_norm = build_norm(config, groups)

    def forward(self, inputs):
        return self.final_norm(inputs[0] if self.carries_ids else inputs)


class PipelineOutputHead(nn.Module):
    """The untied output head as a pipeline layer; named `output_layer` like GPTModel's."""

    def __init__(self, config: ModelConfig, groups):
        super().__init__()
        self.output_layer = OutputHead(config, groups)

    def forward(self, hidden):  # feeds the pipeline's loss_fn only
        return self.output_layer.loss_logits(hidden)


class PipelineLoss:
    """DeepSpeed's `loss_fn(outputs, labels)`: the LM loss from the last stage's logits and the
    micro-batch's whole-sequence labels. `token_scale`: --calculate-per-token-loss's factor for this
    iteration, set by the step before the engine runs it (None: the mean over valid tokens).

    --dpo (`preference` set): the labels are a tuple, `(labels, ids)` -> the per-document log-probability sums
    and counts stacked, [2, b, s] (the pipeline scoring the reference values), or `(labels, ids, reference
    sums)` -> the pair loss (hybrid.model.preference), its rewards statistics kept in `preference_stats`."""

    def __init__(self, groups, vocab_size: int):
        self.groups, self.vocab_size = groups, vocab_size
        self.lm_loss = LMLoss(groups, vocab_size)
        self.token_scale: Optional[torch.Tensor] = None
        self.preference: Optional[DPOOptions] = None
        self.preference_stats = PreferenceStats()
        self.__name__ = "LMLoss"  # DeepSpeed logs the loss function's name

    def __call__(self, logits, labels):
        if not isinstance(labels, tuple):
            return self.lm_loss.of_whole_sequences(logits, labels, self.token_scale)
        labels, ids, *reference = labels
        sums = preference.document_logps(logits, labels, ids, self.groups, self.vocab_size, self.preference.separator)
        if not reference:
            return torch.stack(sums)
        loss, stats = preference.dpo_loss(sums, (reference[0], None), self.preference, self.token_scale)
        self.preference_stats.add(stats)
        return loss


def pipeline_layers(config: ModelConfig, groups) -> list:
    """LayerSpecs: embedding, transformer layers, final norm, output head (tied via TiedLayerSpec)."""
    specs = []
    if config.tied_embeddings:
        specs.append(TiedLayerSpec(TIED_KEY, PipelineEmbedding, config, groups,
                                   tied_weight_attr="word_embeddings.weight"))
    else:
        specs.append(LayerSpec(PipelineEmbedding, config, groups))
    specs += [LayerSpec(PipelineTransformerLayer, config, groups, i) for i in range(config.num_layers)]
    specs.append(LayerSpec(PipelineFinalNorm, config, groups))
    if config.tied_embeddings:
        specs.append(TiedLayerSpec(TIED_KEY, TiedOutputEmbedding, config, groups,
                                   tied_weight_attr="word_embeddings.weight"))
    else:
        specs.append(LayerSpec(PipelineOutputHead, config, groups))
    return specs


def build_pipeline_module(config: ModelConfig, groups, partition: str = "parameters",
                          module_class: Optional[type] = None) -> PipelineModule:
    """This rank's stage of the model as a DeepSpeed PipelineModule over `groups`' pipeline axis (PP > 1).
    `partition`: --pipeline-partition; `module_class`: PipelineModule or a subclass of it (the training
    package's explicit-list partition, among its DeepSpeed fixes)."""
    pp = groups.pp.size
    if pp < 2:
        raise ValueError("build_pipeline_module needs PP > 1; use GPTModel for PP = 1")
    if config.num_layers < pp:
        raise ConfigError(f"--pipeline-model-parallel-size {pp} is larger than --num-layers "
                          f"{config.num_layers}: every stage needs at least one layer.")
    config.validate(groups.tp_size)
    full_uniform = config.recompute_granularity == "full" and config.recompute_method == "uniform"
    module = (module_class or PipelineModule)(
        layers=pipeline_layers(config, groups),
        loss_fn=PipelineLoss(groups, config.vocab_size),
        topology=groups.ds_topology,
        partition_method=resolve_partition(partition, config.num_layers, pp),
        activation_checkpoint_interval=max(1, config.recompute_num_layers) if full_uniform else 0,
        checkpointable_layers=[PipelineTransformerLayer.__name__],
    )
    module.preference_stats = module.loss_fn.preference_stats  # --dpo's rewards (the last stage's), as GPTModel's
    if config.recompute_granularity == "full" and config.recompute_method == "block":
        stage_layers = [f for f in module.forward_funcs if isinstance(f, PipelineTransformerLayer)]
        for layer in stage_layers[: config.recompute_num_layers]:
            layer.recompute_whole = True
    return module
