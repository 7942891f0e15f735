"""launch/evaluate.py: mean LM loss of a checkpoint over the first windows of a dataset's token stream, or
with --sft over every assistant token of a file of conversations.

Windows are consecutive and non-overlapping, S + 1 tokens each (S predictions), taken in order
from the concatenation of the dataset's sequences: no shuffling, no sampling, so the same number
comes out of `transformers` on the same windows. --sft: the file's conversations in order, each once,
packed as training packs them (hybrid.data.chat), the loss the token mean over every token that takes
loss, as transformers computes it conversation by conversation with the assistant mask.
Runs at the checkpoint's TP x PP (world size a multiple of it; data-parallel ranks split the micro-batches).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from hybrid.architecture import fp8_fields
from hybrid.capabilities import Setup, check
from hybrid.conversion.layout import load_parts
from hybrid.data.batches import Collator, to_device
from hybrid.data.chat.dataset import evaluation_windows
from hybrid.data.chat.options import ChatOptions
from hybrid.data.chat.template import ChatEncoder
from hybrid.data.indexed import IndexedDataset
from hybrid.data.tokenizer import HFTokenizer
from hybrid.distributed import end_distributed
from hybrid.errors import ConfigError
from hybrid.flags import FlagParser, add_fp8_flags
from hybrid.memory import partition_layers
from hybrid.model.build import build_model
from hybrid.model.forward_only import forward_only
from hybrid.model.objectives import LanguageModeling
from hybrid.model.naming import names_to_load
from hybrid.parallel import fp8
from hybrid.parallel.dims import ParallelDims
from hybrid.parallel.groups import build_groups
from hybrid.parallel.cross_entropy import IGNORE_INDEX
from hybrid.pipeline_plan import PipelineSchedule
from hybrid.conversion.source import HF, HYBRID, open_source
from hybrid.safe_loading import install_safe_torch_load


def add_source_flags(p) -> None:
    """The flags that say which checkpoint to read and at which layout (evaluate.py's and generate.py's)."""
    p.add_argument("--load", default=None, help="a hybrid, Megatron-LM or Megatron-DeepSpeed checkpoint")
    p.add_argument("--load-hf", default=None, help="a local HuggingFace model directory (instead of --load)")
    p.add_argument("--allow-unsafe-checkpoint-load", action="store_true",
                   help="UNSAFE: unpickle checkpoint files fully (runs any code they hold); only for files you trust")
    p.add_argument("--sequence-parallel", action="store_true", help="Megatron sequence parallelism at TP > 1")
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="split an MoE checkpoint's experts over this many data-parallel ranks")
    p.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="with a Megatron checkpoint or --load-hf: the TP to run at (default: the one it was saved "
                        "at; 1 for --load-hf); a hybrid checkpoint runs at its own")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=None,
                   help="with a Megatron-LM checkpoint or --load-hf: the PP to run at (default: the one it was saved "
                        "at; 1 for --load-hf)")
    p.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None)
    add_fp8_flags(p.add_argument_group("FP8 GEMMs (as launch/train.py's)"))


def build_parser():
    p = FlagParser(description="Evaluate a checkpoint's (or a HuggingFace model's) LM loss on a dataset.",
                   allow_abbrev=False)
    add_source_flags(p)
    p.add_argument("--data-path", required=True, nargs="+")
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--eval-iters", type=int, default=None,
                   help="micro-batches to evaluate (default: 10; with --sft every conversation of the file once)")
    p.add_argument("--sft", action="store_true",
                   help="--data-path is a file of conversations (as launch/train.py --sft reads): the loss over "
                        "the assistant's tokens, rendered with the tokenizer's chat template")
    p.add_argument("--tokenizer-model", default=None,
                   help="--sft: the HuggingFace tokenizer directory (default: --load-hf's)")
    p.add_argument("--sft-train-on-prompt", action="store_true", help="--sft: every token takes loss")
    p.add_argument("--sft-truncation", default="truncate", choices=["truncate", "drop"])
    p.add_argument("--sft-skip-bad", action="store_true", help="--sft: count and skip malformed rows")
    p.add_argument("--context-parallel-size", type=int, default=1,
                   help="split each sequence over this many ranks (the ring attention, as launch/train.py's)")
    p.add_argument("--log-json", default=None)
    return p


def stream_windows(prefix: str, seq_length: int, count: int) -> np.ndarray:
    """[count, seq_length + 1] consecutive non-overlapping windows of the concatenated tokens."""
    data = IndexedDataset(prefix)
    width = seq_length + 1
    needed = count * width
    if data.num_tokens < needed:
        raise ConfigError(f"--data-path {prefix}: {data.num_tokens} tokens, but --eval-iters x --micro-batch-size "
                          f"windows of --seq-length + 1 need {needed}.")
    ends = np.cumsum(data.sizes.astype(np.int64))
    last = int(np.searchsorted(ends, needed, side="left"))
    tokens = np.concatenate([data.get(i) for i in range(last + 1)])[:needed].astype(np.int64)
    return tokens.reshape(count, width)


@dataclasses.dataclass
class Source:
    """A checkpoint to run: its model, the TP x PP to run it at, and `parts(wanted)`, its tensors a part at a time
    (this rank's only where the format allows)."""

    config: object
    tp: int
    pp: int
    parts: object


def open_checkpoint(args, seq_length: Optional[int] = None) -> Source:
    """The checkpoint --load or --load-hf names, in evaluation form (no dropout, no recompute), at the layout the
    flags ask for (default: the checkpoint's own; TP = PP = 1 for --load-hf)."""
    if (args.load is None) == (args.load_hf is None):
        raise ConfigError("give one of --load CHECKPOINT_DIR and --load-hf HF_MODEL_DIR.")
    if args.load_hf:
        source = open_source(args.load_hf, "--load-hf", kind=HF)
    else:
        source = open_source(args.load, "--load")
        if source.kind == HF:
            raise ConfigError(f"--load {args.load}: a transformers directory; give it as --load-hf {args.load}.")
    config = source.config()
    if source.kind == HYBRID:  # evaluated at the layout it was saved at (its files are read whole)
        tp, pp = source.layout
    else:  # the TP x PP asked for (default: its own; TP = PP = 1 for an HF model)
        tp = args.tensor_model_parallel_size or source.layout[0]
        pp = args.pipeline_model_parallel_size or source.layout[1]
        config.validate(tp)
    config = dataclasses.replace(config, **fp8_fields(args))
    check(Setup(fp8=config.fp8_recipe), only=("fp8-mxfp8", "fp8-blockwise"))
    config.hidden_dropout = config.attention_dropout = 0.0
    config.recompute_granularity = None
    config.sequence_parallel = args.sequence_parallel and tp > 1
    check(Setup(tp=tp, experts=bool(config.num_experts), sequence_parallel=config.sequence_parallel),
          only=("moe-tp-without-sp",))
    if config.sequence_parallel and seq_length is not None and seq_length % tp:
        raise ConfigError(f"--sequence-parallel needs --seq-length {seq_length} divisible by the checkpoint's "
                          f"tensor-parallel size {tp}.")
    if source.kind == HYBRID:  # read whole, once (every rank reads the files the layout needs)
        state = source.state(config)

        def parts(wanted):
            return [state]
    else:  # a part at a time, this rank's tensors only (its stage, its experts)
        def parts(wanted):
            return source.parts(config, wanted)
    return Source(config, tp, pp, parts)


def layout_dims(source: Source, ep: int, cp: int = 1) -> ParallelDims:
    """The job's layout for the checkpoint: its TP x PP, `ep` (--expert-model-parallel-size), `cp`
    (--context-parallel-size: each sequence over CP ranks, the ring), the rest DP."""
    config = source.config
    if ep > 1 and not config.num_experts:
        raise ConfigError(f"--expert-model-parallel-size {ep}: the checkpoint's model has no experts.")
    if config.num_experts and config.num_experts % ep:
        raise ConfigError(f"--expert-model-parallel-size {ep} does not divide the model's {config.num_experts} "
                          f"experts.")
    return ParallelDims(int(os.environ.get("WORLD_SIZE", "1")), source.tp, source.pp, context_parallel=cp,
                        expert_parallel=ep)


def loaded_model(config, groups, parts, device):
    """This rank's part of the model (eval mode) with the checkpoint's tensors, on `device`; a pipeline's layers
    split as evenly as --pipeline-partition uniform splits them."""
    pipeline = PipelineSchedule()
    if groups.pp.size > 1:
        pipeline = PipelineSchedule(stage_layers=partition_layers(config, groups.tp.size, groups.pp.size, "uniform"))
    model = build_model(config, groups, pipeline).eval()
    _load(model, config, groups, parts)
    return model.to(device)


def evaluate(args) -> dict:
    if len(args.data_path) != 1:
        raise ConfigError("--data-path: evaluate.py takes one dataset prefix (no blend weights).")
    source = open_checkpoint(args, args.seq_length)
    config, pp = source.config, source.pp
    dims = layout_dims(source, args.expert_model_parallel_size, args.context_parallel_size)
    dp, cp = dims.data_parallel, dims.context_parallel
    if cp > 1 and args.seq_length % (2 * cp):
        raise ConfigError(f"--context-parallel-size {cp}: --seq-length {args.seq_length} must be a multiple of "
                          f"{2 * cp} (each rank holds two of its 2 x CP chunks).")
    if args.eval_iters is None and not args.sft:
        args.eval_iters = 10
    if args.eval_iters is not None and args.eval_iters % dp:
        raise ConfigError(f"--eval-iters {args.eval_iters} must be a multiple of the data-parallel size {dp}.")
    if config.position_embedding_type == "learned_absolute" and args.seq_length > config.max_position_embeddings:
        raise ConfigError(f"--seq-length {args.seq_length} exceeds the model's max positions "
                          f"{config.max_position_embeddings}.")
    if args.sft:
        config, batches, counts = _chat_batches(args, config, dp)
    else:
        windows = torch.from_numpy(stream_windows(args.data_path[0], args.seq_length,
                                                  args.eval_iters * args.micro_batch_size))
        # every position counts
        batches = [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows.split(args.micro_batch_size)]
    groups = build_groups(dims, experts=bool(config.num_experts))
    mine = [batch for k, batch in enumerate(batches) if k % dp == groups.dp.rank]
    device = rank_device()
    if config.fp8_recipe:  # as training checks: no torchao emulation on a GPU without FP8 units
        fp8.check_device(device)
    token_sums = args.sft  # --sft: each micro-batch's sum over its loss tokens, divided by their count at the end
    losses = _losses(config, groups, source.parts, mine, device, token_sums)
    # summed on the device the backend communicates on (NCCL needs CUDA tensors), in fp32
    total = torch.stack(losses).sum().reshape(1) if losses else torch.zeros(1, device=device)
    if pp > 1:  # the last stage's sum (the other stages hold none)
        dist.all_reduce(total, group=groups.pp.group)
    if dp > 1:
        dist.all_reduce(total, group=groups.dp.group)
    if cp > 1:  # each CP rank's loss is its tokens' share (x CP for a mean, the sum's part per token)
        dist.all_reduce(total, group=groups.cp.group)
        total = total if args.sft else total / cp
    if args.sft:
        return {"lm_loss": total.item() / counts["loss_tokens"], **counts}
    return {"lm_loss": total.item() / len(batches), "tokens": len(batches) * args.micro_batch_size * args.seq_length}


def _chat_batches(args, config, dp: int):
    """--sft: the file's conversations packed in order into (ids, labels) micro-batches (a multiple of the DP
    size; the padding windows take no loss), the model splitting them at the separator; and the counts."""
    path = args.tokenizer_model or args.load_hf
    if not path:
        raise ConfigError("--sft needs the model's chat tokenizer: --tokenizer-model DIR (or --load-hf DIR, whose "
                          "tokenizer is used).")
    options = ChatOptions(args.sft_train_on_prompt, args.sft_truncation, args.sft_skip_bad)
    encoder = ChatEncoder(HFTokenizer(path).to_transformers(), f"--tokenizer-model {path}", options)
    tokens, mask, counts = evaluation_windows(args.data_path[0], args.seq_length, encoder)
    micro = args.micro_batch_size
    count = -(-len(tokens) // micro)
    if args.eval_iters is not None:
        count = min(count, args.eval_iters)
    count = -(-count // dp) * dp
    padding = count * micro - len(tokens)
    if padding > 0:
        tokens = np.concatenate([tokens, np.full((padding, tokens.shape[1]), encoder.separator, tokens.dtype)])
        mask = np.concatenate([mask, np.zeros((padding, mask.shape[1]), bool)])
    collate = Collator()
    batches = [collate([{"text": torch.from_numpy(tokens[i].astype(np.int64)), "loss_mask": torch.from_numpy(mask[i])}
                        for i in range(k * micro, (k + 1) * micro)]) for k in range(count)]
    loss_tokens = int(sum((labels != IGNORE_INDEX).sum() for _, labels in batches))
    config = dataclasses.replace(config, reset_attention_mask=True, reset_position_ids=True,
                                 eod_token=encoder.separator)
    return config, batches, {"loss_tokens": loss_tokens, "conversations": counts.conversations,
                             "skipped_bad": counts.skipped_bad, "truncated": counts.truncated,
                             "dropped": counts.dropped, "windows": len(tokens) - max(padding, 0)}


def rank_device() -> torch.device:
    """This rank's accelerator (DeepSpeed's choice: cuda:LOCAL_RANK on GPUs, else cpu)."""
    return torch.device(get_accelerator().current_device_name())


def _load(model, config, groups, parts) -> None:
    """The checkpoint's tensors into this rank's model: `parts(wanted)` gives them a part at a time."""
    wanted = names_to_load(model, config.num_layers)
    load_parts(model, parts(wanted), config, groups)


@torch.no_grad()
def _losses(config, groups, parts, batches, device, token_sums: bool = False) -> list[torch.Tensor]:
    """Each micro-batch's loss, the mean over its tokens or (`token_sums`) their sum, through the training
    runtime's forward-only pass over this rank's stages (one stage at PP = 1), on the rank holding the last
    stage."""
    model = loaded_model(config, groups, parts, device)
    objective = LanguageModeling(groups, config.vocab_size, per_token=token_sums)
    scale = torch.ones((), device=device) if token_sums else None
    moved = [to_device(batch, device) for batch in batches]
    return forward_only(model, groups, device, [ids for ids, _ in moved],
                        lambda mb, logits: objective.loss(logits, moved[mb][1], scale).float())


def script_main(argv: Optional[list[str]], build, work) -> int:
    """A launch script's entry (evaluate.py, generate.py): its flags (`build()`'s parser), the safe load, then
    `work(args)`, whose JSON result rank 0 prints (and appends to --log-json where the script has it); a user's
    mistake is one message and exit status 2."""
    owned = not dist.is_initialized()
    try:
        args = build().parse_args(argv)
        install_safe_torch_load(args.allow_unsafe_checkpoint_load)
        result = work(args)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
            if getattr(args, "log_json", None):
                with open(args.log_json, "a") as f:
                    f.write(json.dumps(result) + "\n")
        code = 0
    except ConfigError as e:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        code = 2
    end_distributed(owned, clean=code == 0)
    return code


def main(argv: Optional[list[str]] = None) -> int:
    return script_main(argv, build_parser, evaluate)
