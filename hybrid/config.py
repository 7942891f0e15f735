"""Megatron-LM-named command-line flags -> typed configs, merged with the DeepSpeed JSON.

Flags are grouped by concern (one argparse group and one dataclass each). Every check runs in
`build_run_config`, once, before any model is built; a mistake raises ConfigError naming the
flag (and the DeepSpeed config key where both are involved) and the fix.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig


class FlagParser(argparse.ArgumentParser):
    """argparse whose errors are one line naming the flag (no usage dump), exit code 2."""

    def error(self, message):
        raise ConfigError(f"{message} (see --help for the flags launch/train.py accepts)")


def _add_model_args(p):
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "alibi"], help="learned_absolute | rope (alibi is refused)")
    g.add_argument("--use-rotary-position-embeddings", action="store_true", help="alias of --position-embedding-type rope")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--normalization", default="LayerNorm", type=_normalization, choices=["LayerNorm", "RMSNorm"],
                   help="LayerNorm | RMSNorm (any case, as Megatron-DeepSpeed scripts write rmsnorm)")
    g.add_argument("--layernorm-epsilon", "--norm-epsilon", dest="norm_epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--num-key-value-heads", type=int, default=None,
                   help="Megatron-DeepSpeed's spelling: --group-query-attention --num-query-groups N")
    g.add_argument("--kv-channels", type=int, default=None, help="accepted when equal to hidden/heads (head dim)")
    g.add_argument("--attention-backend", default=None, choices=["auto", "flash", "fused", "unfused", "local"],
                   help="flash = --use-flash-attn; auto/fused/unfused/local = SDPA (torch picks its kernel)")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--apply-query-key-layer-scaling", action="store_true")
    g.add_argument("--use-flash-attn", action="store_true")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default="uniform", choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--checkpoint-activations", action="store_true", help="alias: --recompute-granularity full")
    g.add_argument("--checkpoint-num-layers", type=int, default=None, help="alias of --recompute-num-layers")
    g.add_argument("--recompute-activations", action="store_true", help="alias: --recompute-granularity selective")
    g.add_argument("--activations-checkpoint-method", default=None, choices=["uniform", "block"],
                   help="older Megatron: --recompute-granularity full --recompute-method METHOD")


def _add_parallel_args(p):
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--pipeline-partition", "--pp-partition-method", dest="pipeline_partition", default="parameters",
                   help="parameters | uniform | comma-separated layers per stage (e.g. 3,5)")
    g.add_argument("--use-distributed-optimizer", action="store_true", help="ZeRO-1 when the DeepSpeed config sets no stage")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"])
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                   help="set by older launchers; the environment's LOCAL_RANK is used")


def _add_training_args(p):
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None, help="run length in samples (Megatron-LM)")
    g.add_argument("--train-tokens", type=int, default=None,
                   help="stop once this many tokens were consumed (Megatron-DeepSpeed)")
    g.add_argument("--rampup-batch-size", nargs=3, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="ramp the global batch linearly from START by INCREMENT over SAMPLES samples")
    g.add_argument("--exit-interval", type=int, default=None, help="stop after an iteration divisible by this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (with --save) and stop once the run has lasted this long")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale (fp16); dynamic if unset")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--freeze-layers", default=None, help="layer ranges to freeze, e.g. 0-5,8")
    g.add_argument("--freeze-embeddings", action="store_true")
    g.add_argument("--torch-compile", action="store_true",
                   help="compile each transformer layer with torch.compile (regional compilation); not with ZeRO-3")


def _add_optimizer_args(p):
    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", default=None, choices=["adam", "sgd"])
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear", choices=["constant", "linear", "cosine"])
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-decay-tokens", type=int, default=None, help="decay over tokens (Megatron-DeepSpeed)")
    g.add_argument("--lr-warmup-tokens", type=int, default=None, help="warm up over tokens (Megatron-DeepSpeed)")
    g.add_argument("--weight-decay", type=float, default=None)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=None)


def _add_data_args(p):
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None, help="prefix, or weight prefix weight prefix ...")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--tokenizer-type", default=None,
                   choices=["GPT2BPETokenizer", "HFTokenizer", "HuggingFaceTokenizer", "PretrainedFromHF",
                            "NullTokenizer", "GPTSentencePieceTokenizer", "SentencePieceTokenizer", "Llama2Tokenizer"])
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", "--tokenizer-name-or-path", dest="tokenizer_model", default=None,
                   help="a local HF tokenizer directory or a SentencePiece .model file")
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--dataloader-type", default="single", choices=["single", "cyclic"],
                   help="single: Megatron's sequential pretraining sampler (cyclic is refused)")
    g.add_argument("--data-impl", "--dataset-impl", dest="data_impl", default="mmap", choices=["mmap"])
    g.add_argument("--train-data-path", nargs="+", default=None, help="the train split's own blend (all its documents)")
    g.add_argument("--valid-data-path", nargs="+", default=None, help="the valid split's own blend")
    g.add_argument("--test-data-path", nargs="+", default=None, help="the test split's own blend")
    g.add_argument("--data-cache-path", default=None, help="directory for the sample-index cache (default: beside the data)")
    g.add_argument("--mmap-bin-files", dest="mmap_bin_files", action="store_true", default=True,
                   help="memory-map the .bin files (always done; accepted)")
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false",
                   help="accepted: the .bin files are memory-mapped either way, which reads the same tokens")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss at positions whose input token is EOD")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="accepted without --eod-mask-loss: every micro-batch has the same token count, so the "
                        "per-token mean is the mean of micro-batch means hybrid computes")
    g.add_argument("--reset-position-ids", action="store_true", help="refused: not supported")
    g.add_argument("--reset-attention-mask", action="store_true", help="refused: not supported")
    g.add_argument("--legacy-data-rules", action="store_true",
                   help="split rounding and blended sample counts of Megatron-DeepSpeed / Megatron-LM before "
                        "megatron-core (default: megatron-core's rules), to resume runs started there")


def _add_checkpoint_args(p):
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model architecture and parallel sizes from the --load checkpoint")
    g.add_argument("--no-save-optim", action="store_true", help="accepted; DeepSpeed always saves it")


def _add_logging_args(p):
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--log-json", default=None, help="rank 0 writes one JSON object per logged iteration")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None, help="where wandb writes its files")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="log allocated/peak accelerator memory with each log line")
    g.add_argument("--no-progress-bar", action="store_true")
    g.add_argument("--export-hf", default=None,
                   help="after training, export the final --save checkpoint to this HuggingFace directory")
    g.add_argument("--sample-prompt", default=None,
                   help="after --export-hf, print a short continuation of this text generated by transformers")
    g.add_argument("--no-demo", action="store_true",
                   help="on the embedded default corpus: do not save to runs/default, export or print a sample")


def _add_deepspeed_args(p):
    g = p.add_argument_group("deepspeed")
    g.add_argument("--deepspeed", nargs="?", const=True, default=None,
                   help="use DeepSpeed (always on); may be followed by the config path")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None)
    g.add_argument("--zero-stage", type=int, default=None, choices=[0, 1, 2, 3])
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce gradients in bf16 (DeepSpeed's communication_data_type); needs --bf16")


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(description="Train a GPT with Megatron-style parallelism on DeepSpeed.", allow_abbrev=False)
    for add in (_add_model_args, _add_parallel_args, _add_training_args, _add_optimizer_args, _add_data_args,
                _add_checkpoint_args, _add_logging_args, _add_deepspeed_args):
        add(p)
    from hybrid.megatron_compat import add_compat_args
    add_compat_args(p)
    return p


def _normalization(value: str) -> str:
    return {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(value.lower(), value)


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism, validated against the world size before any group is built."""

    world_size: int  # number of ranks in the job
    tensor_parallel: int = 1  # --tensor-model-parallel-size
    pipeline_parallel: int = 1  # --pipeline-model-parallel-size

    def __post_init__(self):
        for name, value in (("--tensor-model-parallel-size", self.tensor_parallel),
                            ("--pipeline-model-parallel-size", self.pipeline_parallel)):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}.")
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if self.world_size % model_parallel != 0:
            raise ConfigError(
                f"world size {self.world_size} is not a multiple of --tensor-model-parallel-size "
                f"({self.tensor_parallel}) x --pipeline-model-parallel-size ({self.pipeline_parallel}) "
                f"= {model_parallel}; launch a multiple of {model_parallel} ranks or change the sizes.")

    @property
    def data_parallel(self) -> int:
        """DP degree: what is left of the world after TP and PP."""
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel)


