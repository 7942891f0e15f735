"""Parsed flags -> the typed configuration of one run (ModelConfig, TrainConfig, RunConfig).

Every check runs in `build_run_config`, once, before any model is built or DeepSpeed is imported;
a mistake raises ConfigError naming the flag (and the DeepSpeed config key where both are
involved) and the fix. The flags themselves are in hybrid.flags, the merge with the DeepSpeed
JSON in hybrid.ds_config, the parallel sizes in hybrid.topology.ParallelDims.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import asdict, dataclass, field
from typing import Optional


from hybrid import ds_config as dsc
from hybrid.errors import ConfigError
from hybrid.model.config import LLAMA3_ROPE_DEFAULTS, ModelConfig
from hybrid.topology import ParallelDims


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
    universal_checkpoint: bool = False  # --universal-checkpoint: --load a universal checkpoint, any layout
    per_token_loss: bool = False  # --calculate-per-token-loss: the iteration's loss is its valid tokens' mean
    check_nan: bool = True  # --check-for-nan-in-loss-and-grad: stop at the first non-finite loss or grad norm
    load_hf: Optional[str] = None  # --load-hf: the HF model directory the run starts from (when --load has none)
    async_save: bool = False  # --async-save: checkpoints written in the background from a host copy


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
    args: dict  # the parsed flags, saved in checkpoints
    context_parallel: int = 1  # --context-parallel-size
    ulysses: int = 1  # --ds-sequence-parallel-size
    expert_parallel: int = 1  # --expert-model-parallel-size (inside DP)
    pipeline_schedule: str = "1f1b"  # --pipeline-schedule: DeepSpeed's engine, or a torch.distributed.pipelining one
    virtual_stages: int = 1  # virtual pipeline stages per rank

    @property
    def deepspeed_pipeline(self) -> bool:
        """Pipeline stages run by DeepSpeed's PipelineEngine (PP > 1, --pipeline-schedule 1f1b)."""
        return self.pipeline_parallel > 1 and self.pipeline_schedule == "1f1b"

    @property
    def virtual_pipeline(self) -> bool:
        """Virtual stages run by a torch.distributed.pipelining schedule (PP > 1, any other schedule)."""
        return self.pipeline_parallel > 1 and self.pipeline_schedule != "1f1b"

    @property
    def sequence_split(self) -> int:
        """Ranks holding parts of one sequence (CP or Ulysses): DeepSpeed's data-parallel world is DP x this."""
        return self.context_parallel * self.ulysses

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


def _rope_scaling(args) -> Optional[dict]:
    if args.use_rope_scaling and args.rotary_seq_len_interpolation_factor:
        raise ConfigError("--use-rope-scaling (llama3) and --rotary-seq-len-interpolation-factor (linear) are two "
                          "rope scalings; give one.")
    if args.use_rope_scaling:
        return {"rope_type": "llama3", "factor": args.rope_scaling_factor, **LLAMA3_ROPE_DEFAULTS}
    if args.rotary_seq_len_interpolation_factor:
        return {"rope_type": "linear", "factor": float(args.rotary_seq_len_interpolation_factor)}
    return None


def _sliding_window(args) -> Optional[int]:
    """Megatron's --window-size (left, right) -> the window transformers names (left + 1 keys)."""
    if args.window_size is None:
        return None
    left, right = args.window_size
    if right != 0:
        raise ConfigError(f"--window-size {left},{right}: a causal model attends no later tokens; use {left},0.")
    if left < -1:
        raise ConfigError(f"--window-size {left},0: LEFT must be >= 0 (-1: no window).")
    return None if left == -1 else left + 1


