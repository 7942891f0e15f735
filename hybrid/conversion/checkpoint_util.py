"""One converter for every direction: hybrid <-> HuggingFace, and hybrid TP x PP resharding.

Megatron-LM's checkpoint_util flags; --hf-convert is shorthand for --saver hf. Everything runs in
one CPU process: the full model is assembled once (about one copy of the weights), then written
shard by shard.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Optional

from tqdm import tqdm

from hybrid.conversion import peft
from hybrid.conversion.hf import write_hf_dir
from hybrid.conversion.layout import check_target_layout, resolve_tag, write_hybrid
from hybrid.conversion.megatron.universal import write_universal
from hybrid.conversion.megatron.write import write_megatron
from hybrid.conversion.source import HF, HYBRID, MEGATRON_KINDS, MEGATRON_LM, checkpoint_kind, open_source
from hybrid.conversion.universal import to_universal
from hybrid.data.tokenizer import GPT2BPETokenizer, HFTokenizer
from hybrid.errors import ConfigError
from hybrid.flags import FlagParser
from hybrid.model.lora import NO_LORA
from hybrid.safe_loading import install_safe_torch_load


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(description="Convert checkpoints: hybrid <-> HuggingFace, and between TP/PP layouts.",
                allow_abbrev=False)
    p.add_argument("--model-type", default="GPT", choices=["GPT"])
    p.add_argument("--loader", default="hybrid", type=_format_alias,
                   choices=["hybrid", "hf", "megatron"],
                   help="hybrid: a launch/train.py checkpoint; megatron (aliases mcore, core, legacy, "
                        "megatron_deepspeed): a Megatron-LM checkpoint, --ckpt-format torch or torch_dist, or a "
                        "Megatron-DeepSpeed one, any TP/PP (a launch/train.py checkpoint is read as hybrid); hf "
                        "(aliases llama_mistral, llama2_hf, loader_llama2_hf): a transformers directory")
    p.add_argument("--saver", default="hybrid", type=_format_alias,
                   choices=["hybrid", "hf", "universal", "megatron", "peft"],
                   help="hybrid: weights at --target-*-parallel-size; hf: a transformers directory (a LoRA run's "
                        "adapters merged into the weights, as PEFT's merge_and_unload); peft: a LoRA run's adapters as "
                        "a PEFT adapter directory (PeftModel.from_pretrained loads it on the base model); universal: "
                        "DeepSpeed's universal checkpoint of --load-dir's last checkpoint, written beside it (with "
                        "optimizer state; launch/train.py --load DIR --universal-checkpoint resumes it at any layout), "
                        "or with --loader megatron of a Megatron-LM checkpoint's weights and Adam state, in "
                        "--save-dir; megatron: a Megatron-LM checkpoint (--ckpt-format torch) at --target-*")
    p.add_argument("--ckpt-format", default="torch", choices=["torch", "torch_dist"],
                   help="with --saver megatron: the legacy per-rank files (torch), or megatron-core's distributed "
                        "checkpoint (torch_dist; global tensors, which Megatron-LM loads at any TP / PP / EP)")
    p.add_argument("--true-vocab-size", type=int, default=None,
                   help="with --loader megatron: the tokenizer's vocabulary; the embedding's padding rows beyond it "
                        "are dropped (default: every row the checkpoint has, as Megatron's logits have)")
    p.add_argument("--checkpoint-type", default=None, choices=["hf", "meta"],
                   help="with a Llama loader: hf (a transformers directory); meta (raw weights) is refused")
    p.add_argument("--model-size", default=None, help="accepted: the model's shape is read from its config")
    p.add_argument("--megatron-path", default=None, help="accepted: no Megatron-LM checkout is needed")
    p.add_argument("--max-queue-size", type=int, default=None, help="accepted: no loader/saver queue is used")
    p.add_argument("--loader-transformer-impl", "--saver-transformer-impl", dest="transformer_impl", default=None,
                   choices=["local", "transformer_engine"], help="accepted: parameter names are hybrid's own")
    p.add_argument("--bf16", "--fp16", dest="half", action="store_true",
                   help="accepted: tensors keep the source's precision; training casts per its own flags")
    p.add_argument("--hf-convert", action="store_true", help="shorthand for --saver hf")
    p.add_argument("--load-dir", required=True)
    p.add_argument("--save-dir", default=None,
                   help="output directory (with --saver universal: only for --loader megatron)")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--target-expert-parallel-size", type=int, default=1,
                   help="with --saver megatron: the EP of the files written (the legacy format: one file per EP rank)")
    p.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json, exported with the model")
    p.add_argument("--merge-file", default=None, help="GPT-2 merges.txt, exported with the model")
    p.add_argument("--tokenizer-model", default=None, help="a local HF tokenizer directory to export")
    p.add_argument("--max-shard-size", default="5GB", help="safetensors shard size for HF output")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                   help="vocabulary padding of the hybrid output (default: the source's, or 128)")
    p.add_argument("--no-progress-bar", action="store_true")
    p.add_argument("--allow-unsafe-checkpoint-load", action="store_true",
                   help="UNSAFE: unpickle input files fully (runs any code they hold); only for files you trust")
    return p


def _format_alias(value: str) -> str:
    """Megatron-LM's loader/saver names -> ours."""
    if value in ("megatron", "mcore", "core", "legacy", "megatron_deepspeed", "megatron-deepspeed"):
        return "megatron"
    if value in ("llama_mistral", "llama2_hf", "loader_llama2_hf", "llama2"):
        return "hf"
    return value


def _progress(enabled: bool, what: str):
    if not enabled:
        return None

    def wrap(items):
        return tqdm(items, desc=what, unit="tensor" if what != "shards" else "file", file=sys.stderr)
    return wrap