@dataclass
class TrainConfig:
    """Batching, schedule, optimizer, precision, data, checkpoints and logging of one run."""

    micro_batch_size: int  # --micro-batch-size: samples per micro-batch per DP rank
    global_batch_size: int  # --global-batch-size: samples per iteration over all DP ranks
    grad_acc_steps: int  # global / (micro x DP)
    train_iters: int  # --train-iters
    seq_length: int  # --seq-length
    lr: float  # --lr (peak)
    min_lr: float  # --min-lr
    lr_decay_style: str  # --lr-decay-style constant|linear|cosine
    lr_unit: str  # what the LR schedule counts: "samples" (Megatron-LM) or "tokens" (Megatron-DeepSpeed)
    lr_decay_steps: int  # decay length in lr_unit (--lr-decay-iters/-samples/-tokens; default the run)
    lr_warmup_steps: int  # warmup length in lr_unit (--lr-warmup-iters/-samples/-tokens/-fraction)
    weight_decay: float  # --weight-decay (not on biases and norm weights)
    clip_grad: float  # --clip-grad (0 disables)
    precision: str  # fp32 | bf16 | fp16
    seed: int  # --seed
    eval_interval: int  # --eval-interval
    eval_iters: int  # --eval-iters
    data_path: Optional[list]  # --data-path (None: --mock-data or the embedded default corpus)
    split: str  # --split
    mock_data: bool  # --mock-data
    save: Optional[str]  # --save
    load: Optional[str]  # --load
    save_interval: Optional[int]  # --save-interval
    finetune: bool  # --finetune
    no_load_optim: bool  # --no-load-optim
    no_load_rng: bool  # --no-load-rng
    log_interval: int  # --log-interval
    log_json: Optional[str]  # --log-json
    tensorboard_dir: Optional[str]  # --tensorboard-dir
    wandb_project: Optional[str]  # --wandb-project
    wandb_exp_name: Optional[str]  # --wandb-exp-name
    num_workers: int  # --num-workers (DataLoader processes)
    exit_interval: Optional[int]  # --exit-interval: stop (after saving) at an iteration divisible by it
    progress_bar: bool  # a progress bar when stdout is a terminal
    freeze_layers: list = field(default_factory=list)  # --freeze-layers, as layer numbers
    freeze_embeddings: bool = False  # --freeze-embeddings
    split_data_paths: tuple = (None, None, None)  # --train/--valid/--test-data-path (each split's own blend)
    data_cache_path: Optional[str] = None  # --data-cache-path: where sample indices are cached
    legacy_data_rules: bool = False  # --legacy-data-rules: Megatron-DeepSpeed split rounding and blend counts
    eod_mask_loss: bool = False  # --eod-mask-loss: positions whose input is EOD take no loss
    torch_compile: bool = False  # --torch-compile: each transformer layer compiled by torch.compile
    train_samples: int = 0  # samples the training split provides (--train-samples, or iterations x batch)
    train_tokens: Optional[int] = None  # --train-tokens: stop once this many tokens were consumed
    rampup: Optional[object] = None  # hybrid.run_length.Rampup for --rampup-batch-size
    exit_duration_in_mins: Optional[float] = None  # --exit-duration-in-mins: save and stop after this long
    wandb_save_dir: Optional[str] = None  # --wandb-save-dir
    export_hf: Optional[str] = None  # --export-hf: HF directory written from the final checkpoint
    sample_prompt: Optional[str] = None  # --sample-prompt: text continued by transformers from the export
    log_memory: bool = False  # --log-memory-to-tensorboard


