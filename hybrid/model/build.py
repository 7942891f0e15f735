"""This rank's part of the model, for training and evaluation alike: the one model form
(hybrid.model.virtual_stages.RankModel) for the run's stage plan; GPTModel, its one-stage case, at PP = 1."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch.nn as nn

from hybrid.model.config import ModelConfig
from hybrid.model.gpt import GPTModel
from hybrid.model.transformer import TransformerLayer
from hybrid.model.virtual_stages import RankModel
from hybrid.pipeline_plan import PipelineSchedule, plan_stages


def build_model(config: ModelConfig, groups, pipeline: PipelineSchedule = PipelineSchedule(),
                init_context: Optional[contextlib.AbstractContextManager] = None,
                compile_layers: bool = False) -> RankModel:
    """The model of this rank over `groups`. `init_context`: entered while the model is built (ZeRO-3's
    `deepspeed.zero.Init`, which partitions each parameter over the stage's data-parallel ranks as its module
    is made); `compile_layers`: --torch-compile."""
    with init_context or contextlib.nullcontext():
        model = build_rank_model(config, groups, pipeline) if groups.pp.size > 1 else GPTModel(config, groups)
    if compile_layers:
        compile_transformer_layers(model)
    return model


def build_rank_model(config: ModelConfig, groups, pipeline: PipelineSchedule) -> RankModel:
    """This pipeline rank's virtual stages (hybrid.pipeline_plan's stage plan)."""
    plans = plan_stages(config.num_layers, groups.pp.size, pipeline.virtual_stages, pipeline.schedule,
                        pipeline.stage_layers)
    return RankModel(config, groups, plans, groups.pp.rank)


def compile_transformer_layers(model: nn.Module) -> int:
    """Regional compilation (as torchtitan): `torch.compile` on every TransformerLayer, not on the
    whole model, so the embedding, loss and DeepSpeed's hooks stay eager, identical layers share
    one compiled graph, and compile time does not grow with depth. Returns the layer count."""
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compile()
    return len(layers)
