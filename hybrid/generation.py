"""launch/generate.py: complete a file of prompts with a checkpoint's (or a HuggingFace model's) own layers, at any
TP x PP x EP layout the model trains at (hybrid.model.generate); one JSON row per prompt.

    torchrun --nproc_per_node 2 launch/generate.py --load-hf DIR --tensor-model-parallel-size 2 \
        --prompts prompts.jsonl --max-new-tokens 64 --output out.jsonl [--temperature 0.7 --top-p 0.9 --seed 1]

Prompts (hybrid.data.prompts): `prompt` text or messages, or `messages`, rendered with the tokenizer's chat
template and its generation prompt. Rows are split over the data-parallel ranks (row k on rank k mod DP), in
batches of --batch-size, left-padded; each row's sampling generator is keyed by its row number, so the output
does not depend on the layout or the batch size. Output rows: prompt, completion, completion_ids, logprobs.
"""

from __future__ import annotations

import json
import time
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.data.prompts import read_prompts
from hybrid.data.tokenizer import HFTokenizer, end_ids
from hybrid.errors import ConfigError
from hybrid.evaluation import add_source_flags, layout_dims, loaded_model, open_checkpoint, rank_device, script_main
from hybrid.flags import FlagParser
from hybrid.model.generate import SamplingOptions, generate
from hybrid.parallel.groups import build_groups


def build_parser():
    p = FlagParser(description="Generate completions with a checkpoint's own layers at its training layout.",
                   allow_abbrev=False)
    add_source_flags(p)
    p.add_argument("--prompts", required=True, help="JSONL / Parquet rows with 'prompt' (text or messages) or "
                                                     "'messages'")
    p.add_argument("--output", required=True, help="JSON lines: prompt, completion, completion_ids, logprobs")
    p.add_argument("--tokenizer-model", default=None, help="HuggingFace tokenizer directory (default: --load-hf's)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (transformers' do_sample=False)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--stop", nargs="*", default=[], help="strings that end a completion (kept in it, as transformers)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together on each data-parallel rank")
    p.add_argument("--bf16", action="store_true", help="decode in bf16 (the weights cast once; default: fp32)")
    return p


def check_options(args) -> SamplingOptions:
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: give at least 1.")
    if args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature}: give 0 (greedy) or more.")
    if not 0.0 < args.top_p <= 1.0:
        raise ConfigError(f"--top-p {args.top_p}: give a value in (0, 1].")
    if args.top_k < 0 or args.batch_size < 1:
        raise ConfigError("--top-k takes 0 (off) or more, --batch-size at least 1.")
    return SamplingOptions(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed)


def stop_rule(tokenizer, stops: list):
    """stop(row, tokens): the completion's text, special tokens kept, holds one of the --stop strings (as
    transformers' `stop_strings` match <|im_end|>, <|eot_id|> or <end_of_turn> too)."""
    if not stops:
        return None
    return lambda row, tokens: holds_stop(tokenizer, tokens, stops)


def holds_stop(tokenizer, ids: list, stops: list) -> bool:
    """The completion's text (special tokens kept) holds a stop string: only its last tokens are decoded (a stop
    string of L characters lies within the last 4 L + 4 tokens, a character being at most 4 byte tokens)."""
    tail = ids[-(4 * max(len(s) for s in stops) + 4):]
    text = tokenizer.decode(tail, skip_special_tokens=False)
    return any(s in text for s in stops)


def run(args) -> dict:
    options = check_options(args)
    source = open_checkpoint(args)
    config = source.config
    path = args.tokenizer_model or args.load_hf
    if not path:
        raise ConfigError("generate.py needs the model's tokenizer: --tokenizer-model DIR (or --load-hf DIR).")
    tokenizer = HFTokenizer(path).to_transformers()
    prompts = read_prompts(args.prompts, tokenizer)
    eos = end_ids(tokenizer, args.load_hf, args.tokenizer_model)  # the model's generation config, then the tokenizer's
    pad = eos[0] if eos else 0
    options = SamplingOptions(**{**options.__dict__, "eos": eos, "pad": pad})
    if config.position_embedding_type == "learned_absolute":
        longest = max(len(p.ids) for p in prompts) + options.max_new_tokens
        if longest > config.max_position_embeddings:
            raise ConfigError(f"--max-new-tokens {options.max_new_tokens}: the longest prompt plus it is {longest} "
                              f"tokens, past the model's {config.max_position_embeddings} positions.")
    dims = layout_dims(source, args.expert_model_parallel_size)
    groups = build_groups(dims, experts=bool(config.num_experts))
    device = rank_device()
    model = loaded_model(config, groups, source.parts, device)
    if args.bf16:
        model = model.to(torch.bfloat16)
    dp, me = groups.dp.size, groups.dp.rank
    mine = [k for k in range(len(prompts)) if k % dp == me]
    # every rank of an expert group decodes the same number of batches (their experts meet in each step)
    batches = -(-len(range(0, len(prompts), dp)) // args.batch_size)
    rows, start, steps, new_tokens = [], time.perf_counter(), 0, 0
    for b in range(batches):
        keys = mine[b * args.batch_size:(b + 1) * args.batch_size]
        idle = not keys
        keys = keys or [mine[0] if mine else 0]
        out = generate(model, groups, [prompts[k].ids for k in keys], options, keys=keys, device=device,
                       stop=stop_rule(tokenizer, args.stop), sync=groups.ep if groups.ep.size > 1 else None)
        steps, new_tokens = steps + out.stats["steps"], new_tokens + (0 if idle else out.stats["new_tokens"])
        if not idle:
            rows += [{"index": k, "prompt": prompts[k].prompt,
                      "completion": tokenizer.decode(t, skip_special_tokens=True), "completion_ids": t, "logprobs": lp}
                     for k, t, lp in zip(keys, out.tokens, out.logprobs)]
    seconds = time.perf_counter() - start
    gathered = _gather_rows(rows, groups)
    if gathered is not None:
        with open(args.output, "w") as f:
            for row in sorted(gathered, key=lambda r: r["index"]):
                f.write(json.dumps({k: v for k, v in row.items() if k != "index"}) + "\n")
    return {"prompts": len(prompts), "new_tokens": new_tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(new_tokens / max(seconds, 1e-9), 1), "output": args.output}


def _gather_rows(rows: list, groups) -> Optional[list]:
    """Every data-parallel rank's rows on global rank 0 (from the ranks at TP 0 and the first pipeline stage,
    which hold the same rows as their TP and PP peers); None elsewhere."""
    if groups.tp.rank != 0 or groups.pp.rank != 0:
        return None
    if groups.dp.size == 1:
        return rows
    out = [None] * groups.dp.size if groups.dp.rank == 0 else None
    dist.gather_object(rows, out, group=groups.dp.group, group_dst=0)
    return None if out is None else [row for part in out for row in part]


def main(argv: Optional[list[str]] = None) -> int:
    return script_main(argv, build_parser, run)
