"""What a run leaves to look at: its final checkpoint exported to HuggingFace format (--export-hf)
and a short text generated from that export by `transformers` (--sample-prompt). The main job on
the embedded corpus does both by default (see hybrid.config's demo defaults)."""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from hybrid.training.logging import log


def export_hf(save_dir: str, export_dir: str) -> None:
    """The latest checkpoint in `save_dir` -> a HuggingFace directory, replacing an older export only
    once the new one is complete."""
    from hybrid.conversion.checkpoint_util import build_parser, convert
    fresh, old = export_dir.rstrip("/") + ".new", export_dir.rstrip("/") + ".old"
    for leftover in (fresh, old):
        shutil.rmtree(leftover, ignore_errors=True)
    convert(build_parser().parse_args(["--load-dir", save_dir, "--save-dir", fresh, "--hf-convert",
                                       "--no-progress-bar"]))
    if os.path.exists(export_dir):
        os.replace(export_dir, old)
    os.replace(fresh, export_dir)
    shutil.rmtree(old, ignore_errors=True)
    log(f"exported {save_dir} to HuggingFace format in {export_dir} "
        f"(AutoModelForCausalLM.from_pretrained({export_dir!r}))")


def sample(export_dir: str, prompt: str, seed: int, max_new_tokens: int = 48) -> str:
    """A continuation of `prompt` by transformers' generate() on the exported model (top-k sampling)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    model = AutoModelForCausalLM.from_pretrained(export_dir).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8,
                             pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.size(1):], skip_special_tokens=True)


def finish(run) -> None:
    """After training: rank 0 exports and samples while the other ranks wait."""
    t = run.train
    if not t.export_hf:
        return
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        export_hf(t.save, t.export_hf)
        if t.sample_prompt:
            text = sample(t.export_hf, t.sample_prompt, t.seed)
            log(f"sample (transformers, from {t.export_hf}):\n{t.sample_prompt}{text}")
    if dist.is_initialized():
        dist.barrier()
