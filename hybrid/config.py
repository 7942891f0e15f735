"""Parsed flags -> the typed configuration of one run (`RunConfig`), split by concern as torchtitan's
job config: the model (hybrid.model.config.ModelConfig), the parallel sizes (hybrid.parallel.dims.
ParallelDims) and pipeline schedule (hybrid.pipeline_plan.PipelineSchedule), training, optimizer,
data, checkpoint and logging settings.

Every check runs in `build_run_config`, once, before any model is built or process group made;
a mistake raises ConfigError naming the flag (and the DeepSpeed config key where both are
involved) and the fix. The flags themselves are in hybrid.flags, the merge with the DeepSpeed
JSON in hybrid.ds_config, the architecture in hybrid.architecture, the refused combinations in
hybrid.capabilities.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

from hybrid import ds_config as dsc
from hybrid.architecture import DSA_FLAGS, LINEAR_ATTENTION_FLAGS, MLA_FLAGS, MOE_FLAGS, fp8_recipe, model_config
from hybrid.capabilities import Setup, check
from hybrid.checkpoint.client_state import SavedLayout
from hybrid.data import default as default_data
from hybrid.data.chat.options import ChatOptions
from hybrid.data.plan import data_files
from hybrid.distributed import log
from hybrid.errors import ConfigError
from hybrid.megatron_compat import check_compat
from hybrid.model.config import ModelConfig
from hybrid.model.grpo import GRPOOptions
from hybrid.model.preference import DPOOptions
from hybrid.parallel.dims import ParallelDims
from hybrid.memory import partition_layers
from hybrid.objective_flags import GRPO_DEFAULTS, grpo_flags, grpo_options, sft_flags
from hybrid.pipeline_plan import PipelineSchedule, plan_stages, resolve_virtual_stages
from hybrid.run_length import RunLength, resolve_run_length
from hybrid.training.start import StartPlan, plan_start, with_bridge


@dataclass
class TrainingConfig:
    """Batching, length, precision and the per-iteration options of the training loop."""

    micro_batch_size: int  # --micro-batch-size: samples per micro-batch per DP rank
    global_batch_size: int  # --global-batch-size: samples per iteration over all DP ranks
    grad_acc_steps: int  # global / (micro x DP)
    train_iters: int  # --train-iters (or from --train-samples / --train-tokens)
    seq_length: int  # --seq-length
    precision: str  # fp32 | bf16 | fp16
    seed: int  # --seed
    eval_interval: int  # --eval-interval
    eval_iters: int  # --eval-iters
    train_samples: int = 0  # samples the training split provides (--train-samples, or iterations x batch)
    train_tokens: Optional[int] = None  # --train-tokens: stop once this many tokens were consumed
    rampup: Optional[object] = None  # hybrid.run_length.Rampup for --rampup-batch-size
    exit_interval: Optional[int] = None  # --exit-interval: stop (after saving) at an iteration divisible by it
    exit_duration_in_mins: Optional[float] = None  # --exit-duration-in-mins: save and stop after this long
    torch_compile: bool = False  # --torch-compile: each transformer layer compiled by torch.compile
    per_token_loss: bool = False  # --calculate-per-token-loss: the iteration's loss is its valid tokens' mean
    check_nan: bool = True  # --check-for-nan-in-loss-and-grad: stop at the first non-finite loss or grad norm
    freeze_layers: list = field(default_factory=list)  # --freeze-layers, as layer numbers
    freeze_embeddings: bool = False  # --freeze-embeddings
    dpo: Optional[DPOOptions] = None  # --dpo: the preference loss's options (hybrid.model.preference)
    grpo: Optional[GRPOOptions] = None  # --grpo: the policy loss's and the sampler's options (hybrid.model.grpo)


@dataclass
class OptimizerConfig:
    """AdamW's settings and the LR schedule (the optimizer itself is DeepSpeed's config's, hybrid.ds_config)."""

    lr: float  # --lr (peak)
    min_lr: float  # --min-lr
    lr_decay_style: str  # --lr-decay-style constant|linear|cosine
    lr_unit: str  # what the LR schedule counts: "samples" (Megatron-LM) or "tokens" (Megatron-DeepSpeed)
    lr_decay_steps: int  # decay length in lr_unit (--lr-decay-iters/-samples/-tokens; default the run)
    lr_warmup_steps: int  # warmup length in lr_unit (--lr-warmup-iters/-samples/-tokens/-fraction)
    weight_decay: float  # --weight-decay (not on biases and norm weights)
    clip_grad: float  # --clip-grad (0 disables)
    muon: Optional["MuonOptions"] = None  # --optimizer muon (hybrid.training.muon); None: the DeepSpeed config's