def _tokenizer(args, saved_args: dict):
    """The tokenizer to ship with an HF export: flags first, else the one the run trained with."""
    vocab, merges = args.vocab_file or saved_args.get("vocab_file"), args.merge_file or saved_args.get("merge_file")
    model_dir = args.tokenizer_model or saved_args.get("tokenizer_model")
    if model_dir and os.path.isfile(model_dir):  # a SentencePiece .model: transformers' Llama tokenizer
        from transformers import LlamaTokenizer  # transformers' import takes seconds: only here
        return LlamaTokenizer(vocab_file=model_dir, legacy=False)
    if args.tokenizer_model or (model_dir and not (args.vocab_file or args.merge_file)):
        return HFTokenizer(model_dir).to_transformers()
    if vocab and merges:
        return GPT2BPETokenizer(vocab, merges).to_transformers()
    if not saved_args or saved_args.get("tokenizer_type") == "NullTokenizer":
        return None
    from hybrid.data import default as default_data  # the run trained with the embedded tokenizer
    return GPT2BPETokenizer(str(default_data.VOCAB), str(default_data.MERGES)).to_transformers()


def convert(args) -> str:
    if args.checkpoint_type == "meta":
        raise ConfigError("--checkpoint-type meta: Meta's raw Llama weights are not read; convert them to a "
                          "transformers directory first (transformers' convert_llama_weights_to_hf), then use "
                          "--loader hf (or llama_mistral) --checkpoint-type hf.")
    saver = "hf" if args.hf_convert else args.saver
    loader = args.loader
    found = checkpoint_kind(args.load_dir) if loader == "megatron" else None
    if loader == "megatron" and found == HYBRID:
        loader = "hybrid"  # a launch/train.py checkpoint named with Megatron's loader name (as before)
    if saver == "universal":
        return _universal(argparse.Namespace(**dict(vars(args), loader=loader)))
    if not args.save_dir:
        raise ConfigError(f"--saver {saver} needs --save-dir DIR.")
    show = not args.no_progress_bar
    tp, pp = args.target_tensor_parallel_size, args.target_pipeline_parallel_size
    kind = {"hf": HF, "hybrid": HYBRID}.get(loader) or (found if found in MEGATRON_KINDS else MEGATRON_LM)
    source = open_source(args.load_dir, "--load-dir", kind)
    config = source.config(args.true_vocab_size)
    state = source.state(config, _progress(show, "shards" if kind == HF else "reading"))
    client_state = source.client_state()
    if args.make_vocab_size_divisible_by:
        config.make_vocab_size_divisible_by = args.make_vocab_size_divisible_by
    if saver == "peft":
        if not config.lora_rank:
            raise ConfigError(f"--saver peft: {args.load_dir} holds no LoRA adapters (a run without --lora-rank); "
                              f"use --saver hf for its weights.")
        base = client_state.args.get("load_hf") or "(the base model)"
        peft.check_peft_named(config, "--saver peft")
        peft.write_adapter(state, config, args.save_dir, base)
        return f"wrote PEFT adapter (rank {config.lora_rank}) of base model {base} to {args.save_dir}"
    if config.lora_rank and saver in ("hf", "megatron"):  # the adapters merged into the weights
        state = peft.merged(state, config)
        config = dataclasses.replace(config, **NO_LORA)
    if saver == "hf":
        tokenizer = _tokenizer(args, client_state.args)
        write_hf_dir(state, config, args.save_dir, tokenizer, args.max_shard_size, _progress(show, "writing"))
        return f"wrote HuggingFace model to {args.save_dir}"
    check_target_layout(config, tp, pp)
    if saver == "megatron":
        ep = args.target_expert_parallel_size
        write_megatron(state, config, tp, pp, args.save_dir, client_state, args.ckpt_format, args.transformer_impl, ep)
        return (f"wrote Megatron-LM checkpoint (--ckpt-format {args.ckpt_format}, TP={tp}, PP={pp}"
                f"{f', EP={ep}' if ep > 1 else ''}) to {args.save_dir}")
    write_hybrid(state, config, tp, pp, args.save_dir, client_state, _progress(show, "writing"))
    return f"wrote hybrid checkpoint (TP={tp}, PP={pp}) to {args.save_dir}"


def _universal(args) -> str:
    """Universal checkpoint of --load-dir's latest checkpoint, beside it (DeepSpeed's layout); of a
    Megatron-LM checkpoint (its weights and Adam state), in --save-dir."""
    kind = checkpoint_kind(args.load_dir) if args.loader == "megatron" else None
    if kind in MEGATRON_KINDS:
        if not args.save_dir:
            raise ConfigError("--loader megatron --saver universal needs --save-dir DIR (the universal checkpoint's "
                              "directory; launch/train.py --load DIR --universal-checkpoint resumes it).")
        source = open_source(args.load_dir, "--load-dir", kind)
        tag = write_universal(source, source.config(args.true_vocab_size), args.save_dir,
                              log=lambda m: print(m, file=sys.stderr))
        return (f"wrote universal checkpoint {os.path.join(args.save_dir, tag)}; resume it with launch/train.py --load "
                f"{args.save_dir} --universal-checkpoint")
    if args.loader != "hybrid" or args.save_dir:
        raise ConfigError("--saver universal converts a launch/train.py checkpoint in place (--load-dir DIR, no "
                          "--save-dir): the universal checkpoint is written beside it as DIR/<tag>_universal.")
    tag = to_universal(args.load_dir, resolve_tag(args.load_dir), log=lambda m: print(m, file=sys.stderr))
    return f"wrote universal checkpoint {os.path.join(args.load_dir, tag)} ('latest_universal' points at it)"


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        install_safe_torch_load(args.allow_unsafe_checkpoint_load)
        print(convert(args), file=sys.stderr)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
