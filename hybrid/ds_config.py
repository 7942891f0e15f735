"""The DeepSpeed JSON merged with Megatron's flags: where both set a value they must agree (one
message names the flag, the key and the file); what neither sets gets Megatron-LM's default; the
result is the config dict handed to deepspeed.initialize."""

from __future__ import annotations

import json
import math
import os
from typing import Optional

import torch

from hybrid.capabilities import Setup, check
from hybrid.errors import ConfigError


def load_ds_config(args) -> tuple[dict, Optional[str]]:
    """The DeepSpeed config named by --deepspeed PATH, --deepspeed_config or accelerate's environment."""
    path = args.deepspeed_config
    if isinstance(args.deepspeed, str):
        if path and path != args.deepspeed:
            raise ConfigError(f"--deepspeed {args.deepspeed} and --deepspeed_config {path} name different files; give "
                              f"one.")
        path = args.deepspeed
    if path is None:
        path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None
    if path is None:
        return {}, None
    if not os.path.isfile(path):
        raise ConfigError(f"--deepspeed_config {path}: no such file (see ds_configs/ for ready-made ones).")
    try:
        with open(path) as f:
            return json.load(f), path
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed_config {path}: not valid JSON ({e}).") from None


def agree(ds: dict, key: str, flag: str, flag_value, ds_path: Optional[str], default=None, cast=float):
    """One value set on the command line and/or in the DeepSpeed config: they must agree."""
    config_value = ds.get(key)
    if isinstance(config_value, str) and config_value == "auto":
        config_value = None
    if config_value is not None and flag_value is not None and cast(config_value) != cast(flag_value):
        raise ConfigError(f"{flag} {flag_value} disagrees with \"{key}\": {config_value} in the DeepSpeed config "
                          f"{ds_path}; make them equal or drop one.")
    value = flag_value if flag_value is not None else config_value
    return default if value is None else value


def precision_of(args, ds: dict, ds_path) -> str:
    """fp32 | bf16 | fp16 from --fp16/--bf16 and the config's sections (which must agree)."""
    ds_fp16, ds_bf16 = _enabled(ds, "fp16"), _enabled(ds, "bf16") or _enabled(ds, "bfloat16")
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 are exclusive; pick one.")
    if (args.fp16 and ds_bf16) or (args.bf16 and ds_fp16):
        raise ConfigError(f"{'--fp16' if args.fp16 else '--bf16'} disagrees with the DeepSpeed config {ds_path}, "
                          f"which enables {'bf16' if ds_bf16 else 'fp16'}; make them agree.")
    precision = "fp16" if (args.fp16 or ds_fp16) else "bf16" if (args.bf16 or ds_bf16) else "fp32"
    check(Setup(precision=precision, accelerator=accelerator_kind()), only=("fp16-cpu",))
    return precision


def _enabled(ds: dict, section: str) -> bool:
    """A precision section's "enabled" (transformers' "auto": as the flags say, so not by itself)."""
    value = (ds.get(section) or {}).get("enabled", False)
    return value != "auto" and bool(value)


