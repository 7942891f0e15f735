"""Model + optimizer + schedule handed to `deepspeed.initialize`, with the layout's DeepSpeed grid as mpu."""

from __future__ import annotations

import dataclasses
import os
import re

import deepspeed
import torch
import torch.nn as nn
from deepspeed.accelerator import get_accelerator

from hybrid.config import RunConfig
from hybrid.conversion.hf import hf_parts
from hybrid.conversion.layout import load_parts
from hybrid.errors import ConfigError
from hybrid.model import build as model_build
from hybrid.model import lora
from hybrid.model.attention import backend_notes
from hybrid.model.mla import MultiLatentAttention
from hybrid.model.naming import canonical_buffers, canonical_parameters, weight_decayed
from hybrid.training import features
from hybrid.training.deepspeed_fixes import (install_fp32_clipping, keep_host_activations_when_offloading,
                                             prepare_pipeline_engine, register_moe_layers, skip_non_finite_steps,
                                             release_input_embedding_after_its_gradient, step_on_gradient_partitions,
                                             skip_one_rank_gradient_allreduce, use_async_checkpoint_engine,
                                             zero_partitions)
from hybrid.training.logging import log
from hybrid.training.lr_schedules import MegatronLRScheduler
from hybrid.training.muon import MuonWithAdamW, ShardedMuonWithAdamW



def build_model(run: RunConfig, groups) -> nn.Module:
    """This rank's model for the run's pipeline schedule (hybrid.model.build); under ZeRO-3 built inside
    `deepspeed.zero.Init`: each parameter is partitioned over its stage's DP x CP ranks as soon as its module
    exists, so no rank ever holds its whole stage (the point of ZeRO-3 for models larger than a rank); an untied
    vocabulary table is then parameters of a few rows each (RunConfig.model_form)."""
    zero3 = run.zero_stage == 3
    init = deepspeed.zero.Init(config_dict_or_path=run.ds_config, mpu=groups.mpu,
                               data_parallel_group=groups.mpu.get_data_parallel_group()) if zero3 else None
    return model_build.build_model(run.model_form, groups, run.pipeline, init_context=init,
                                   compile_layers=run.training.torch_compile)


def freeze(model: nn.Module, run: RunConfig) -> list[str]:
    """Apply --freeze-layers / --freeze-embeddings, and with --lora-rank freeze all but the adapters: no gradient,
    hence no optimizer state."""
    if run.model.lora_rank:
        lora.freeze_base(model, run.model)
    frozen = []
    layers = {f"layers.{i}." for i in run.training.freeze_layers}
    for name, param in canonical_parameters(model, run.model.num_layers).items():
        if any(name.startswith(prefix) for prefix in layers) or (
                run.training.freeze_embeddings and name.startswith("embedding.")):
            param.requires_grad_(False)
            frozen.append(name)
    return frozen


