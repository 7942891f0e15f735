"""The decoder-only language model: one nn.Module (PP = 1) or DeepSpeed pipeline stages (PP > 1).

Parameter names are canonical (hybrid.model.naming) in GPTModel and the virtual stages;
DeepSpeed's PipelineModule names them by layer index, and naming maps between the two.
"""

from __future__ import annotations

import torch.nn as nn

from hybrid.model.config import ModelConfig
from hybrid.model.embedding import Embedding, LMLoss, OutputHead, TiedOutputEmbedding, parallel_logits
from hybrid.model.norms import build_norm
from hybrid.model.recompute import run_layers
from hybrid.model.sequence import sequence_layout
from hybrid.model.transformer import TransformerLayer
from hybrid.parallel.cross_entropy import IGNORE_INDEX
from hybrid.parallel.groups import as_groups


class GPTModel(nn.Module):
    """The whole model on every rank of a TP group (PP = 1), so ZeRO-3 can partition it."""

    def __init__(self, config: ModelConfig, groups=None):
        super().__init__()
        self.groups = groups = as_groups(groups)
        config.validate(groups.tp_size)
        self.config = config
        self.embedding = Embedding(config, groups)
        self.layers = nn.ModuleList(TransformerLayer(config, groups, i) for i in range(config.num_layers))
        self.final_norm = build_norm(config, groups)
        self.output_layer = OutputHead(config, groups) if config.untie_embeddings_and_output_weights else None
        self.loss_fn = LMLoss(groups, config.vocab_size)

    def forward(self, input_ids, labels=None):
        """input_ids [b, s] -> logits [b, s, V_padded/tp]; or, with labels [b, s] (IGNORE_INDEX where no
        loss is taken), the mean LM loss over the valid tokens."""
        # packed documents' masks and positions, this CP rank's chunks of the sequence; or None
        layout = sequence_layout(input_ids, self.config, self.groups)
        hidden = self.embedding(input_ids if layout is None else layout.local(input_ids), layout)  # [s(/tp), b, h]
        hidden = run_layers(list(self.layers), hidden, self.config, self.training, layout)
        hidden = self.final_norm(hidden)
        for_loss = labels is not None
        if self.output_layer is not None:
            logits = self.output_layer.loss_logits(hidden) if for_loss else self.output_layer(hidden)
        else:
            logits = parallel_logits(hidden, self.embedding.word_embeddings.weight, self.groups,
                                     self.config.sequence_parallel,
                                     self.config.vocab_size if for_loss else None,
                                     self.config.async_tensor_model_parallel_allreduce)  # [s, b, V/tp]
        if not for_loss:
            return logits.transpose(0, 1)
        if layout is not None and layout.index is not None:  # this rank's tokens; the count is the whole sequence's
            return self.loss_fn(logits, layout.local(labels), valid=(labels != IGNORE_INDEX).sum())
        return self.loss_fn(logits, labels)


class FinalNormStage(nn.Module):
    """The final norm as a pipeline layer; named `final_norm` like GPTModel's."""

    def __init__(self, config: ModelConfig, groups):
        super().__init__()
        self.final_norm = build_norm(config, groups)

    def forward(self, hidden):
        if isinstance(hidden, tuple):  # packed documents: the ids travelled with the hidden states this far
            hidden = hidden[0]
        return self.final_norm(hidden)


class OutputHeadStage(nn.Module):
    """The untied output head as a pipeline layer; named `output_layer` like GPTModel's."""

    def __init__(self, config: ModelConfig, groups):
        super().__init__()
        self.output_layer = OutputHead(config, groups)

    def forward(self, hidden):  # feeds the pipeline's loss_fn only
        return self.output_layer.loss_logits(hidden)


def pipeline_layers(config: ModelConfig, groups) -> list:
    """LayerSpecs: embedding, transformer layers, final norm, output head (tied via TiedLayerSpec)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    specs = []
    if config.tied_embeddings:
        specs.append(TiedLayerSpec("embed", Embedding, config, groups, tied_weight_attr="word_embeddings.weight"))
    else:
        specs.append(LayerSpec(Embedding, config, groups))
    specs += [LayerSpec(TransformerLayer, config, groups, i) for i in range(config.num_layers)]
    specs.append(LayerSpec(FinalNormStage, config, groups))
    if config.tied_embeddings:
        specs.append(TiedLayerSpec("embed", TiedOutputEmbedding, config, groups,
                                   tied_weight_attr="word_embeddings.weight"))
    else:
        specs.append(LayerSpec(OutputHeadStage, config, groups))
    return specs