def accelerator_kind() -> str:
    """"cuda" where a GPU is visible, else "cpu" (DeepSpeed picks its accelerator the same way)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def optimizer_config(args, ds: dict, ds_path) -> dict:
    """The DeepSpeed "optimizer" section: the config's own, checked against the flags, or built
    from the flags (Megatron's Adam with decoupled weight decay)."""
    section = ds.get("optimizer")
    if section:
        params = section.get("params", {})
        lr = agree(params, "lr", "--lr", args.lr, ds_path)
        wd = agree(params, "weight_decay", "--weight-decay", args.weight_decay, ds_path, 0.01)
        if args.optimizer and args.optimizer.lower() not in section.get("type", "").lower():
            raise ConfigError(f"--optimizer {args.optimizer} disagrees with \"optimizer\": "
                              f"{section.get('type')} in {ds_path}.")
        auto = {key: value for key, value in (("betas", [args.adam_beta1, args.adam_beta2]), ("eps", args.adam_eps))
                if params.get(key) == "auto"}  # transformers' "auto": the flags' values
        return dict(section, params=dict(params, lr=lr, weight_decay=wd, **auto))
    lr = args.lr if args.lr is not None else 3e-4
    wd = args.weight_decay if args.weight_decay is not None else 0.01
    if (args.optimizer or "adam") == "sgd":
        return {"type": "SGD", "params": {"lr": lr, "momentum": args.sgd_momentum, "weight_decay": wd}}
    params = {"lr": lr, "betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_eps, "weight_decay": wd}
    if not optimizer_offload(ds):
        # torch's fused AdamW (CPU and CUDA kernels ship with torch) through DeepSpeed's torch_adam:
        # as fast as DeepSpeed's FusedAdam on GPUs and never a JIT build that can fail at start-up.
        # With optimizer offload DeepSpeed uses its CPU Adam. A config's own "optimizer" is kept.
        params.update(torch_adam=True, fused=True)
    return {"type": "AdamW", "params": params}


def batch_sizes(args, ds, ds_path, dp):
    """(micro batch, global batch, gradient accumulation steps), consistent with the DP size."""
    micro = agree(ds, "train_micro_batch_size_per_gpu", "--micro-batch-size", args.micro_batch_size, ds_path,
                   None, int)
    global_batch = agree(ds, "train_batch_size", "--global-batch-size", args.global_batch_size, ds_path, None, int)
    gas_config = ds.get("gradient_accumulation_steps")
    gas_config = None if gas_config == "auto" else gas_config
    if micro is None:
        micro = 4 if global_batch is None else max(1, global_batch // (dp * (gas_config or 1)))
    if global_batch is None:
        global_batch = micro * dp * (gas_config or 1)
    micro, global_batch = int(micro), int(global_batch)
    if micro < 1 or global_batch < 1 or global_batch % (micro * dp) != 0:
        raise ConfigError(f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size {micro} x "
                          f"data-parallel size {dp} = {micro * dp}; change one of them.")
    gas = global_batch // (micro * dp)
    if gas_config is not None and int(gas_config) != gas:
        raise ConfigError(f"\"gradient_accumulation_steps\": {gas_config} in {ds_path} disagrees with "
                          f"--global-batch-size {global_batch} / (--micro-batch-size {micro} x DP {dp}) = {gas}.")
    return micro, global_batch, gas


def zero_stage(args, ds, ds_path, pp) -> int:
    """The ZeRO stage from the config, --zero-stage or --use-distributed-optimizer."""
    zero = ds.get("zero_optimization", {}) or {}
    stage = zero.get("stage")
    if args.zero_stage is not None:
        stage = agree(zero, "stage", "--zero-stage", args.zero_stage, ds_path, None, int)
    if stage is None:
        stage = 1 if args.use_distributed_optimizer else 0
    return int(stage)


def fp32_grad_accumulation(ds: dict) -> bool:
    """The config accumulates gradients in fp32 (data_types.grad_accum_dtype)."""
    return (ds.get("data_types") or {}).get("grad_accum_dtype") in ("fp32", "float32")


def optimizer_offload(ds: dict) -> bool:
    """Whether the config's zero_optimization.offload_optimizer puts the optimizer's step on another device."""
    return (ds.get("zero_optimization") or {}).get("offload_optimizer", {}).get("device", "none") != "none"


def cpu_offloading(args, ds: dict) -> bool:
    """--cpu-offloading, or the config's activation_checkpointing.cpu_checkpointing (the one switch)."""
    return bool(args.cpu_offloading or (ds.get("activation_checkpointing") or {}).get("cpu_checkpointing"))


def final_ds_config(ds: dict, args, run, stage: int, optimizer: dict) -> dict:
    """The config handed to deepspeed.initialize for `run` (hybrid.config.RunConfig, all but this):
    batch sizes, clipping, optimizer, ZeRO stage and precision as resolved (a DeepSpeed "scheduler" is
    dropped: the LR schedule is Megatron's)."""
    out = json.loads(json.dumps(ds))  # deep copy
    for key in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps"):
        out.pop(key, None)
    training = run.training
    # DeepSpeed's data-parallel world is DP x CP (hybrid.parallel.dims): its batch counts every CP rank
    out.update(train_micro_batch_size_per_gpu=training.micro_batch_size,
               train_batch_size=training.global_batch_size * run.parallel.sequence_split,
               gradient_accumulation_steps=training.grad_acc_steps, gradient_clipping=run.optimizer.clip_grad,
               optimizer=optimizer)
    if optimizer is None:  # a client optimizer (--optimizer muon), made for ZeRO's flat partitions
        del out["optimizer"]
        out["zero_allow_untested_optimizer"] = True
        out["zero_force_ds_cpu_optimizer"] = False  # with optimizer offload it steps the host partitions itself
    if run.parallel.pipeline_parallel > 1:
        out.update(pipeline_accumulation(training.micro_batch_size, run.parallel.dp_cp))
    out.setdefault("steps_per_print", 10**9)
    out.setdefault("wall_clock_breakdown", False)
    zero = dict(out.get("zero_optimization") or {})
    zero["stage"] = stage
    out["zero_optimization"] = resolve_auto_buckets(zero, run.model.hidden_size)
    for section in ("fp16", "bf16", "bfloat16"):  # "auto": the precision resolved below
        if (out.get(section) or {}).get("enabled") == "auto":
            out[section] = dict(out[section], enabled=False)
    if run.checkpoint.universal_checkpoint or run.start.loader == "universal":  # DeepSpeed's switch for loading
        # universal checkpoints (a Megatron-LM or pipeline-engine checkpoint's optimizer is loaded as one)
        out["checkpoint"] = dict(out.get("checkpoint") or {}, load_universal=True)
    if cpu_offloading(args, ds):  # deepspeed.checkpointing.configure reads it (hybrid.training.engine)
        out["activation_checkpointing"] = dict(out.get("activation_checkpointing") or {}, cpu_checkpointing=True)
    out.pop("scheduler", None)  # the LR schedule comes from the Megatron flags (hybrid.training.lr_schedules)
    if training.precision == "bf16":
        out["bf16"] = dict(out.get("bf16") or {}, enabled=True)
        out.pop("fp16", None)
        if args.grad_reduce_in_bf16:
            out["communication_data_type"] = "bf16"
    elif training.precision == "fp16":
        fp16 = dict(out.get("fp16") or {}, enabled=True)
        if args.loss_scale is not None:
            fp16["loss_scale"] = args.loss_scale
        fp16.setdefault("loss_scale", 0)
        fp16.setdefault("initial_scale_power", int(math.log2(args.initial_loss_scale)))
        fp16.setdefault("loss_scale_window", args.loss_scale_window)
        fp16.setdefault("hysteresis", args.hysteresis)
        fp16.setdefault("min_loss_scale", args.min_loss_scale)
        out["fp16"] = fp16
        out.pop("bf16", None)
    else:
        for key in ("fp16", "bf16", "bfloat16"):
            out.pop(key, None)
    return out


def pipeline_accumulation(micro_batch: int, dp_cp: int) -> dict:
    """PP > 1: the pipeline schedule owns gradient accumulation (hybrid.training.runtime). DeepSpeed's
    caller-owned mode (`managed_gradient_accumulation: false`) makes every backward a non-boundary one and
    `engine.step()` the boundary, and one accumulation step per engine step keeps DeepSpeed from scaling the
    gradients that torch's schedule sends between stages (the runtime divides each micro-batch's loss by
    their number itself)."""
    return {"gradient_accumulation_steps": 1, "train_batch_size": micro_batch * dp_cp,
            "managed_gradient_accumulation": False}


# zero_optimization keys that transformers' DeepSpeed integration fills from the model's hidden size when "auto"
# (HfTrainerDeepSpeedConfig.trainer_config_finalize), as functions of it
AUTO_BUCKETS = {"reduce_bucket_size": lambda h: h * h, "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
                "stage3_param_persistence_threshold": lambda h: 10 * h}
DEFAULT_REDUCE_BUCKET = 500_000_000  # DeepSpeed's zero_optimization.reduce_bucket_size (elements)


def resolve_auto_buckets(zero: dict, hidden_size: int) -> dict:
    """A zero_optimization section with transformers' "auto" values resolved as its integration resolves them."""
    return {key: AUTO_BUCKETS[key](hidden_size) if value == "auto" and key in AUTO_BUCKETS else value
            for key, value in zero.items()}


def default_bucket_warning(ds: dict, stage: int, precision: str, ds_path: Optional[str]) -> Optional[str]:
    """ZeRO-3 with no reduce_bucket_size in the config takes DeepSpeed's 5e8 elements, allocated whole at start: the
    memory it costs and the fix, or None."""
    if stage != 3 or "reduce_bucket_size" in (ds.get("zero_optimization") or {}):
        return None
    size = DEFAULT_REDUCE_BUCKET * (2 if precision in ("bf16", "fp16") else 4)
    return (f"WARNING: {ds_path or 'the DeepSpeed config'} sets no zero_optimization.reduce_bucket_size, so ZeRO-3 "
            f"takes DeepSpeed's default of {DEFAULT_REDUCE_BUCKET:.0e} elements, a {size / 1e9:.0f} GB {precision} "
            f"bucket on every rank; set it (\"auto\" is the hidden size squared, as transformers resolves it; "
            f"ds_configs/zero3.json sets \"auto\")")
