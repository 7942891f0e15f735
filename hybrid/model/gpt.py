"""The decoder-only language model as one nn.Module (PP = 1). Its parameter names are the canonical
ones (hybrid.model.naming); the pipeline forms of the same model are hybrid.model.deepspeed_pipeline
(DeepSpeed's 1F1B engine) and hybrid.model.virtual_stages (the torch.distributed.pipelining schedules).
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from hybrid.model import preference
from hybrid.model.config import ModelConfig
from hybrid.model.embedding import Embedding, OutputHead, parallel_logits
from hybrid.model.loss import LMLoss
from hybrid.model.norms import build_norm
from hybrid.model.preference import DPOOptions, PreferenceStats
from hybrid.model.recompute import run_layers
from hybrid.model.sequence import sequence_layout
from hybrid.model.transformer import TransformerLayer
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
        # --dpo (hybrid.model.preference): its options, and the rewards statistics since the last log line
        self.preference: Optional[DPOOptions] = None
        self.preference_stats = PreferenceStats()

    def forward(self, input_ids, labels=None, token_scale=None, reference=None, document_logps=False):
        """input_ids [b, s] -> logits [b, s, V_padded/tp]; or, with labels [b, s] (IGNORE_INDEX where no
        loss is taken), the micro-batch's LM loss (`token_scale`: --calculate-per-token-loss's factor);
        with --dpo, `document_logps`: each packed sequence's (log-probability sum, token count), or given the
        reference model's (`reference`), the DPO loss (hybrid.model.preference)."""
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
        if document_logps or reference is not None:
            sums = preference.document_logps(logits, labels, input_ids, self.groups, self.config.vocab_size,
                                             self.preference.separator)
            if reference is None:
                return sums
            loss, stats = preference.dpo_loss(sums, reference, self.preference, token_scale)
            self.preference_stats.add(stats)
            return loss
        return self.loss_fn.of_whole_sequences(logits, labels, token_scale)  # this rank's part of the sequences