@dataclass(frozen=True)
class MuonOptions:
    """--optimizer muon: torch.optim.Muon's settings (the --muon-* flags) and its AdamW's (--adam-*)."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr_fn: str = "original"
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8


@dataclass
class DataConfig:
    """Where samples come from and how they are served."""

    data_path: Optional[list]  # --data-path (None: --mock-data, the split paths or the embedded default corpus)
    split: str  # --split
    mock_data: bool = False  # --mock-data
    split_data_paths: tuple = (None, None, None)  # --train/--valid/--test-data-path (each split's own blend)
    data_cache_path: Optional[str] = None  # --data-cache-path: where sample indices are cached
    legacy_data_rules: bool = False  # --legacy-data-rules: Megatron-DeepSpeed split rounding and blend counts
    eod_mask_loss: bool = False  # --eod-mask-loss: positions whose input is EOD take no loss
    num_workers: int = 2  # --num-workers (DataLoader processes)
    chat: Optional[ChatOptions] = None  # --sft: --data-path holds conversations (hybrid.data.chat), these options


@dataclass
class CheckpointConfig:
    """Where the run starts from and what it leaves."""

    save: Optional[str] = None  # --save
    load: Optional[str] = None  # --load
    save_interval: Optional[int] = None  # --save-interval
    finetune: bool = False  # --finetune: weights of --load from any layout, a fresh schedule
    no_load_optim: bool = False  # --no-load-optim
    no_load_rng: bool = False  # --no-load-rng
    no_save_rng: bool = False  # --no-save-rng: checkpoints hold no RNG states
    universal_checkpoint: bool = False  # --universal-checkpoint: --load a universal checkpoint, any layout
    load_hf: Optional[str] = None  # --load-hf: the HF model directory the run starts from (when --load has none)
    async_save: bool = False  # --async-save: checkpoints written in the background from a host copy
    export_hf: Optional[str] = None  # --export-hf: HF directory written from the final checkpoint
    sample_prompt: Optional[str] = None  # --sample-prompt: text continued by transformers from the export


@dataclass
class LoggingConfig:
    """What the run reports, and where."""

    log_interval: int = 100  # --log-interval
    log_json: Optional[str] = None  # --log-json
    tensorboard_dir: Optional[str] = None  # --tensorboard-dir
    wandb_project: Optional[str] = None  # --wandb-project
    wandb_exp_name: Optional[str] = None  # --wandb-exp-name
    wandb_save_dir: Optional[str] = None  # --wandb-save-dir
    progress_bar: bool = True  # a progress bar when stdout is a terminal
    log_memory: bool = False  # --log-memory-to-tensorboard
    peak_tflops: Optional[float] = None  # --peak-tflops: the MFU's denominator (None: the GPU's from a table)
    profile: Optional["ProfileConfig"] = None  # --profile / --record-memory-history: what to record, and where


@dataclass
class ProfileConfig:
    """--profile and --record-memory-history (Megatron-LM's flags)."""

    steps: tuple = (10, 12)  # --profile-step-start, --profile-step-end: iterations [start, end)
    ranks: tuple = (0,)  # --profile-ranks
    directory: str = "profile"  # --profile-dir (or where it defaults to)
    trace: bool = False  # --profile: torch.profiler traces
    memory_snapshot: Optional[str] = None  # --record-memory-history: the snapshot file


@dataclass
class RunConfig:
    """Everything one training run needs, validated."""

    model: ModelConfig
    parallel: ParallelDims
    pipeline: PipelineSchedule
    training: TrainingConfig
    optimizer: OptimizerConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    ds_config: dict  # what deepspeed.initialize gets
    args: dict  # the parsed flags, saved in checkpoints
    start: StartPlan = field(default_factory=StartPlan)  # where it starts (hybrid.training.start), decided once

    @property
    def pipelined(self) -> bool:
        """Pipeline stages run by a torch.distributed.pipelining schedule (PP > 1)."""
        return self.parallel.pipeline_parallel > 1

    @property
    def zero_stage(self) -> int:
        return int(self.ds_config.get("zero_optimization", {}).get("stage", 0))

    @property
    def model_form(self) -> ModelConfig:
        """The model as the engine builds it: `model`, with under ZeRO-3 its untied vocabulary tables in row blocks
        (ModelConfig.zero3_vocab_block_rows; a plain resume: as its checkpoint held them, 0: whole, as every
        checkpoint before the blocks, so DeepSpeed's own load finds its names). Checkpoints record `model` and, in
        their layout, the blocks' rows."""
        if self.zero_stage != 3:
            return self.model
        rows = self.start.vocab_block_rows
        if rows is None:
            rows = self.model.zero3_vocab_block_rows(self.parallel.tensor_parallel)
        return dataclasses.replace(self.model, vocab_block_rows=rows)

    @property
    def cpu_offloading(self) -> bool:
        """--cpu-offloading (or the config's activation_checkpointing.cpu_checkpointing)."""
        return bool((self.ds_config.get("activation_checkpointing") or {}).get("cpu_checkpointing"))

    def saved_layout(self) -> SavedLayout:
        """The layout this run's checkpoints record (and a plain load compares, field by field)."""
        p = self.parallel
        return SavedLayout(tensor_parallel=p.tensor_parallel, pipeline_parallel=p.pipeline_parallel,
                           data_parallel=p.data_parallel, context_parallel=p.context_parallel, ulysses=p.ulysses,
                           expert_parallel=p.expert_parallel, pipeline_schedule=self.pipeline.schedule,
                           virtual_stages=self.pipeline.virtual_stages, zero_stage=self.zero_stage,
                           stage_files="stages" if p.pipeline_parallel > 1 else "",
                           stage_layers=tuple(self.pipeline.stage_layers or ()),
                           vocab_block_rows=self.model_form.vocab_block_rows)


def config_summary(run: RunConfig) -> dict:
    """A JSON-able record of the run's configuration (logged to TensorBoard / wandb, saved with checkpoints)."""
    return {"model": asdict(run.model), "parallel": asdict(run.parallel), "pipeline": asdict(run.pipeline),
            "training": asdict(run.training), "optimizer": asdict(run.optimizer), "data": asdict(run.data),
            "checkpoint": asdict(run.checkpoint), "logging": asdict(run.logging), "zero_stage": run.zero_stage}


def checkpoint_summary(run: RunConfig) -> dict:
    """The run's summary as a checkpoint records it: config_summary's sections and the data files' sizes (what a
    resume compares its data plan with: hybrid.data.plan)."""
    return dict(config_summary(run), data_files=data_files(run.data))


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
        vocab_file, merge_file = str(default_data.VOCAB), str(default_data.MERGES)
    return dict(tokenizer_type=tokenizer_type, vocab_file=vocab_file, merge_file=merge_file,
                tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size)


def _check_cp_comm_type(args) -> None:
    """--cp-comm-type: the K/V ring (p2p) is the context-parallel communication built."""
    unknown = [kind for kind in args.cp_comm_type if kind != "p2p"]
    if unknown:
        raise ConfigError(f"--cp-comm-type {' '.join(unknown)} is not supported: the K/V ring (p2p) is the "
                          f"context-parallel communication built; use --cp-comm-type p2p.")


def _experts_on_every_stage(model: ModelConfig, dims: ParallelDims, pipeline: PipelineSchedule) -> Optional[bool]:
    """Whether every pipeline rank holds an MoE layer (the stage plan); None without a pipeline of MoE layers."""
    pp = dims.pipeline_parallel
    if not model.num_experts or pp == 1:
        return None
    moe = set(model.moe_layers)
    plans = plan_stages(model.num_layers, pp, pipeline.virtual_stages, pipeline.schedule, pipeline.stage_layers)
    return all(any(moe & set(p.layers) for p in plans if p.rank == rank) for rank in range(pp))


def _sharing_split(model: ModelConfig, dims: ParallelDims, pipeline: PipelineSchedule, source_of) -> Optional[bool]:
    """Whether the stage plan puts a layer that reads what another computed in the same pass (GLM-5's DSA choice:
    `model.dsa_source`; Gemma 4's keys and values: `model.kv_source`) in another virtual stage than its source; None
    without a pipeline of such layers."""
    if dims.pipeline_parallel == 1 or all(source_of(i) is None for i in range(model.num_layers)):
        return None
    try:
        plans = plan_stages(model.num_layers, dims.pipeline_parallel, pipeline.virtual_stages, pipeline.schedule,
                            pipeline.stage_layers)
    except ConfigError:  # (a split the plan refuses: its own message comes after the table's rules)
        return None
    return any(source_of(i) is not None and source_of(i) not in p.layers for p in plans for i in p.layers)


def _check_data_flags(args) -> None:
    split_paths = [args.train_data_path, args.valid_data_path, args.test_data_path]
    if args.data_path and args.mock_data:
        raise ConfigError("--mock-data and --data-path are exclusive; give one.")
    if any(split_paths) and (args.data_path or args.mock_data):
        raise ConfigError("--train-data-path/--valid-data-path/--test-data-path give each split its own data; "
                          "drop --data-path (and --split) or --mock-data.")
    if any(split_paths) and not args.train_data_path:
        raise ConfigError("--valid-data-path/--test-data-path without --train-data-path: give the training data too.")


DEMO_DIR = os.path.join("runs", "default")


def _demo_defaults(args) -> None:
    """The main job (no data flags: the embedded corpus) ends with something to show: a checkpoint
    in runs/default, its HuggingFace export and a sample generated from it (--no-demo: none)."""
    no_data = not (args.data_path or args.train_data_path or args.mock_data
                   or getattr(args, "grpo_reasoning_gym", None))  # (reasoning_gym's tasks are data)
    if not no_data or args.no_demo:
        return
    if args.grpo:  # the embedded arithmetic task: the reward's curve over a short run
        if args.lr is None:  # a model from scratch climbs the digits reward within 10 iterations at this rate
            args.lr, args.min_lr = 2e-2, args.min_lr or 2e-3
        vars(args).update(_demo_run(args, GRPO_DEMO_DIR, "Question: 12 + 7 = ?  Answer:", iterations=30, warmup=0))
        if args.global_batch_size is None:
            args.global_batch_size = 4 * args.grpo_group_size
        if args.max_new_tokens == GRPO_DEFAULTS["max_new_tokens"]:
            args.max_new_tokens = 8
        if args.log_interval == 10:  # the parser's default: a point of the curve per iteration
            args.log_interval = 1
        return
    # long enough on 2 CPU cores (~3 minutes) for the sample to be recognisable text; flags win
    vars(args).update(_demo_run(args, DEMO_DIR, "The Python", iterations=600, warmup=30))


def _demo_run(args, save: str, prompt: str, iterations: int, warmup: int) -> dict:
    """A demo's defaults where the flags leave them open: where it saves and exports, the sample's prompt,
    its length, micro batch 8 and the learning rate."""
    out = {"save": args.save or save}
    out["export_hf"] = args.export_hf or os.path.join(out["save"], "hf")
    out["sample_prompt"] = args.sample_prompt if args.sample_prompt is not None else prompt
    if args.train_iters is None and not (args.train_samples or args.train_tokens):
        out["train_iters"] = iterations
    if args.micro_batch_size is None and args.global_batch_size is None:
        out["micro_batch_size"] = 8
    if args.lr is None:
        out["lr"], out["min_lr"] = 1e-3, args.min_lr or 1e-4
        if not (args.lr_warmup_iters or args.lr_warmup_fraction or args.lr_warmup_samples):
            out["lr_warmup_iters"] = warmup
    return out


def with_flags(args: argparse.Namespace, **decided) -> argparse.Namespace:
    """The flags with values decided after parsing (--load-hf's tokenizer, a Megatron checkpoint's MoE training,
    the SFT tutorial's defaults, --train-epochs' samples): a new namespace each time; the parsed one is never
    written, so no module learns a decision by reading it back from the flags."""
    return argparse.Namespace(**{**vars(args), **decided})


SFT_DEMO_DIR = os.path.join("runs", "sft")
GRPO_DEMO_DIR = os.path.join("runs", "grpo")
SFT_SAMPLE_PROMPT = "What is the `json` module for?"


def sft_tutorial_defaults(args) -> dict:
    """`--sft` with no data flags: the embedded chat set (conversations about Python from its documentation)
    with the embedded tokenizer's ChatML version, ending, as the main job does, in runs/sft with a
    HuggingFace export (tokenizer and chat template included) and an answer to a chat prompt (--no-demo: none).
    Decided before the tokenizer is chosen, which it sets; the flags it decides (with_flags)."""
    if not args.sft or args.data_path or args.train_data_path or args.mock_data:
        return {}
    out = {"data_path": [str(default_data.CHAT)],
           "data_cache_path": args.data_cache_path or str(default_data.cache_dir())}  # not inside the package
    if not (args.load_hf or args.tokenizer_type or args.tokenizer_model or args.vocab_file):
        out.update(tokenizer_type="HFTokenizer", tokenizer_model=default_data.default_chat_tokenizer())
    if args.no_demo:
        return out
    return {**out, **_demo_run(args, SFT_DEMO_DIR, SFT_SAMPLE_PROMPT, iterations=300, warmup=20)}


def apply_megatron_aliases(args: argparse.Namespace) -> list[str]:
    """Other Megatron spellings of supported settings -> ours; refused flags raise. Returns the
    accepted compatibility flags (for the log)."""
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
    if getattr(args, "compat_no_pipeline_parallel", None) and args.pipeline_model_parallel_size > 1:
        raise ConfigError("--no-pipeline-parallel with --pipeline-model-parallel-size > 1: drop one of them.")
    return accepted


# Megatron-LM's load_args_from_checkpoint: the architecture and parallel sizes a checkpoint fixes
_CHECKPOINT_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
                    "position_embedding_type", "use_rotary_position_embeddings", "rotary_base", "rotary_percent",
                    "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim",
                    "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
                    "yarn_correction_range_round_to_int", "enable_gpt_oss", *MLA_FLAGS, *DSA_FLAGS, "softmax_type",
                    "quick_geglu", "glu_linear_offset", "activation_func_clamp_value",
                    "normalization",
                    "norm_epsilon", "swiglu", "group_query_attention", "num_query_groups", "disable_bias_linear",
                    "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by",
                    "apply_query_key_layer_scaling", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "kv_channels", "add_qkv_bias", "qk_layernorm", "qk_norm_across_heads",
                    "llama_4_scaling_beta", "llama_4_scaling_length", "window_size", "use_rope_scaling",
                    "rope_scaling_factor", "rotary_seq_len_interpolation_factor", "apply_layernorm_1p", "geglu",
                    "scale_embeddings", "window_attn_skip_freq", "local_rotary_base", "softmax_scale", "sandwich_norms",
                    "global_kv_channels", "global_num_query_groups", "attention_k_eq_v", "v_norm", "rmsnorm_fp32_scale",
                    "rotary_proportional_percent", "final_logit_softcapping", "layer_scalars", "per_layer_input_size",
                    "num_kv_shared_layers", "double_wide_shared_mlp", "moe_gemma4_block", "load_hf",
                    "attention_output_gate", *LINEAR_ATTENTION_FLAGS,
                    "expert_model_parallel_size", *MOE_FLAGS)