def param_groups(model: nn.Module, run: RunConfig) -> list[dict]:
    """Weight decay on weights only: biases and norm weights get none (Megatron-LM's rule)."""
    decay, no_decay = [], []
    for name, param in canonical_parameters(model, run.model.num_layers).items():
        if not param.requires_grad:
            continue
        (decay if weight_decayed(name) else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": run.optimizer.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if run.model.num_experts:  # DeepSpeed splits named groups into dense and expert ones (its MoE convention)
        for group, name in zip(groups, ("decay", "no_decay")):
            group["name"] = name
    return [g for g in groups if g["params"]]


def muon_optimizer(model: nn.Module, run: RunConfig, groups):
    """--optimizer muon: hybrid.training.muon's optimizer over param_groups' parameters (DeepSpeed's client
    optimizer); None otherwise (the DeepSpeed config's optimizer)."""
    m = run.optimizer.muon
    if m is None:
        return None
    kind = ShardedMuonWithAdamW if run.zero_stage > 0 else MuonWithAdamW  # ZeRO hands it flat partitions
    return kind(model, run.model, run.model.num_layers, param_groups(model, run), run.optimizer.lr,
                run.optimizer.weight_decay, m.betas, m.eps, m.momentum, m.nesterov, m.ns_steps, m.adjust_lr_fn,
                tp=groups.tp)


def units_per_step(global_batch: int, seq_length: int, unit: str) -> int:
    """How far one optimizer step moves the LR schedule: samples, or tokens."""
    return global_batch * (seq_length if unit == "tokens" else 1)


def build_engine(run: RunConfig, groups):
    """-> (DeepSpeed engine, the model it wraps). PP > 1 gives DeepSpeed's PipelineEngine."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(run.training.precision, torch.float32)
    for note in backend_notes(run.model, run.parallel.context_parallel, get_accelerator().device_name(), dtype):
        log(note)
    features.before_build(run, torch.device(get_accelerator().current_device_name()))  # MoE, FP8, profiling
    model = build_model(run, groups)
    register_moe_layers(model, groups, run.zero_stage)  # DeepSpeed's MoE handling (before initialize)
    freeze(model, run)
    training, optimizer = run.training, run.optimizer

    def scheduler(torch_optimizer):
        first_batch = training.rampup.start if training.rampup else training.global_batch_size
        return MegatronLRScheduler(torch_optimizer, optimizer.lr, optimizer.min_lr, optimizer.lr_warmup_steps,
                                   optimizer.lr_decay_steps, optimizer.lr_decay_style, optimizer.lr_unit,
                                   units_per_step(first_batch, training.seq_length, optimizer.lr_unit))

    if run.model.recompute_granularity:
        deepspeed.checkpointing.configure(groups.mpu, deepspeed_config=run.ds_config)
        if run.cpu_offloading:
            keep_host_activations_when_offloading()
    _sanitize_cuda_arch_list()
    if run.optimizer.muon is not None and run.zero_stage == 0:  # its own tensors are made where the weights will be
        model.to(get_accelerator().current_device_name())
    client = muon_optimizer(model, run, groups)
    try:
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=None if client else param_groups(model, run), optimizer=client,
            config=run.ds_config, mpu=groups.mpu, lr_scheduler=scheduler, dist_init_required=False)
    except (RuntimeError, ValueError, OSError, ImportError) as error:
        _raise_if_op_build_failed(error)
        raise
    if isinstance(client, ShardedMuonWithAdamW):
        client.attach(zero_partitions(engine.optimizer))
    features.after_engine(run, engine.module)  # what DeepSpeed's cast took to bf16/fp16 back in fp32
    log(f"optimizer: {describe_optimizer(engine)}")
    if run.zero_stage == 0:
        skip_one_rank_gradient_allreduce(engine)
    step_on_gradient_partitions(engine)
    if model.embedding is not None:
        release_input_embedding_after_its_gradient(engine, engine.module.embedding.word_embeddings)
    if run.zero_stage == 0 and training.precision == "fp32":
        install_fp32_clipping(engine, groups)
        if training.check_nan:
            skip_non_finite_steps(engine)
    if run.checkpoint.async_save:
        use_async_checkpoint_engine(engine)
    if run.parallel.pipeline_parallel > 1:
        prepare_pipeline_engine(engine, groups.mpu)
    if (run.zero_stage == 3 and run.model.tied_embeddings and model.embedding is not None
            and model.final_norm is not None):
        # The tied output head (PP = 1, or a V placement's last stage) reads the embedding table outside the
        # embedding's own forward.
        deepspeed.zero.register_external_parameter(engine.module, engine.module.embedding.word_embeddings.weight)
    if run.zero_stage == 3:  # MLA's decoding reads its up projection in its own forward (hybrid.model.kv_cache),
        for module in engine.module.modules():  # and DSA's indexer is called there by its methods (hybrid.model.dsa)
            if isinstance(module, MultiLatentAttention):
                deepspeed.zero.register_external_parameter(module, module.kv_up.weight)
                for param in (module.indexer.parameters() if module.indexer is not None else ()):
                    deepspeed.zero.register_external_parameter(module, param)
    return engine, model


def build_reference(run: RunConfig, groups, engine) -> nn.Module:
    """--dpo (and --grpo's KL): the frozen reference model, the --load-hf weights at this run's layout (PP = 1), in
    eval mode (no dropout) and the training precision, beside the engine (never partitioned: it has no optimizer); the
    DPO objective scores each micro-batch with it (hybrid.model.objectives.PreferencePairs). With LoRA, the engine's
    own model with its adapters off (hybrid.model.lora.BaseModel): no second model."""
    if run.model.lora_rank:
        log(f"--{'dpo' if run.training.dpo else 'grpo'} with LoRA: the reference is the model itself with its adapters "
            f"off (the base weights, {run.checkpoint.load_hf or 'as loaded'}); no second model")
        return lora.BaseModel(engine.module)
    config = dataclasses.replace(run.model, hidden_dropout=0.0, attention_dropout=0.0, recompute_granularity=None)
    reference = model_build.build_model(config, groups).eval()
    wanted = (set(canonical_parameters(reference, config.num_layers))
              | set(canonical_buffers(reference, config.num_layers)))
    load_parts(reference, hf_parts(run.checkpoint.load_hf, config, wanted), config, groups)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(run.training.precision, torch.float32)
    reference.requires_grad_(False)
    reference.to(torch.device(engine.device), dtype)
    if run.training.dpo:
        log(f"--dpo: the reference model is {run.checkpoint.load_hf}, frozen ({run.training.dpo.loss_type} loss, beta "
            f"{run.training.dpo.beta})")
    else:
        log(f"--grpo: the KL's reference model is {run.checkpoint.load_hf}, frozen (beta {run.training.grpo.beta})")
    return reference


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
    if hasattr(basic, "describe"):
        return basic.describe()
    name = type(basic).__name__
    defaults = getattr(basic, "defaults", {})
    if isinstance(basic, torch.optim.Optimizer) and type(basic).__module__.startswith("torch.optim"):
        kind = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "for-loop"
        name = f"torch.optim.{name} ({kind})"
    wrapper = type(engine.optimizer).__name__
    return name if engine.optimizer is basic else f"{name} inside DeepSpeed's {wrapper}"