@dataclass
class RunConfig:
    """Everything one training run needs, validated."""

    model: ModelConfig
    train: TrainConfig
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    pipeline_partition: str
    ds_config: dict
    tokenizer: dict  # build_tokenizer kwargs
    args: dict  # the parsed flags, saved in checkpoints

    @property
    def zero_stage(self) -> int:
        return int(self.ds_config.get("zero_optimization", {}).get("stage", 0))


def parse_layer_ranges(spec: Optional[str], num_layers: int) -> list[int]:
    """'0-5,8' -> [0, 1, 2, 3, 4, 5, 8], checked against --num-layers."""
    if not spec:
        return []
    layers = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            lo, hi = int(lo), int(hi) if hi else int(lo)
            layers.update(range(lo, hi + 1))
    except ValueError:
        raise ConfigError(f"--freeze-layers {spec!r}: expected ranges such as 0-5,8.") from None
    bad = [layer for layer in layers if not 0 <= layer < num_layers]
    if bad:
        raise ConfigError(f"--freeze-layers {spec!r}: layers {sorted(bad)} are outside 0..{num_layers - 1}.")
    return sorted(layers)


def _load_ds_config(args) -> tuple[dict, Optional[str]]:
    path = args.deepspeed_config
    if isinstance(args.deepspeed, str):
        if path and path != args.deepspeed:
            raise ConfigError(f"--deepspeed {args.deepspeed} and --deepspeed_config {path} name different files; give one.")
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