def apply_checkpoint_args(args: argparse.Namespace, start: StartPlan) -> list[str]:
    """--use-checkpoint-args: the saved run's architecture and parallel sizes (its client state, which the start
    plan read) replace the flags'."""
    if not args.use_checkpoint_args:
        return []
    if not args.load:
        raise ConfigError("--use-checkpoint-args needs --load CHECKPOINT_DIR.")
    if start.saved is None:
        raise ConfigError(f"--use-checkpoint-args: no checkpoint in --load {args.load} (no 'latest' file).")
    saved = start.saved.args
    changed = []
    for key in _CHECKPOINT_ARGS:
        if key in saved and getattr(args, key, None) != saved[key]:
            setattr(args, key, saved[key])
            changed.append(key)
    return changed


def _check_experts(model: ModelConfig, dims: ParallelDims) -> None:
    """--expert-model-parallel-size: experts split evenly inside DP x CP (the sequence split's ranks route
    their own tokens, as Megatron-LM's)."""
    ep = dims.expert_parallel
    if ep > 1 and not model.num_experts:
        raise ConfigError(f"--expert-model-parallel-size {ep} splits experts over ranks; the model has none "
                          f"(give --num-experts, or drop --expert-model-parallel-size).")
    if model.num_experts and model.num_experts % ep != 0:
        raise ConfigError(f"--num-experts {model.num_experts} is not divisible by --expert-model-parallel-size {ep}.")


