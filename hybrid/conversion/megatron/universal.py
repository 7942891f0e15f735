"""A Megatron-LM checkpoint's weights and Adam state as a DeepSpeed universal checkpoint, which DeepSpeed's
own loader (`"checkpoint": {"load_universal": true}`) slices into its ZeRO-1/2/3 optimizers at any TP / PP /
DP (checkpoint_util.py --loader megatron --saver universal; launch/train.py --load MEGATRON_DIR, which
makes one beside --save, loads it and removes it).

Megatron keeps Adam's moments in megatron-core's model space (hybrid.conversion.megatron.optimizer.MegatronOptimizer),
so each parameter's full fp32 weight, exp_avg and exp_avg_sq come a layer at a time, under canonical
names, into DeepSpeed's per-parameter files (`zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`); the model-
states file carries the run's counters, its LR schedule's position (Megatron's scheduler counts samples,
as hybrid's) and the routers' score biases. The directory's layout is hybrid's universal one
(hybrid.conversion.ds_universal.normalize), so every load path of hybrid's own universal checkpoints applies.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import deepspeed
import torch
from deepspeed.checkpoint import constants as c

from hybrid.checkpoint.client_state import ClientState, SavedLayout, model_summary
from hybrid.checkpoint.files import (LATEST_UNIVERSAL, UNIVERSAL_SUFFIX, atomic_directory, model_file, tag_for,
                                     write_atomic)
from hybrid.conversion.ds_universal import UNIVERSAL_INFO, alias_model_files, normalize
from hybrid.conversion.megatron.args import megatron_run_args
from hybrid.conversion.megatron.lm import MegatronCheckpoint
from hybrid.conversion.megatron.optimizer import MOMENTS
from hybrid.model.naming import buffer_names
from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig


def write_universal(source: MegatronCheckpoint, config: ModelConfig, save_dir: str,
                    log: Callable[[str], None] = print, replace: bool = False,
                    clip_grad: Optional[float] = None) -> str:
    """`save_dir` (new, or replaced when `replace`) holding `<tag>_universal` and its `latest_universal`
    pointer; returns that tag. `clip_grad`: the gradient clipping a universal load sets in DeepSpeed's
    optimizer (default: the Megatron run's --clip-grad). Raises ConfigError when Megatron's optimizer
    state cannot be mapped."""
    optimizer = source.optimizer()
    if optimizer.problem:
        raise ConfigError(f"{source.directory}: Megatron's optimizer state is not mapped: {optimizer.problem}.")
    tag = tag_for(source.iteration) + UNIVERSAL_SUFFIX
    with atomic_directory(save_dir, replace=replace, flag="--save-dir") as tmp:
        directory = os.path.join(tmp, tag)
        zero = os.path.join(directory, "zero")
        os.makedirs(zero)
        kinds = {"fp32": optimizer.master or "model", **{m: m for m in MOMENTS}}
        written = 0
        for key, kind in kinds.items():  # one kind at a time: a layer's tensors of it, then the next layer
            for part in source.parts(config, kind=kind):
                for name, tensor in part.items():
                    os.makedirs(os.path.join(zero, name), exist_ok=True)
                    torch.save({c.PARAM: tensor.float()}, os.path.join(zero, name, f"{key}.pt"))
                    if key == "fp32":
                        torch.save(torch.tensor(float(optimizer.step)), os.path.join(zero, name, "step.pt"))
                        written += 1
        clip = float(getattr(source.args, "clip_grad", 1.0) if clip_grad is None else clip_grad)
        torch.save({"param_groups": _param_groups(config, optimizer.groups), "clip_grad": clip,
                    c.DS_VERSION: deepspeed.__version__}, os.path.join(zero, "optimizer_state.pt"))
        normalize(zero, config, {})
        _model_states(source, config, directory)
        alias_model_files(directory)
        with open(os.path.join(directory, UNIVERSAL_INFO), "w") as f:
            json.dump({"source": source.directory, "megatron_format": source.format, "iteration": source.iteration,
                       "tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 1}, f)
        write_atomic(os.path.join(tmp, LATEST_UNIVERSAL), tag)
    log(f"wrote the weights and Adam state of {written} parameters (step {optimizer.step}) of {source.directory} as "
        f"DeepSpeed's universal checkpoint {os.path.join(save_dir, tag)}")
    return tag


def _param_groups(config: ModelConfig, groups: tuple) -> list:
    """The optimizer's parameter groups as hybrid's engine orders them (weights with decay, then biases and
    norms; DeepSpeed appends the experts' group), with Megatron's hyperparameters, which a universal load
    copies into the running groups."""
    decayed, others = groups or ((0.0, (0.9, 0.999), 1e-8, 0.0),) * 2

    def group(values, index):
        lr, betas, eps, weight_decay = values
        return {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "params": [index]}
    out = [group(decayed, 0), group(others, 1)]
    if config.num_experts:
        out.append(group(decayed, 2))
    return out


def _model_states(source: MegatronCheckpoint, config: ModelConfig, directory: str) -> None:
    """The model-states file DeepSpeed's universal load reads its metadata from (weights come from zero/):
    hybrid's client state (iteration, consumed samples, the model), the LR schedule's position in samples,
    and the routers' score biases (buffers, which a universal load restores from `module`)."""
    biases = {}
    wanted = buffer_names(config)
    if wanted:
        for part in source.parts(config, wanted):
            biases.update(part)
    state = ClientState(iteration=source.iteration, consumed_samples=source.consumed_samples,
                        model=model_summary(config), layout=SavedLayout(), args=megatron_run_args(source.args))
    torch.save(dict(state.to_dict(), module=biases, lr_scheduler={"num_steps": source.consumed_samples,
                                                                  "unit": "samples"},
                    dp_world_size=1, mp_world_size=1, ds_version=deepspeed.__version__, global_steps=source.iteration,
                    skipped_steps=0, buffer_names=sorted(biases), optimizer=None),
               os.path.join(directory, model_file(0)))


def optimizer_problem(source: MegatronCheckpoint) -> Optional[str]:
    """Why the checkpoint's optimizer state cannot be loaded (None: it can)."""
    return source.optimizer().problem
