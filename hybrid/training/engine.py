"""Model + optimizer + schedule handed to `deepspeed.initialize`, with the topology's grid as mpu."""

from __future__ import annotations

import os
import re

import deepspeed
import torch
import torch.nn as nn

from hybrid.config import RunConfig
from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig
from hybrid.model.gpt import GPTModel, pipeline_layers
from hybrid.model.embedding import LMLoss
from hybrid.model.naming import canonical_parameters
from hybrid.model.transformer import TransformerLayer
from hybrid.pipeline_plan import resolve_partition
from hybrid.training.deepspeed_fixes import (ListPartitionPipelineModule, install_fp32_clipping, register_moe_layers,
                                            skip_non_finite_steps, skip_one_rank_gradient_allreduce,
                                            use_async_checkpoint_engine)
from hybrid.training.logging import log
from hybrid.training.schedules import MegatronLRScheduler

_NO_DECAY = re.compile(r"(^|\.)bias$|norm\.weight$|norm\.bias$")


def build_model(run: RunConfig, topology) -> nn.Module:
    """GPTModel (PP = 1), DeepSpeed's pipeline stages of this rank (PP > 1, 1F1B) or its virtual
    stages (the torch.distributed.pipelining schedules); with --torch-compile each
    transformer layer is compiled."""
    if run.pipeline_parallel == 1 and run.zero_stage == 3:
        # ZeRO-3: each parameter is partitioned over the DP group as soon as its module is built,
        # so no rank ever holds the whole model (the point of ZeRO-3 for models larger than a rank)
        with deepspeed.zero.Init(config_dict_or_path=run.ds_config, mpu=topology.mpu,
                                 data_parallel_group=topology.mpu.get_data_parallel_group()):
            model = GPTModel(run.model, topology.groups)
    elif run.pipeline_parallel == 1:
        model = GPTModel(run.model, topology.groups)
    elif run.virtual_pipeline:  # torch.distributed.pipelining runs this rank's virtual stages
        from hybrid.training.pipelining import build_rank_model
        model = build_rank_model(run.model, topology, run.pipeline_schedule, run.virtual_stages)
    else:
        model = build_pipeline_model(run.model, topology, run.pipeline_partition)
    if run.train.torch_compile:
        compile_layers(model)
    return model


def build_pipeline_model(config: ModelConfig, topology, partition_method: str = "parameters"):
    """The model as DeepSpeed pipeline stages over `topology` (PP > 1), run by its 1F1B schedule."""
    pp = topology.pp_world_size
    if pp < 2:
        raise ValueError("build_pipeline_model needs PP > 1; use GPTModel for PP = 1")
    if config.num_layers < pp:
        raise ConfigError(f"--pipeline-model-parallel-size {pp} is larger than --num-layers "
                          f"{config.num_layers}: every stage needs at least one layer.")
    config.validate(topology.tp_world_size)
    full_uniform = config.recompute_granularity == "full" and config.recompute_method == "uniform"
    module = ListPartitionPipelineModule(
        layers=pipeline_layers(config, topology.groups),
        loss_fn=LMLoss(topology.groups, config.vocab_size),
        topology=topology.ds_topology,
        partition_method=resolve_partition(partition_method, config.num_layers, pp),
        activation_checkpoint_interval=max(1, config.recompute_num_layers) if full_uniform else 0,
        checkpointable_layers=["TransformerLayer"],
    )
    if config.recompute_granularity == "full" and config.recompute_method == "block":
        stage_layers = [f for f in module.forward_funcs if isinstance(f, TransformerLayer)]
        for layer in stage_layers[: config.recompute_num_layers]:
            layer.recompute_whole = True
    return module


def compile_layers(model: nn.Module) -> int:
    """Regional compilation (as torchtitan): `torch.compile` on every TransformerLayer, not on the
    whole model, so the embedding, loss and DeepSpeed's hooks stay eager, identical layers share
    one compiled graph, and compile time does not grow with depth. Returns the layer count."""
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compile()
    return len(layers)


def freeze(model: nn.Module, run: RunConfig) -> list[str]:
    """Apply --freeze-layers / --freeze-embeddings: no gradient, hence no optimizer state."""
    frozen = []
    layers = {f"layers.{i}." for i in run.train.freeze_layers}
    for name, param in canonical_parameters(model, run.model.num_layers).items():
        if any(name.startswith(prefix) for prefix in layers) or (
                run.train.freeze_embeddings and name.startswith("embedding.")):
            param.requires_grad_(False)
            frozen.append(name)
    return frozen