def _agree(ds: dict, key: str, flag: str, flag_value, ds_path: Optional[str], default=None, cast=float):
    """One value set on the command line and/or in the DeepSpeed config: they must agree."""
    config_value = ds.get(key)
    if isinstance(config_value, str) and config_value == "auto":
        config_value = None
    if config_value is not None and flag_value is not None and cast(config_value) != cast(flag_value):
        raise ConfigError(f"{flag} {flag_value} disagrees with \"{key}\": {config_value} in the DeepSpeed config "
                          f"{ds_path}; make them equal or drop one.")
    value = flag_value if flag_value is not None else config_value
    return default if value is None else value


def _precision(args, ds: dict, ds_path) -> str:
    ds_fp16 = bool(ds.get("fp16", {}).get("enabled", False))
    ds_bf16 = bool(ds.get("bf16", {}).get("enabled", False)) or bool(ds.get("bfloat16", {}).get("enabled", False))
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 are exclusive; pick one.")
    if (args.fp16 and ds_bf16) or (args.bf16 and ds_fp16):
        raise ConfigError(f"{'--fp16' if args.fp16 else '--bf16'} disagrees with the DeepSpeed config {ds_path}, "
                          f"which enables {'bf16' if ds_bf16 else 'fp16'}; make them agree.")
    precision = "fp16" if (args.fp16 or ds_fp16) else "bf16" if (args.bf16 or ds_bf16) else "fp32"
    if precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("--fp16 needs a GPU: DeepSpeed's CPU accelerator does not support fp16. "
                          "Use --bf16, or drop --fp16 to train in fp32.")
    return precision