def _architecture(args, vocab_size: int) -> ModelConfig:
    """The model's shape and options from the flags (everything --load-hf takes from its config)."""
    if args.group_query_attention and not args.num_query_groups:
        raise ConfigError("--group-query-attention needs --num-query-groups N.")
    kv_channels = args.kv_channels
    if kv_channels and kv_channels * args.num_attention_heads == args.hidden_size:
        kv_channels = None  # the default head dimension (so the config equals an imported model's)
    return ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        vocab_size=vocab_size, max_position_embeddings=args.max_position_embeddings or args.seq_length,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups if args.group_query_attention or args.num_query_groups else None,
        position_embedding_type="rope" if args.use_rotary_position_embeddings else args.position_embedding_type,
        rotary_base=args.rotary_base, normalization=args.normalization, norm_epsilon=args.norm_epsilon,
        swiglu=args.swiglu, add_bias_linear=not args.disable_bias_linear,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, kv_channels=kv_channels, add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm, sliding_window=_sliding_window(args), rope_scaling=_rope_scaling(args),
        apply_layernorm_1p=args.apply_layernorm_1p, geglu=args.geglu, scale_embeddings=args.scale_embeddings,
        **_moe_fields(args))


MOE_FLAGS = ("num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function",
             "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size",
             "moe_shared_expert_gate")  # the architecture (an imported model's config sets them)
MOE_TRAINING_FLAGS = ("moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                      "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_expert_capacity_factor",
                      "moe_token_drop_policy", "moe_grouped_gemm")  # how it trains (flags, also with --load-hf)


MOE_NEEDS_SP = ("--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel (each TP rank "
                "routes its own sequence shard, as in Megatron-LM).")


def _moe_fields(args) -> dict:
    return {name: getattr(args, name) for name in MOE_FLAGS} if args.num_experts else {}


def _model_config(args, vocab_size: int, tp: int, base: Optional[ModelConfig] = None) -> ModelConfig:
    """The architecture (from the flags, or `base`: a --load-hf model's) with this run's settings."""
    granularity = args.recompute_granularity or ("full" if args.checkpoint_activations else None)
    num_layers = args.recompute_num_layers or args.checkpoint_num_layers or 1
    if base is not None and vocab_size > base.vocab_size:
        raise ConfigError(f"--load-hf {args.load_hf}: the tokenizer has {vocab_size} tokens but the model's "
                          f"embedding only {base.vocab_size}; use the model's own tokenizer (drop the tokenizer flags).")
    architecture = base or _architecture(args, vocab_size)
    if architecture.family is None:  # recorded in the checkpoints, so export writes this family
        from hybrid.conversion.families import infer_family
        architecture = dataclasses.replace(architecture, family=infer_family(architecture))
    config = dataclasses.replace(
        architecture, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling, use_flash_attn=args.use_flash_attn,
        recompute_granularity=granularity, recompute_method=args.recompute_method,
        recompute_num_layers=num_layers, sequence_parallel=args.sequence_parallel and tp > 1, seed=args.seed,
        async_tensor_model_parallel_allreduce=not args.no_async_tensor_model_parallel_allreduce,
        **({name: getattr(args, name) for name in MOE_TRAINING_FLAGS} if architecture.num_experts else {}))
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


