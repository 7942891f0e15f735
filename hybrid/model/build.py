"""This rank's part of the model, in the form its pipeline schedule runs, for training and evaluation
alike: GPTModel (PP = 1), DeepSpeed's pipeline stages (PP > 1, its 1F1B engine) or this rank's virtual
stages (the torch.distributed.pipelining schedules)."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch.nn as nn

from hybrid.model.config import ModelConfig
from hybrid.model.deepspeed_pipeline import build_pipeline_module
from hybrid.model.gpt import GPTModel
from hybrid.model.transformer import TransformerLayer
from hybrid.model.virtual_stages import PipelineRankModel
from hybrid.pipeline_plan import PipelineSchedule, plan_stages


def build_model(config: ModelConfig, groups, pipeline: PipelineSchedule = PipelineSchedule(),
                init_context: Optional[contextlib.AbstractContextManager] = None,
                pipeline_module_class: Optional[type] = None, compile_layers: bool = False) -> nn.Module:
    """The model of this rank over `groups`. `init_context`: entered while GPTModel is built (ZeRO-3's
    `deepspeed.zero.Init`, which partitions each parameter as its module is made);
    `pipeline_module_class`: DeepSpeed's PipelineModule or a subclass (hybrid.model.deepspeed_pipeline);
    `compile_layers`: --torch-compile."""
    pp = groups.pp.size
    if pipeline.on_torch(pp):
        model = build_rank_model(config, groups, pipeline)
    elif pipeline.on_deepspeed(pp):
        model = build_pipeline_module(config, groups, pipeline.partition, pipeline_module_class)
    else:
        with init_context or contextlib.nullcontext():
            model = GPTModel(config, groups)
    if compile_layers:
        compile_transformer_layers(model)
    return model


def build_rank_model(config: ModelConfig, groups, pipeline: PipelineSchedule) -> PipelineRankModel:
    """This pipeline rank's virtual stages (hybrid.pipeline_plan's stage plan)."""
    plans = plan_stages(config.num_layers, groups.pp.size, pipeline.virtual_stages, pipeline.schedule)
    config.validate(groups.tp_size)
    return PipelineRankModel(config, groups, plans, groups.pp.rank)


def compile_transformer_layers(model: nn.Module) -> int:
    """Regional compilation (as torchtitan): `torch.compile` on every TransformerLayer, not on the
    whole model, so the embedding, loss and DeepSpeed's hooks stay eager, identical layers share
    one compiled graph, and compile time does not grow with depth. Returns the layer count."""
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compile()
    return len(layers)