def param_groups(model: nn.Module, run: RunConfig) -> list[dict]:
    """Weight decay on weights only: biases and norm weights get none (Megatron-LM's rule)."""
    decay, no_decay = [], []
    for name, param in canonical_parameters(model, run.model.num_layers).items():
        if not param.requires_grad:
            continue
        (no_decay if _NO_DECAY.search(name) else decay).append(param)
    groups = [{"params": decay, "weight_decay": run.train.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if run.model.num_experts:  # DeepSpeed splits named groups into dense and expert ones (its MoE convention)
        for group, name in zip(groups, ("decay", "no_decay")):
            group["name"] = name
    return [g for g in groups if g["params"]]


def units_per_step(global_batch: int, seq_length: int, unit: str) -> int:
    """How far one optimizer step moves the LR schedule: samples, or tokens."""
    return global_batch * (seq_length if unit == "tokens" else 1)


def build_engine(run: RunConfig, topology):
    """-> (DeepSpeed engine, the model it wraps). PP > 1 gives DeepSpeed's PipelineEngine."""
    model = build_model(run, topology)
    _check_experts_on_every_stage(model, run)
    register_moe_layers(model, topology, run.zero_stage)  # DeepSpeed's MoE handling (before initialize)
    freeze(model, run)
    train = run.train

    def scheduler(optimizer):
        first_batch = train.rampup.start if train.rampup else train.global_batch_size
        return MegatronLRScheduler(optimizer, train.lr, train.min_lr, train.lr_warmup_steps, train.lr_decay_steps,
                                   train.lr_decay_style, train.lr_unit,
                                   units_per_step(first_batch, train.seq_length, train.lr_unit))

    if run.model.recompute_granularity:
        deepspeed.checkpointing.configure(topology.mpu, deepspeed_config=run.ds_config)
    _sanitize_cuda_arch_list()
    try:
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, run), config=run.ds_config,
            # a PipelineModule brings its own grid
            mpu=None if run.deepspeed_pipeline else topology.mpu,
            lr_scheduler=scheduler, dist_init_required=False)
    except (RuntimeError, ValueError, OSError, ImportError) as error:
        _raise_if_op_build_failed(error)
        raise
    if run.model.num_experts:
        from hybrid.model.moe import keep_fp32_buffers
        keep_fp32_buffers(engine.module)  # DeepSpeed's bf16/fp16 cast took the score bias and counts along
    log(f"optimizer: {describe_optimizer(engine)}")
    if run.zero_stage == 0:
        skip_one_rank_gradient_allreduce(engine)
    if run.zero_stage == 0 and run.train.precision == "fp32":
        install_fp32_clipping(engine, topology)
        if run.train.check_nan:
            skip_non_finite_steps(engine)
    if run.train.async_save:
        use_async_checkpoint_engine(engine)
    if run.zero_stage == 3 and run.pipeline_parallel == 1 and run.model.tied_embeddings:
        # The tied output head reads the embedding table outside the embedding's own forward.
        deepspeed.zero.register_external_parameter(engine.module, engine.module.embedding.word_embeddings.weight)
    return engine, model


def _check_experts_on_every_stage(model: nn.Module, run: RunConfig) -> None:
    """With PP, every pipeline rank needs an MoE layer: DeepSpeed's ZeRO reduces the gradient norm of
    each parameter group over the pipeline, and a rank without experts has fewer groups (its reduction
    would wait forever). One all-reduce at start."""
    if not run.model.num_experts or run.pipeline_parallel == 1:
        return
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from hybrid.model.moe import MoELayer
    count = torch.tensor([float(sum(isinstance(m, MoELayer) for m in model.modules()))],
                         device=get_accelerator().current_device_name())
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    if count.item() == 0:
        raise ConfigError(f"--num-experts with --pipeline-model-parallel-size {run.pipeline_parallel}: a pipeline rank "
                          f"holds no MoE layer (--moe-layer-freq {run.model.moe_layer_freq!r} and this stage split); "
                          f"every pipeline rank needs at least one, as DeepSpeed reduces each optimizer group's "
                          f"gradient norm over the pipeline. Use --moe-layer-freq 1, or a --pipeline-partition giving "
                          f"each rank an MoE layer.")


def _sanitize_cuda_arch_list() -> None:
    """DeepSpeed 0.19.8's op builder parses TORCH_CUDA_ARCH_LIST entries as `major.minor` ints and
    dies on arch-specific entries such as `9.0a` (set by some CUDA images), before any JIT build
    starts. The `a` features are not used by its kernels: drop the suffix for this process."""
    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if value:
        cleaned = re.sub(r"(\d+\.\d+)[af]\b", r"\1", value)
        if cleaned != value:
            os.environ["TORCH_CUDA_ARCH_LIST"] = cleaned
            log(f"TORCH_CUDA_ARCH_LIST {value!r} -> {cleaned!r} for DeepSpeed's op builder")


def _raise_if_op_build_failed(error: BaseException) -> None:
    """A DeepSpeed kernel that failed to JIT-build is one clear message, not a compiler traceback."""
    text = f"{type(error).__name__}: {error}"
    markers = ("Error building extension", "ninja", "nvcc", "op_builder", "compute_capability", "CUDA_HOME",
               "invalid literal for int()")
    if any(m in text for m in markers):
        raise ConfigError(f"a DeepSpeed kernel failed to build ({text.splitlines()[0][:300]}). The optimizer named "
                          f"in the DeepSpeed config needs it: remove the config's \"optimizer\" section so "
                          f"torch's fused AdamW is used (no build), or add \"torch_adam\": true to its params; "
                          f"for a build, set CUDA_HOME and TORCH_CUDA_ARCH_LIST (e.g. 9.0) to match the GPU.") \
            from None


def describe_optimizer(engine) -> str:
    """Which Adam runs, for the log: torch fused/foreach/for-loop AdamW, DeepSpeed FusedAdam or CPU Adam."""
    basic = getattr(engine, "basic_optimizer", None) or engine.optimizer
    name = type(basic).__name__
    defaults = getattr(basic, "defaults", {})
    if isinstance(basic, torch.optim.Optimizer) and type(basic).__module__.startswith("torch.optim"):
        kind = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "for-loop"
        name = f"torch.optim.{name} ({kind})"
    wrapper = type(engine.optimizer).__name__
    return name if engine.optimizer is basic else f"{name} inside DeepSpeed's {wrapper}"