# --- build_run_config's steps ----------------------------------------------------------------------

def _prepare_flags(args, start: StartPlan) -> None:
    """The saved run's architecture (--use-checkpoint-args), Megatron's other spellings, the demo's defaults."""
    apply_checkpoint_args(args, start)
    apply_megatron_aliases(args)
    sft_flags(args)
    grpo_flags(args)
    _demo_defaults(args)


def _vocab_size(args, tokenizer_vocab_size: int) -> int:
    """The embedding's vocabulary: the tokenizer's, or --padded-vocab-size."""
    if args.vocab_size and args.tokenizer_type != "NullTokenizer" and args.vocab_size < tokenizer_vocab_size:
        raise ConfigError(f"--vocab-size {args.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer_vocab_size}); token ids would fall outside the embedding. Drop --vocab-size "
                          f"or use a matching tokenizer.")
    if not args.padded_vocab_size:
        return tokenizer_vocab_size
    if args.padded_vocab_size < tokenizer_vocab_size:
        raise ConfigError(f"--padded-vocab-size {args.padded_vocab_size} is smaller than the tokenizer's "
                          f"vocabulary ({tokenizer_vocab_size}).")
    return args.padded_vocab_size


def _model(args, dims: ParallelDims, vocab_size: int, base_model, eod_token) -> ModelConfig:
    """The architecture with this run's settings, checked against the parallel sizes."""
    model = model_config(args, vocab_size, dims.tensor_parallel, base_model)
    _check_experts(model, dims)
    if args.reset_attention_mask or args.reset_position_ids:
        if eod_token is None:
            raise ConfigError("--reset-attention-mask / --reset-position-ids split packed samples at the "
                              "end-of-document token, and this tokenizer has none; use one that does (the "
                              "tokenizer that --append-eod preprocessed the data with).")
        model = dataclasses.replace(model, reset_attention_mask=args.reset_attention_mask,
                                    reset_position_ids=args.reset_position_ids, eod_token=int(eod_token))
    if args.use_flash_attn:
        from hybrid.model.flash import check_flash_attn_installed  # imports flash-attn, an optional extra
        check_flash_attn_installed()
    return model


