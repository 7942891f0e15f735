"""The only places hybrid touches DeepSpeed internals, each for a stated reason and DeepSpeed version,
each covered by a test that fails if DeepSpeed changes (tests/test_universal_checkpoint.py)."""

from __future__ import annotations

import os

import torch


def use_canonical_param_names(engine, num_layers: int) -> None:
    """Universal checkpoints made here keep each parameter under its canonical name; DeepSpeed 0.19's
    ZeRO optimizers look a parameter's directory up as `optimizer.param_names[param]`, which the
    engine fills from `module.named_parameters()` (pipeline stages: `3.attention...`,
    `tied_modules.embed...`). Point those at the canonical names so any PP loads any PP."""
    from hybrid.model.gpt import canonical_parameters
    optimizer = engine.optimizer
    names = getattr(optimizer, "param_names", None)
    if not isinstance(names, dict):
        raise RuntimeError(f"DeepSpeed's {type(optimizer).__name__} has no param_names dict (DeepSpeed "
                           f"changed?); universal checkpoint loading cannot find its parameters.")
    canonical = {id(p): name for name, p in canonical_parameters(engine.module, num_layers).items()}
    optimizer.param_names = {param: canonical.get(id(param), name) for param, name in names.items()}


def repair_zero3_universal_load(engine, universal_dir: str) -> None:
    """Undo two bugs of DeepSpeed 0.19.8's ZeRO-3 universal load
    (`DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3`):
    1. one `step` tensor object is stored for every sub-group, so torch's Adam, which increments each
       group's step in place, advances it once per sub-group per iteration (wrong bias correction);
    2. the first parameter group's hyperparameters are copied into every group, so the no-decay
       group (biases, norms) gets the first group's weight decay.
    Each group gets its own step tensor and its own saved hyperparameters back."""
    inner = engine.optimizer.optimizer
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    saved = torch.load(os.path.join(universal_dir, "zero", "optimizer_state.pt"), map_location="cpu",
                       weights_only=False)["optimizer_state_dict"]["param_groups"]
    if len(saved) != len(inner.param_groups):
        raise RuntimeError(f"universal checkpoint {universal_dir} has {len(saved)} optimizer parameter groups, "
                           f"this run {len(inner.param_groups)}")
    for group, saved_group in zip(inner.param_groups, saved):
        group.update({key: value for key, value in saved_group.items() if key != "params"})