def _optimizer_config(args, ds: dict, ds_path) -> dict:
    """The DeepSpeed "optimizer" section: the config's own, checked against the flags, or built
    from the flags (Megatron's Adam with decoupled weight decay)."""
    section = ds.get("optimizer")
    if section:
        params = section.get("params", {})
        lr = _agree(params, "lr", "--lr", args.lr, ds_path)
        wd = _agree(params, "weight_decay", "--weight-decay", args.weight_decay, ds_path, 0.01)
        if args.optimizer and args.optimizer.lower() not in section.get("type", "").lower():
            raise ConfigError(f"--optimizer {args.optimizer} disagrees with \"optimizer\": "
                              f"{section.get('type')} in {ds_path}.")
        return dict(section, params=dict(params, lr=lr, weight_decay=wd))
    lr = args.lr if args.lr is not None else 3e-4
    wd = args.weight_decay if args.weight_decay is not None else 0.01
    if (args.optimizer or "adam") == "sgd":
        return {"type": "SGD", "params": {"lr": lr, "momentum": args.sgd_momentum, "weight_decay": wd}}
    params = {"lr": lr, "betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_eps, "weight_decay": wd}
    offload = (ds.get("zero_optimization") or {}).get("offload_optimizer", {}).get("device", "none") != "none"
    if not offload:
        # torch's fused AdamW (CPU and CUDA kernels ship with torch) through DeepSpeed's torch_adam:
        # as fast as DeepSpeed's FusedAdam on GPUs and never a JIT build that can fail at start-up.
        # With optimizer offload DeepSpeed uses its CPU Adam. A config's own "optimizer" is kept.
        params.update(torch_adam=True, fused=True)
    return {"type": "AdamW", "params": params}


def _batch_sizes(args, ds, ds_path, dp):
    micro = _agree(ds, "train_micro_batch_size_per_gpu", "--micro-batch-size", args.micro_batch_size, ds_path,
                   None, int)
    global_batch = _agree(ds, "train_batch_size", "--global-batch-size", args.global_batch_size, ds_path, None, int)
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


def _zero_stage(args, ds, ds_path, pp) -> int:
    zero = ds.get("zero_optimization", {}) or {}
    stage = zero.get("stage")
    if args.zero_stage is not None:
        stage = _agree(zero, "stage", "--zero-stage", args.zero_stage, ds_path, None, int)
    if stage is None:
        stage = 1 if args.use_distributed_optimizer else 0
    stage = int(stage)
    if pp > 1 and stage >= 2:
        raise ConfigError(f"ZeRO stage {stage} (from {ds_path or '--zero-stage'}) with "
                          f"--pipeline-model-parallel-size {pp}: DeepSpeed's pipeline engine supports ZeRO-0/1 "
                          f"only. Use ds_configs/zero1.json (or zero1_offload.json) with pipeline parallelism, "
                          f"or set --pipeline-model-parallel-size 1 for ZeRO-2/3.")
    return stage


def _model_config(args, vocab_size: int, tp: int) -> ModelConfig:
    granularity = args.recompute_granularity or ("full" if args.checkpoint_activations else None)
    num_layers = args.recompute_num_layers or args.checkpoint_num_layers or 1
    if args.group_query_attention and not args.num_query_groups:
        raise ConfigError("--group-query-attention needs --num-query-groups N.")
    config = ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size, max_position_embeddings=args.max_position_embeddings or args.seq_length,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups if args.group_query_attention or args.num_query_groups else None,
        position_embedding_type="rope" if args.use_rotary_position_embeddings else args.position_embedding_type,
        rotary_base=args.rotary_base, normalization=args.normalization, norm_epsilon=args.norm_epsilon,
        swiglu=args.swiglu, add_bias_linear=not args.disable_bias_linear,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling, use_flash_attn=args.use_flash_attn,
        recompute_granularity=granularity, recompute_method=args.recompute_method,
        recompute_num_layers=num_layers, sequence_parallel=args.sequence_parallel and tp > 1, seed=args.seed)
    config.validate(tp)
    if config.position_embedding_type == "learned_absolute" and args.seq_length > config.max_position_embeddings:
        raise ConfigError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                          f"{config.max_position_embeddings}.")
    if args.sequence_parallel and args.seq_length % tp != 0:
        raise ConfigError(f"--sequence-parallel needs --seq-length {args.seq_length} divisible by "
                          f"--tensor-model-parallel-size {tp}.")
    return config


def tokenizer_kwargs(args) -> dict:
    """What build_tokenizer needs; with no data and no tokenizer flags, the embedded default."""
    tokenizer_type = args.tokenizer_type
    if tokenizer_type is None:
        if args.vocab_file or args.merge_file:
            tokenizer_type = "GPT2BPETokenizer"
        elif args.tokenizer_model:
            tokenizer_type = "GPTSentencePieceTokenizer" if args.tokenizer_model.endswith(".model") else "HFTokenizer"
        elif args.mock_data and args.vocab_size:
            tokenizer_type = "NullTokenizer"
        else:
            tokenizer_type = "GPT2BPETokenizer"
    vocab_file, merge_file = args.vocab_file, args.merge_file
    if tokenizer_type == "GPT2BPETokenizer" and not vocab_file and not merge_file:
        if args.data_path or args.train_data_path:
            raise ConfigError("--data-path needs its tokenizer: --vocab-file and --merge-file "
                              "(GPT2BPETokenizer), or --tokenizer-type HFTokenizer --tokenizer-model DIR.")
        from hybrid.data import default as default_data
        vocab_file, merge_file = str(default_data.VOCAB), str(default_data.MERGES)
    return dict(tokenizer_type=tokenizer_type, vocab_file=vocab_file, merge_file=merge_file,
                tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size)