def _check_start(args) -> None:
    """--load-hf, --finetune and --universal-checkpoint: which start each needs."""
    if args.load_hf and args.finetune:
        raise ConfigError("--load-hf starts from a HuggingFace model with a fresh schedule already; drop --finetune "
                          "(it fine-tunes from a hybrid checkpoint in --load).")
    if args.finetune and not args.load:
        raise ConfigError("--finetune needs --load CHECKPOINT_DIR.")
    if args.universal_checkpoint and (not args.load or args.finetune):
        raise ConfigError("--universal-checkpoint needs --load CHECKPOINT_DIR (and loads the optimizer: not with "
                          "--finetune, which loads weights from any layout by itself).")


def _training(args, batches: tuple, precision: str, length: RunLength, num_layers: int) -> TrainingConfig:
    micro, global_batch, gas = batches
    return TrainingConfig(
        micro_batch_size=micro, global_batch_size=global_batch, grad_acc_steps=gas, train_iters=length.train_iters,
        seq_length=args.seq_length, precision=precision, seed=args.seed, eval_interval=args.eval_interval,
        eval_iters=args.eval_iters, train_samples=length.train_samples, train_tokens=length.train_tokens,
        rampup=length.rampup, exit_interval=args.exit_interval, exit_duration_in_mins=args.exit_duration_in_mins,
        torch_compile=args.torch_compile, per_token_loss=args.calculate_per_token_loss,
        check_nan=args.check_for_nan_in_loss_and_grad, freeze_layers=parse_layer_ranges(args.freeze_layers, num_layers),
        freeze_embeddings=args.freeze_embeddings)


