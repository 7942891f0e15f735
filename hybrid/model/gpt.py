"""The decoder-only language model on one pipeline rank holding every layer (PP = 1): the one-stage case of
hybrid.model.virtual_stages.RankModel, with the plain calls a model is used with outside the runtime."""

from __future__ import annotations

from hybrid.model.config import ModelConfig
from hybrid.model.loss import LMLoss
from hybrid.model.virtual_stages import RankModel
from hybrid.parallel.groups import as_groups
from hybrid.pipeline_plan import StagePlan


def whole_model_plan(num_layers: int) -> list[StagePlan]:
    """One stage on rank 0 holding every layer, the embedding and the head."""
    return [StagePlan(0, 0, range(num_layers), True, True)]


class GPTModel(RankModel):
    """The whole model on every rank of a TP group (PP = 1), so ZeRO-3 can partition it.

    - `model(ids)`: ids [b, s] -> logits [b, s, V_padded/tp];
    - `model(ids, labels)`: the micro-batch's LM loss (labels [b, s], IGNORE_INDEX where no loss is taken;
      `token_scale`: --calculate-per-token-loss's factor);
    - `model(ids, stage=0, batch_ids=...)`: the runtime's entry (RankModel.forward), the loss logits.
    """

    def __init__(self, config: ModelConfig, groups=None):
        groups = as_groups(groups)
        super().__init__(config, groups, whole_model_plan(config.num_layers), 0)
        self.loss_fn = LMLoss(groups, config.vocab_size)

    def forward(self, input_ids, labels=None, token_scale=None, stage=None, batch_ids=None, decode=None, routes=None,
                record_routes=False):
        if stage is not None:
            return super().forward(input_ids, stage, batch_ids, decode, routes, record_routes)
        if labels is None:
            return self.stages[0](input_ids, for_loss=False).transpose(0, 1)
        return self.loss_fn.of_whole_sequences(self.stages[0](input_ids), labels, token_scale)