def _check_context_parallel(args, tp: int, cp: int) -> None:
    """--context-parallel-size: 2 x CP chunks of the sequence (each SP-divisible by TP); the p2p ring."""
    unknown = [kind for kind in args.cp_comm_type if kind != "p2p"]
    if unknown:
        raise ConfigError(f"--cp-comm-type {' '.join(unknown)} is not supported: the K/V ring (p2p) is the "
                          f"context-parallel communication built; use --cp-comm-type p2p.")
    if cp == 1:
        return
    if args.seq_length % (2 * cp) != 0:
        raise ConfigError(f"--context-parallel-size {cp} cuts each sequence into 2 x {cp} chunks: --seq-length "
                          f"{args.seq_length} must be divisible by {2 * cp}.")
    if args.sequence_parallel and tp > 1 and (args.seq_length // cp) % tp != 0:
        raise ConfigError(f"--sequence-parallel with --context-parallel-size {cp}: each rank's {args.seq_length // cp} "
                          f"tokens must be divisible by --tensor-model-parallel-size {tp}.")


def _check_ulysses(args, model, tp: int, ulysses: int) -> None:
    """--ds-sequence-parallel-size N: the sequence in N parts, heads and KV groups (per TP rank) in N."""
    if ulysses == 1:
        return
    if args.seq_length % ulysses != 0:
        raise ConfigError(f"--ds-sequence-parallel-size {ulysses}: --seq-length {args.seq_length} must be "
                          f"divisible by {ulysses}.")
    heads, groups = model.num_attention_heads // tp, model.num_query_groups // tp
    if heads % ulysses or groups % ulysses:
        raise ConfigError(f"--ds-sequence-parallel-size {ulysses}: Ulysses gives each rank 1/{ulysses} of the "
                          f"attention heads and of the KV groups, but each TP rank has {heads} heads and {groups} "
                          f"KV groups (--num-attention-heads / --num-query-groups over --tensor-model-parallel-size "
                          f"{tp}); use a size that divides both, or --context-parallel-size (ring attention has no "
                          f"such rule).")
    if args.sequence_parallel and tp > 1 and (args.seq_length // ulysses) % tp != 0:
        raise ConfigError(f"--sequence-parallel with --ds-sequence-parallel-size {ulysses}: each rank's "
                          f"{args.seq_length // ulysses} tokens must be divisible by --tensor-model-parallel-size {tp}.")


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
    if getattr(args, "compat_no_pipeline_parallel", None) and args.pipeline_model_parallel_size > 1:
        raise ConfigError("--no-pipeline-parallel with --pipeline-model-parallel-size > 1: drop one of them.")
    return accepted


# Megatron-LM's load_args_from_checkpoint: the architecture and parallel sizes a checkpoint fixes
_CHECKPOINT_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
                    "position_embedding_type", "use_rotary_position_embeddings", "rotary_base", "normalization",
                    "norm_epsilon", "swiglu", "group_query_attention", "num_query_groups", "disable_bias_linear",
                    "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by",
                    "apply_query_key_layer_scaling", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "kv_channels", "add_qkv_bias", "qk_layernorm", "window_size", "use_rope_scaling",
                    "rope_scaling_factor", "rotary_seq_len_interpolation_factor", "apply_layernorm_1p", "geglu",
                    "scale_embeddings", "load_hf", "expert_model_parallel_size", *MOE_FLAGS)


def apply_checkpoint_args(args: argparse.Namespace) -> list[str]:
    """--use-checkpoint-args: the saved run's architecture and parallel sizes replace the flags'."""
    if not args.use_checkpoint_args:
        return []
    if not args.load:
        raise ConfigError("--use-checkpoint-args needs --load CHECKPOINT_DIR.")
    from hybrid.checkpoint_format import read_client_state, read_tag
    tag = read_tag(args.load) if os.path.isdir(args.load) else None
    if tag is None:
        raise ConfigError(f"--use-checkpoint-args: no checkpoint in --load {args.load} (no 'latest' file).")
    saved = read_client_state(args.load, tag).args
    changed = []
    for key in _CHECKPOINT_ARGS:
        if key in saved and getattr(args, key, None) != saved[key]:
            setattr(args, key, saved[key])
            changed.append(key)
    return changed


def _check_experts(model: ModelConfig, ep: int, sequence_split: int, tp: int) -> None:
    """--expert-model-parallel-size: experts split evenly inside DP; TP needs SP (as Megatron-LM)."""
    if model.num_experts and tp > 1 and not model.sequence_parallel:
        raise ConfigError(MOE_NEEDS_SP.format(tp=tp))
    if ep > 1 and not model.num_experts:
        raise ConfigError(f"--expert-model-parallel-size {ep} splits experts over ranks; the model has none "
                          f"(give --num-experts, or drop --expert-model-parallel-size).")
    if model.num_experts and model.num_experts % ep != 0:
        raise ConfigError(f"--num-experts {model.num_experts} is not divisible by --expert-model-parallel-size {ep}.")
    if ep > 1 and sequence_split > 1:
        raise ConfigError(f"--expert-model-parallel-size {ep} with --context-parallel-size / "
                          f"--ds-sequence-parallel-size {sequence_split}: expert groups inside the DP x CP axis are not "
                          f"built yet; use one of them.")


def build_run_config(args: argparse.Namespace, world_size: int, tokenizer_vocab_size: int,
                     base_model: Optional[ModelConfig] = None, eod_token: Optional[int] = None) -> RunConfig:
    """Validate the flags against each other, the DeepSpeed config and the world size.
    `base_model`: the architecture of --load-hf's model (hybrid.conversion.hf.read_hf_config);
    `eod_token`: the tokenizer's end-of-document id (--reset-attention-mask / --reset-position-ids)."""
    apply_checkpoint_args(args)
    apply_megatron_aliases(args)
    _demo_defaults(args)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp, ulysses = args.context_parallel_size, args.ds_sequence_parallel_size
    ds, ds_path = dsc.load_ds_config(args)
    stage = dsc.zero_stage(args, ds, ds_path, pp)
    ep = args.expert_model_parallel_size
    dp = ParallelDims(world_size, tp, pp, cp, ulysses=ulysses, expert_parallel=ep).data_parallel
    _check_context_parallel(args, tp, cp)
    vocab_size = tokenizer_vocab_size
    if args.padded_vocab_size:
        if args.padded_vocab_size < tokenizer_vocab_size:
            raise ConfigError(f"--padded-vocab-size {args.padded_vocab_size} is smaller than the tokenizer's "
                              f"vocabulary ({tokenizer_vocab_size}).")
        vocab_size = args.padded_vocab_size
    if args.vocab_size and args.tokenizer_type != "NullTokenizer" and args.vocab_size < tokenizer_vocab_size:
        raise ConfigError(f"--vocab-size {args.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer_vocab_size}); token ids would fall outside the embedding. Drop --vocab-size "
                          f"or use a matching tokenizer.")
    model = _model_config(args, vocab_size, tp, base_model)
    _check_ulysses(args, model, tp, ulysses)
    _check_experts(model, ep, cp * ulysses, tp)
    if args.reset_attention_mask or args.reset_position_ids:
        if eod_token is None:
            raise ConfigError("--reset-attention-mask / --reset-position-ids split packed samples at the "
                              "end-of-document token, and this tokenizer has none; use one that does (the "
                              "tokenizer that --append-eod preprocessed the data with).")
        model = dataclasses.replace(model, reset_attention_mask=args.reset_attention_mask,
                                    reset_position_ids=args.reset_position_ids, eod_token=int(eod_token))
    micro, global_batch, gas = dsc.batch_sizes(args, ds, ds_path, dp)
    precision = dsc.precision_of(args, ds, ds_path)
    if args.use_flash_attn:
        from hybrid.model.flash import check_flash_attn_installed
        check_flash_attn_installed()
    clip = dsc.agree(ds, "gradient_clipping", "--clip-grad", args.clip_grad, ds_path, 1.0)
    optimizer = dsc.optimizer_config(args, ds, ds_path)
    from hybrid.run_length import resolve_run_length
    length = resolve_run_length(args, global_batch, micro * dp, args.seq_length)
    _check_data_flags(args)
    if args.load_hf and args.finetune:
        raise ConfigError("--load-hf starts from a HuggingFace model with a fresh schedule already; drop --finetune "
                          "(it fine-tunes from a hybrid checkpoint in --load).")
    if args.finetune and not args.load:
        raise ConfigError("--finetune needs --load CHECKPOINT_DIR.")
    if args.universal_checkpoint and (not args.load or args.finetune):
        raise ConfigError("--universal-checkpoint needs --load CHECKPOINT_DIR (and loads the optimizer: not with "
                          "--finetune, which loads weights from any layout by itself).")
    train = TrainConfig(
        micro_batch_size=micro, global_batch_size=global_batch, grad_acc_steps=gas, train_iters=length.train_iters,
        seq_length=args.seq_length, lr=float(optimizer["params"]["lr"]), min_lr=args.min_lr,
        lr_decay_style=args.lr_decay_style, lr_unit=length.lr_unit, lr_decay_steps=length.lr_decay_steps,
        lr_warmup_steps=length.lr_warmup_steps,
        weight_decay=float(optimizer["params"].get("weight_decay", 0.0)), clip_grad=float(clip),
        precision=precision, seed=args.seed, eval_interval=args.eval_interval, eval_iters=args.eval_iters,
        data_path=args.data_path, split=args.split, mock_data=args.mock_data, save=args.save, load=args.load,
        save_interval=args.save_interval, finetune=args.finetune, load_hf=args.load_hf, async_save=args.async_save, no_load_optim=args.no_load_optim,
        no_load_rng=args.no_load_rng, log_interval=max(1, args.log_interval), log_json=args.log_json,
        tensorboard_dir=args.tensorboard_dir, wandb_project=args.wandb_project, wandb_exp_name=args.wandb_exp_name,
        num_workers=args.num_workers, exit_interval=args.exit_interval, progress_bar=not args.no_progress_bar,
        freeze_layers=parse_layer_ranges(args.freeze_layers, args.num_layers),
        freeze_embeddings=args.freeze_embeddings,
        split_data_paths=(args.train_data_path, args.valid_data_path, args.test_data_path),
        data_cache_path=args.data_cache_path, legacy_data_rules=args.legacy_data_rules,
        eod_mask_loss=args.eod_mask_loss, per_token_loss=args.calculate_per_token_loss,
        check_nan=args.check_for_nan_in_loss_and_grad, torch_compile=args.torch_compile, train_samples=length.train_samples,
        train_tokens=length.train_tokens, rampup=length.rampup, exit_duration_in_mins=args.exit_duration_in_mins,
        wandb_save_dir=args.wandb_save_dir, log_memory=args.log_memory_to_tensorboard,
        export_hf=args.export_hf, sample_prompt=args.sample_prompt, universal_checkpoint=args.universal_checkpoint or bool(
            (ds.get("checkpoint") or {}).get("load_universal")))
    if train.export_hf and not train.save:
        raise ConfigError("--export-hf needs --save (the checkpoint it exports).")
    from hybrid.pipeline_plan import resolve_virtual_stages
    schedule, virtual = resolve_virtual_stages(args, model.num_layers, pp)
    from hybrid.capabilities import Setup, check
    check(Setup(pp=pp, tp=tp, schedule=schedule, zero_stage=stage, precision=precision,
                recompute=model.recompute_granularity, torch_compile=args.torch_compile, micro_batches=gas,
                rampup=bool(length.rampup), universal_checkpoint=train.universal_checkpoint,
                flash_attn=bool(args.use_flash_attn), grad_reduce_bf16=bool(args.grad_reduce_in_bf16),
                accelerator=dsc.accelerator_kind(), zero_source=ds_path or "--zero-stage",
                documents=model.splits_documents, cp=cp, ulysses=ulysses, attention_dropout=model.attention_dropout > 0,
                sliding_window=model.sliding_window is not None, experts=bool(model.num_experts), ep=ep))
    ds_config = dsc.final_ds_config(ds, args, train, stage, optimizer, model)
    return RunConfig(model=model, train=train, tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp,
                     context_parallel=cp, ulysses=ulysses, expert_parallel=ep,
                     pipeline_partition=args.pipeline_partition, ds_config=ds_config,
                     args=dict(vars(args)), pipeline_schedule=schedule, virtual_stages=virtual)


def config_summary(run: RunConfig) -> dict:
    """A JSON-able record of the run's configuration (saved with checkpoints)."""
    model = asdict(run.model)
    return {"model": model, "train": asdict(run.train), "tensor_parallel": run.tensor_parallel,
            "pipeline_parallel": run.pipeline_parallel, "data_parallel": run.data_parallel,
            "context_parallel": run.context_parallel, "ulysses": run.ulysses, "expert_parallel": run.expert_parallel,
            "pipeline_schedule": run.pipeline_schedule, "virtual_stages": run.virtual_stages,
            "zero_stage": run.zero_stage}