def _optimizer(args, optimizer: dict, clip: float, length: RunLength) -> OptimizerConfig:
    return OptimizerConfig(
        lr=float(optimizer["params"]["lr"]), min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
        lr_unit=length.lr_unit, lr_decay_steps=length.lr_decay_steps, lr_warmup_steps=length.lr_warmup_steps,
        weight_decay=float(optimizer["params"].get("weight_decay", 0.0)), clip_grad=float(clip),
        muon=_muon(args, optimizer))


def _muon(args, optimizer: dict) -> Optional[MuonOptions]:
    """--optimizer muon's settings; the --muon-* flags without it, or a factor torch's Muon has not, refused."""
    defaults = {"muon_momentum": 0.95, "muon_use_nesterov": True, "muon_num_ns_steps": 5,
                "muon_scale_mode": "original", "muon_extra_scale_factor": 1.0}
    if args.optimizer != "muon":
        given = [f"--{k.replace('_', '-')}" for k, v in defaults.items() if getattr(args, k) != v]
        if given:
            raise ConfigError(f"{' / '.join(given)} set Muon: add --optimizer muon.")
        return None
    if args.muon_extra_scale_factor != 1.0:
        raise ConfigError(f"--muon-extra-scale-factor {args.muon_extra_scale_factor}: torch.optim.Muon's update has "
                          f"no extra factor (its scale is --muon-scale-mode's); drop the flag or scale --lr.")
    if args.muon_num_ns_steps < 1 or not 0 <= args.muon_momentum < 1:
        raise ConfigError(f"--muon-num-ns-steps {args.muon_num_ns_steps} must be at least 1 and --muon-momentum "
                          f"{args.muon_momentum} in [0, 1).")
    params = optimizer["params"]
    return MuonOptions(args.muon_momentum, args.muon_use_nesterov, args.muon_num_ns_steps, args.muon_scale_mode,
                       tuple(params["betas"]), float(params["eps"]))


def data_config(args) -> DataConfig:
    """The data settings of the flags (checked)."""
    _check_data_flags(args)
    return DataConfig(
        data_path=args.data_path, split=args.split, mock_data=args.mock_data,
        split_data_paths=(args.train_data_path, args.valid_data_path, args.test_data_path),
        data_cache_path=args.data_cache_path, legacy_data_rules=args.legacy_data_rules,
        eod_mask_loss=args.eod_mask_loss, num_workers=args.num_workers,
        chat=ChatOptions(args.sft_train_on_prompt, args.sft_truncation, args.sft_skip_bad, pairs=args.dpo,
                         stream_buffer=args.sft_shuffle_buffer if args.sft_streaming else 0,
                         dpo_max_length=args.dpo_max_length, dpo_max_prompt_length=args.dpo_max_prompt_length,
                         dpo_truncation_mode=args.dpo_truncation_mode)
        if args.sft or args.dpo else None)