def _check_data_flags(args) -> None:
    split_paths = [args.train_data_path, args.valid_data_path, args.test_data_path]
    if args.data_path and args.mock_data:
        raise ConfigError("--mock-data and --data-path are exclusive; give one.")
    if any(split_paths) and (args.data_path or args.mock_data):
        raise ConfigError("--train-data-path/--valid-data-path/--test-data-path give each split its own data; "
                          "drop --data-path (and --split) or --mock-data.")
    if any(split_paths) and not args.train_data_path:
        raise ConfigError("--valid-data-path/--test-data-path without --train-data-path: give the training data too.")
    for flag, value in (("--reset-position-ids", args.reset_position_ids),
                        ("--reset-attention-mask", args.reset_attention_mask)):
        if value:
            raise ConfigError(f"{flag} is not supported: samples are packed documents attending causally across "
                              f"EOD with continuous positions (Megatron's default). Drop {flag}; "
                              f"--eod-mask-loss is supported.")


DEMO_DIR = os.path.join("runs", "default")


def _demo_defaults(args) -> None:
    """The main job (no data flags: the embedded corpus) ends with something to show: a checkpoint
    in runs/default, its HuggingFace export and a sample generated from it (--no-demo: none)."""
    no_data = not (args.data_path or args.train_data_path or args.mock_data)
    if not no_data or args.no_demo:
        return
    args.save = args.save or DEMO_DIR
    args.export_hf = args.export_hf or os.path.join(args.save, "hf")
    args.sample_prompt = args.sample_prompt if args.sample_prompt is not None else "The Python"
    # long enough on 2 CPU cores (~3 minutes) for the sample to be recognisable text; flags win
    if args.train_iters is None and not (args.train_samples or args.train_tokens):
        args.train_iters = 600
    if args.micro_batch_size is None and args.global_batch_size is None:
        args.micro_batch_size = 8
    if args.lr is None:
        args.lr, args.min_lr = 1e-3, args.min_lr or 1e-4
        if not (args.lr_warmup_iters or args.lr_warmup_fraction or args.lr_warmup_samples):
            args.lr_warmup_iters = 30


def apply_megatron_aliases(args: argparse.Namespace) -> list[str]:
    """Other Megatron spellings of supported settings -> ours; refused flags raise. Returns the
    accepted compatibility flags (for the log)."""
    from hybrid.megatron_compat import check_compat
    accepted = check_compat(args)
    if args.num_key_value_heads:
        if args.num_query_groups and args.num_query_groups != args.num_key_value_heads:
            raise ConfigError(f"--num-key-value-heads {args.num_key_value_heads} disagrees with --num-query-groups "
                              f"{args.num_query_groups}; give one.")
        args.num_query_groups, args.group_query_attention = args.num_key_value_heads, True
    if args.recompute_activations and not args.recompute_granularity:
        args.recompute_granularity = "selective"  # Megatron-LM: --recompute-activations = selective
    if args.activations_checkpoint_method and not args.recompute_granularity:
        args.recompute_granularity, args.recompute_method = "full", args.activations_checkpoint_method
    if args.attention_backend == "flash":
        args.use_flash_attn = True
    if args.kv_channels and args.kv_channels * args.num_attention_heads != args.hidden_size:
        raise ConfigError(f"--kv-channels {args.kv_channels}: only the head dimension --hidden-size / "
                          f"--num-attention-heads = {args.hidden_size // args.num_attention_heads} is supported.")
    if args.position_embedding_type == "alibi":
        raise ConfigError("--position-embedding-type alibi is not supported: use learned_absolute or rope.")
    if args.dataloader_type != "single":
        raise ConfigError("--dataloader-type cyclic is not supported: samples are served in Megatron's "
                          "sequential pretraining order (--dataloader-type single).")
    if getattr(args, "compat_no_pipeline_parallel", None) and args.pipeline_model_parallel_size > 1:
        raise ConfigError("--no-pipeline-parallel with --pipeline-model-parallel-size > 1: drop one of them.")
    if args.calculate_per_token_loss and args.eod_mask_loss:
        raise ConfigError("--calculate-per-token-loss with --eod-mask-loss is not supported (micro-batches then "
                          "hold different token counts); drop one of them.")
    if args.grad_reduce_in_bf16 and not args.bf16:
        raise ConfigError("--grad-reduce-in-bf16 needs --bf16.")
    return accepted


