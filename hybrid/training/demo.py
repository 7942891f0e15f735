"""What a run leaves to look at: its final checkpoint exported to HuggingFace format (--export-hf)
and a short text generated from that export by `transformers` (--sample-prompt). The main job on
the embedded corpus does both by default (see hybrid.config's demo defaults)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hybrid.checkpoint.files import atomic_directory
from hybrid.conversion.checkpoint_util import build_parser, convert
from hybrid.training.logging import log


def export_hf(save_dir: str, export_dir: str) -> None:
    """The latest checkpoint in `save_dir` -> a HuggingFace directory, replacing an older export only
    once the new one is complete (hybrid.checkpoint.files.atomic_directory)."""
    with atomic_directory(export_dir, replace=True, flag="--export-hf") as fresh:
        convert(build_parser().parse_args(["--load-dir", save_dir, "--save-dir", fresh, "--hf-convert",
                                           "--no-progress-bar"]))
    log(f"exported {save_dir} to HuggingFace format in {export_dir} "
        f"(AutoModelForCausalLM.from_pretrained({export_dir!r}))")


def sample(export_dir: str, prompt: str, seed: int, max_new_tokens: int = 48, chat: bool = False) -> str:
    """A continuation of `prompt` by transformers' generate() on the exported model (top-k sampling),
    kept within the model's positions (the prompt is cut from the left if it alone would fill them);
    `chat`: the answer to `prompt` as a user turn, through the export's chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # only for the sample: its import takes seconds
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    model = AutoModelForCausalLM.from_pretrained(export_dir).eval()
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    positions = max_positions(model.config)
    if positions is not None:
        ids = ids[:, -max(1, positions // 2):] if ids.size(1) >= positions else ids
        max_new_tokens = max(0, min(max_new_tokens, positions - ids.size(1)))
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8,
                             pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.size(1):], skip_special_tokens=True)


def max_positions(config):
    """The longest sequence the model takes (learned position tables end there), or None."""
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


EXPORT_FAILED = 3  # the run's exit status when training and its checkpoint are complete but export/sample failed


def finish(run) -> int:
    """After training: rank 0 exports and samples while the other ranks wait. This step is optional: a
    failure is one line (the checkpoint stays as saved) and the exit status EXPORT_FAILED, never a crash
    that takes the other ranks down. Returns the exit status."""
    c = run.checkpoint
    if not c.export_hf:
        return 0
    if dist.is_initialized():
        dist.barrier()
    status = 0
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        try:
            export_hf(c.save, c.export_hf)
            if c.sample_prompt:
                if run.data.chat is not None:  # --sft: an answer through the export's chat template
                    text = sample(c.export_hf, c.sample_prompt, run.training.seed, 96, chat=True)
                    log(f"chat sample (transformers, apply_chat_template + generate, from {c.export_hf}):\n"
                        f"user: {c.sample_prompt}\nassistant: {text}")
                else:
                    text = sample(c.export_hf, c.sample_prompt, run.training.seed)
                    log(f"sample (transformers, from {c.export_hf}):\n{c.sample_prompt}{text}")
        except Exception as error:  # optional: report it, keep the run's result
            reason = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            log(f"WARNING: the HuggingFace export or sample after training failed ({reason}); the checkpoint in "
                f"{c.save} is complete (convert it with conversion/checkpoint_util.py --hf-convert); exit status "
                f"{EXPORT_FAILED}")
            status = EXPORT_FAILED
    if dist.is_initialized():
        dist.barrier()
    return status