def _checkpoint(args, ds: dict) -> CheckpointConfig:
    universal = args.universal_checkpoint or bool((ds.get("checkpoint") or {}).get("load_universal"))
    return CheckpointConfig(
        save=args.save, load=args.load, save_interval=args.save_interval, finetune=args.finetune,
        no_load_optim=args.no_load_optim, no_load_rng=args.no_load_rng, no_save_rng=args.no_save_rng,
        universal_checkpoint=universal,
        load_hf=args.load_hf, async_save=args.async_save, export_hf=args.export_hf, sample_prompt=args.sample_prompt)


def _logging(args) -> LoggingConfig:
    return LoggingConfig(
        log_interval=max(1, args.log_interval), log_json=args.log_json, tensorboard_dir=args.tensorboard_dir,
        wandb_project=args.wandb_project, wandb_exp_name=args.wandb_exp_name, wandb_save_dir=args.wandb_save_dir,
        progress_bar=not args.no_progress_bar, log_memory=args.log_memory_to_tensorboard,
        peak_tflops=args.peak_tflops, profile=_profile(args))


def _profile(args) -> Optional[ProfileConfig]:
    if not (args.profile or args.record_memory_history):
        return None
    if not 0 <= args.profile_step_start < args.profile_step_end:
        raise ConfigError(f"--profile-step-start {args.profile_step_start} and --profile-step-end "
                          f"{args.profile_step_end}: the start must be >= 0 and before the end.")
    directory = args.profile_dir or args.tensorboard_dir or (os.path.join(args.save, "profile") if args.save
                                                               else "profile")
    return ProfileConfig(steps=(args.profile_step_start, args.profile_step_end), ranks=tuple(args.profile_ranks),
                         directory=directory, trace=args.profile,
                         memory_snapshot=args.memory_snapshot_path if args.record_memory_history else None)


def _pipeline(args, model: ModelConfig, dims: ParallelDims) -> PipelineSchedule:
    """The schedule, its virtual stages and, with one stage per rank, each stage's layers (--pipeline-partition,
    divided as DeepSpeed's PipelineModule divided them: hybrid.memory.partition_layers)."""
    schedule, virtual = resolve_virtual_stages(args, model.num_layers, dims.pipeline_parallel)
    # (before the partition, which a per-layer table would skew: the table's own reason first)
    check(Setup(pp=dims.pipeline_parallel, per_layer_inputs=bool(model.per_layer_input_size)),
          only=("per-layer-inputs-pipeline",))
    layers = None
    if dims.pipeline_parallel > 1 and virtual == 1:
        layers = partition_layers(model, dims.tensor_parallel, dims.pipeline_parallel, args.pipeline_partition)
    return PipelineSchedule(schedule, virtual, args.pipeline_partition, layers)


def _setup(args, dims, pipeline, stage, model, training, checkpoint, ds, ds_path) -> Setup:
    """What the flags resolved to, as the capability table (hybrid.capabilities) reads it."""
    tp = dims.tensor_parallel
    return Setup(pp=dims.pipeline_parallel, tp=tp, schedule=pipeline.schedule, zero_stage=stage,
                precision=training.precision, recompute=model.recompute_granularity, torch_compile=args.torch_compile,
                micro_batches=training.grad_acc_steps, rampup=bool(training.rampup),
                universal_checkpoint=checkpoint.universal_checkpoint, flash_attn=bool(args.use_flash_attn),
                grad_reduce_bf16=bool(args.grad_reduce_in_bf16), accelerator=dsc.accelerator_kind(),
                zero_source=ds_path or "--zero-stage", documents=model.splits_documents, cp=dims.context_parallel,
                ulysses=dims.ulysses, attention_dropout=model.attention_dropout > 0,
                experts=bool(model.num_experts),
                ep=dims.expert_parallel, sequence_parallel=model.sequence_parallel, seq_length=args.seq_length,
                heads_per_tp=model.num_attention_heads // tp, groups_per_tp=model.common_query_groups // tp,
                experts_on_every_stage=_experts_on_every_stage(model, dims, pipeline),
                fp8=fp8_recipe(args), fp8_param_gather=args.fp8_param_gather,
                cpu_offloading=dsc.cpu_offloading(args, ds), dpo=bool(args.dpo),
                dpo_precomputed=bool(args.dpo and args.dpo_reference_logps), grpo=bool(args.grpo),
                grpo_kl=bool(args.grpo and args.grpo_beta > 0), mla=model.multi_latent_attention,
                dsa=model.dsa_indexer_topk is not None, dsa_shared=bool(model.dsa_index_share),
                dsa_sharing_split=_sharing_split(model, dims, pipeline, model.dsa_source),
                per_layer_inputs=bool(model.per_layer_input_size), kv_shared=bool(model.kv_shared_layers),
                kv_sharing_split=_sharing_split(model, dims, pipeline, model.kv_source),
                mtp=bool(model.mtp_num_layers), lora=bool(model.lora_rank),
                gated_delta_net=model.linear_attention_freq is not None, output_gate=model.attention_output_gate,
                linear_key_heads_per_tp=model.linear_num_key_heads // tp,
                moe_capacity=bool(model.num_experts and model.moe_expert_capacity_factor is not None),
                fp32_grad_accumulation=dsc.fp32_grad_accumulation(ds), optimizer=args.optimizer or "adam",
                offload_optimizer=dsc.optimizer_offload(ds))