# Megatron-LM's load_args_from_checkpoint: the architecture and parallel sizes a checkpoint fixes
_CHECKPOINT_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
                    "position_embedding_type", "use_rotary_position_embeddings", "rotary_base", "normalization",
                    "norm_epsilon", "swiglu", "group_query_attention", "num_query_groups", "disable_bias_linear",
                    "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by",
                    "apply_query_key_layer_scaling", "tensor_model_parallel_size", "pipeline_model_parallel_size")


def apply_checkpoint_args(args: argparse.Namespace) -> list[str]:
    """--use-checkpoint-args: the saved run's architecture and parallel sizes replace the flags'."""
    if not args.use_checkpoint_args:
        return []
    if not args.load:
        raise ConfigError("--use-checkpoint-args needs --load CHECKPOINT_DIR.")
    latest = os.path.join(args.load, "latest")
    if not os.path.isfile(latest):
        raise ConfigError(f"--use-checkpoint-args: no checkpoint in --load {args.load} (no 'latest' file).")
    from hybrid.training.checkpoint import latest_tag, read_meta
    saved = read_meta(args.load, latest_tag(args.load)).get("args") or {}
    changed = []
    for key in _CHECKPOINT_ARGS:
        if key in saved and getattr(args, key, None) != saved[key]:
            setattr(args, key, saved[key])
            changed.append(key)
    return changed


