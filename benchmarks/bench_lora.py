"""A LoRA iteration against full fine-tuning and against transformers + peft, on one device, as JSON.

    python benchmarks/bench_lora.py [--rank 16] [--layers 4 --hidden 512 --seq 256 --batch 8]

The same Llama-shaped model (GQA, SwiGLU, untied head) and batch for four variants, each stepping AdamW (lr 1e-4,
weight decay 0.01, clipping 1.0, no dropout): hybrid's own training step (the Trainer's, on a one-rank DeepSpeed
engine) with full fine-tuning and with --lora-rank R on every projection (all-linear, the base frozen), and
transformers' LlamaForCausalLM with full fine-tuning and with peft's get_peft_model (the same adapters) and
torch.optim.AdamW. Variants alternate in short rounds after warm-up (the order flipping each round); each figure is the
median step time, and every ratio is against a variant measured in the same run. Writes
benchmarks/results/lora_cpu.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_vs_transformers import HybridStep, TransformersStep, _device, _timed  # noqa: E402


class PeftStep(TransformersStep):
    """transformers' model with peft's LoRA on every projection, torch AdamW over the adapters."""

    def __init__(self, c: dict, device: torch.device, rank: int):
        super().__init__(c, device, False)
        from peft import LoraConfig, get_peft_model
        self.model = get_peft_model(self.model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                           target_modules="all-linear")).train()
        self.forward = self.model
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4,
                                           weight_decay=0.01, fused=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "lora_cpu.json"))
    a = p.parse_args()
    os.environ.setdefault("HYBRID_VERBOSE", "")
    from hybrid.distributed import init_distributed
    from hybrid.training.run import _quiet_deepspeed
    init_distributed()
    _quiet_deepspeed()
    c = dict(name=f"llama-{a.layers}x{a.hidden}", family="llama", layers=a.layers, hidden=a.hidden,
             heads=a.hidden // 64, groups=max(1, a.hidden // 256), seq=a.seq, batch=a.batch, vocab=8192,
             ffn=int(a.hidden * 2.6875) // 8 * 8)
    device = _device()
    builders = {"hybrid_full": lambda: HybridStep(c, device, False),
                "hybrid_lora": lambda: HybridStep(c, device, False, ("--lora-rank", a.rank, "--lora-alpha", 2 * a.rank,
                                                                     "--lora-target-modules", "all-linear")),
                "transformers_full": lambda: TransformersStep(c, device, False),
                "transformers_peft": lambda: PeftStep(c, device, a.rank)}
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"] + 1), generator=generator)
    batch = (ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device))
    steps, times = {}, {name: [] for name in builders}
    for name, build in builders.items():
        steps[name] = build()
        for _ in range(2):  # warm-up: optimizer state, allocator
            steps[name](batch)
    names = list(builders)
    for round_index in range(a.rounds):
        for name in (names if round_index % 2 == 0 else names[::-1]):
            times[name].append(_timed(steps[name], batch, a.steps, device))
    results = {name: {"step_ms": statistics.median(t) * 1e3,
                      "tokens_per_s": c["batch"] * c["seq"] / statistics.median(t)} for name, t in times.items()}
    trainable = {"hybrid_lora": sum(p.numel() for p in steps["hybrid_lora"].engine.module.parameters()
                                    if p.requires_grad),
                 "transformers_peft": sum(p.numel() for p in steps["transformers_peft"].model.parameters()
                                          if p.requires_grad)}
    speed = {name: r["tokens_per_s"] for name, r in results.items()}
    report = {"benchmark": "lora_cpu" if device.type == "cpu" else "lora_cuda", "config": c, "rank": a.rank,
              "results": results, "trainable_parameters": trainable,
              "ratios": {"hybrid_lora_vs_hybrid_full": speed["hybrid_lora"] / speed["hybrid_full"],
                         "hybrid_lora_vs_transformers_peft": speed["hybrid_lora"] / speed["transformers_peft"],
                         "transformers_peft_vs_transformers_full": speed["transformers_peft"]
                         / speed["transformers_full"]}}
    assert trainable["hybrid_lora"] == trainable["transformers_peft"], trainable  # the same adapters
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