def _universal_problem(setup: Setup) -> Optional[str]:
    """None where the capability table lets this run load a universal checkpoint, else why not."""
    try:
        check(dataclasses.replace(setup, universal_checkpoint=True))
    except ConfigError as error:
        return str(error)
    return None


def build_run_config(args: argparse.Namespace, world_size: int, tokenizer_vocab_size: int,
                     base_model: Optional[ModelConfig] = None, eod_token: Optional[int] = None,
                     start: Optional[StartPlan] = None) -> RunConfig:
    """Validate the flags against each other, the DeepSpeed config and the world size.
    `base_model`: the architecture of --load-hf's model (hybrid.conversion.hf.read_hf_config) or of --load's
    Megatron checkpoint; `eod_token`: the tokenizer's end-of-document id (--reset-attention-mask /
    --reset-position-ids); `start`: where the run starts (hybrid.training.start.plan_start; planned here when not
    given), its bridge settled against this run's capabilities. The flags are normalized on a copy of `args`
    (recorded in the checkpoints as the run's), never in the caller's namespace."""
    args = argparse.Namespace(**vars(args))
    start = start or plan_start(args)
    _prepare_flags(args, start)
    ds, ds_path = dsc.load_ds_config(args)
    stage = dsc.zero_stage(args, ds, ds_path, args.pipeline_model_parallel_size)
    dims = ParallelDims(world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                        args.context_parallel_size, ulysses=args.ds_sequence_parallel_size,
                        expert_parallel=args.expert_model_parallel_size)
    _check_cp_comm_type(args)
    model = _model(args, dims, _vocab_size(args, tokenizer_vocab_size), base_model, eod_token)
    batches = dsc.batch_sizes(args, ds, ds_path, dims.data_parallel)
    precision = dsc.precision_of(args, ds, ds_path)
    warning = dsc.default_bucket_warning(ds, stage, precision, ds_path)
    if warning:
        log(warning)
    clip = dsc.agree(ds, "gradient_clipping", "--clip-grad", args.clip_grad, ds_path, 1.0)
    optimizer = dsc.optimizer_config(args, ds, ds_path)
    length = resolve_run_length(args, batches[1], batches[0] * dims.data_parallel, args.seq_length)
    data = data_config(args)
    _check_start(args)
    training = _training(args, batches, precision, length, args.num_layers)
    if args.dpo:
        training.dpo = DPOOptions(args.dpo_beta, args.dpo_label_smoothing, args.dpo_loss_type, model.eod_token,
                                  args.dpo_reference_logps)
    if args.grpo:
        training.grpo = grpo_options(args, training.global_batch_size, dims.data_parallel, dims.sequence_split)
    if args.export_hf and not args.save:
        raise ConfigError("--export-hf needs --save (the checkpoint it exports).")
    checkpoint = _checkpoint(args, ds)
    pipeline = _pipeline(args, model, dims)
    setup = _setup(args, dims, pipeline, stage, model, training, checkpoint, ds, ds_path)
    check(setup)
    start = with_bridge(start, args.save, lambda: _universal_problem(setup))
    run = RunConfig(model=model, parallel=dims, pipeline=pipeline, training=training,
                    optimizer=_optimizer(args, optimizer, clip, length), data=data, checkpoint=checkpoint,
                    logging=_logging(args), ds_config={}, args=dict(vars(args)), start=start)
    # --optimizer muon: the optimizer is hybrid's (handed to deepspeed.initialize), the config names none
    run.ds_config = dsc.final_ds_config(ds, args, run, stage, None if run.optimizer.muon else optimizer)
    return run