def build_run_config(args: argparse.Namespace, world_size: int, tokenizer_vocab_size: int) -> RunConfig:
    """Validate the flags against each other, the DeepSpeed config and the world size."""
    apply_checkpoint_args(args)
    apply_megatron_aliases(args)
    _demo_defaults(args)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ds, ds_path = _load_ds_config(args)
    stage = _zero_stage(args, ds, ds_path, pp)
    dp = ParallelDims(world_size, tp, pp).data_parallel
    vocab_size = tokenizer_vocab_size
    if args.vocab_size and args.tokenizer_type != "NullTokenizer" and args.vocab_size < tokenizer_vocab_size:
        raise ConfigError(f"--vocab-size {args.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer_vocab_size}); token ids would fall outside the embedding. Drop --vocab-size "
                          f"or use a matching tokenizer.")
    model = _model_config(args, vocab_size, tp)
    micro, global_batch, gas = _batch_sizes(args, ds, ds_path, dp)
    precision = _precision(args, ds, ds_path)
    if args.use_flash_attn:
        from hybrid.model.flash import check_flash_attn
        check_flash_attn(torch.cuda.is_available(), precision)
    clip = _agree(ds, "gradient_clipping", "--clip-grad", args.clip_grad, ds_path, 1.0)
    optimizer = _optimizer_config(args, ds, ds_path)
    from hybrid.run_length import resolve_run_length
    length = resolve_run_length(args, global_batch, micro * dp, args.seq_length)
    _check_data_flags(args)
    if args.finetune and not args.load:
        raise ConfigError("--finetune needs --load CHECKPOINT_DIR.")
    train = TrainConfig(
        micro_batch_size=micro, global_batch_size=global_batch, grad_acc_steps=gas, train_iters=length.train_iters,
        seq_length=args.seq_length, lr=float(optimizer["params"]["lr"]), min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style, lr_unit=length.lr_unit, lr_decay_steps=length.lr_decay_steps,
        lr_warmup_steps=length.lr_warmup_steps,
        weight_decay=float(optimizer["params"].get("weight_decay", 0.0)), clip_grad=float(clip),
        precision=precision, seed=args.seed, eval_interval=args.eval_interval, eval_iters=args.eval_iters,
        data_path=args.data_path, split=args.split, mock_data=args.mock_data, save=args.save, load=args.load,
        save_interval=args.save_interval, finetune=args.finetune, no_load_optim=args.no_load_optim,
        no_load_rng=args.no_load_rng, log_interval=max(1, args.log_interval), log_json=args.log_json,
        tensorboard_dir=args.tensorboard_dir, wandb_project=args.wandb_project, wandb_exp_name=args.wandb_exp_name,
        num_workers=args.num_workers, exit_interval=args.exit_interval, progress_bar=not args.no_progress_bar,
        freeze_layers=parse_layer_ranges(args.freeze_layers, args.num_layers),
        freeze_embeddings=args.freeze_embeddings,
        split_data_paths=(args.train_data_path, args.valid_data_path, args.test_data_path),
        data_cache_path=args.data_cache_path, legacy_data_rules=args.legacy_data_rules,
        eod_mask_loss=args.eod_mask_loss, torch_compile=args.torch_compile, train_samples=length.train_samples,
        train_tokens=length.train_tokens, rampup=length.rampup, exit_duration_in_mins=args.exit_duration_in_mins,
        wandb_save_dir=args.wandb_save_dir, log_memory=args.log_memory_to_tensorboard,
        export_hf=args.export_hf, sample_prompt=args.sample_prompt)
    if train.export_hf and not train.save:
        raise ConfigError("--export-hf needs --save (the checkpoint it exports).")
    if length.rampup and pp > 1:
        raise ConfigError("--rampup-batch-size with --pipeline-model-parallel-size > 1 is not supported (DeepSpeed's "
                          "pipeline engine fixes its micro-batch count); use a constant --global-batch-size.")
    if args.torch_compile and stage == 3:
        raise ConfigError("--torch-compile with ZeRO-3 is not supported: ZeRO-3 gathers each layer's "
                          "parameters in module hooks that torch.compile cannot trace. Use ZeRO-1/2 "
                          "(ds_configs/zero1.json, zero2.json) with --torch-compile, or drop --torch-compile.")
    ds_config = _final_ds_config(ds, args, train, stage, optimizer, model)
    return RunConfig(model=model, train=train, tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp,
                     pipeline_partition=args.pipeline_partition, ds_config=ds_config,
                     tokenizer=tokenizer_kwargs(args), args=dict(vars(args)))


def _final_ds_config(ds: dict, args, train: TrainConfig, stage: int, optimizer: dict, model: ModelConfig) -> dict:
    out = json.loads(json.dumps(ds))  # deep copy
    for key in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps"):
        out.pop(key, None)
    out.update(train_micro_batch_size_per_gpu=train.micro_batch_size, train_batch_size=train.global_batch_size,
               gradient_accumulation_steps=train.grad_acc_steps, gradient_clipping=train.clip_grad,
               optimizer=optimizer)
    out.setdefault("steps_per_print", 10**9)
    out.setdefault("wall_clock_breakdown", False)
    zero = dict(out.get("zero_optimization") or {})
    zero["stage"] = stage
    out["zero_optimization"] = zero
    out.pop("scheduler", None)  # the LR schedule comes from the Megatron flags (hybrid.training.schedules)
    if train.precision == "bf16":
        out["bf16"] = dict(out.get("bf16") or {}, enabled=True)
        out.pop("fp16", None)
        if args.grad_reduce_in_bf16:
            out["communication_data_type"] = "bf16"
    elif train.precision == "fp16":
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
    if model.sequence_parallel and args.pipeline_model_parallel_size > 1:
        from hybrid.model.gpt import pipeline_ds_config
        out.update(pipeline_ds_config(model))
    return out


def config_summary(run: RunConfig) -> dict:
    """A JSON-able record of the run's configuration (saved with checkpoints)."""
    model = asdict(run.model)
    model["params_dtype"] = str(model["params_dtype"])
    return {"model": model, "train": asdict(run.train), "tensor_parallel": run.tensor_parallel,
            "pipeline_parallel": run.pipeline_parallel, "data_parallel": run.data_parallel}
