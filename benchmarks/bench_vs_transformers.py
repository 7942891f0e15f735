"""hybrid against plain transformers on one device: tokens/s, model TFLOP/s, MFU, peak memory, as JSON.

    python benchmarks/bench_vs_transformers.py                      # CPU: GPT-2 and Llama 4 x 512, seq 256, fp32
    python benchmarks/bench_vs_transformers.py --preset gpu          # CUDA bf16: 4 Llama-3-8B-shaped layers
    python benchmarks/bench_vs_transformers.py --preset gpu_small    # CUDA bf16: GPT-2 350M and Llama 0.85B
    python benchmarks/bench_vs_transformers.py --chart out.png       # and a bar chart (needs matplotlib)

Same model dimensions, batch, optimizer (AdamW, lr 1e-4, weight decay 0.01), clipping (1.0) and no
dropout on both sides. hybrid runs its real training step (`launch/train.py`'s Trainer on a
DeepSpeed engine, ZeRO-0 on CPU / ZeRO-1 on CUDA); transformers runs GPT2LMHeadModel or
LlamaForCausalLM with SDPA and torch.optim.AdamW (fused, transformers' Trainer default; bf16 autocast on CUDA), eager
and under torch.compile. Variants alternate in short rounds after warm-up (the order flipping each
round: this machine's speed drifts by 10-20% over a minute); each figure is the median step time
over the measured rounds, and every ratio is against transformers measured in the same
run. TFLOP/s use Megatron-LM's formula for every variant (so their ratio is the tokens/s ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRESETS = {
    "cpu": [dict(name="gpt2-4x512", family="gpt2", layers=4, hidden=512, heads=4, seq=256, batch=8,
                 vocab=50257, ffn=2048),
            dict(name="gpt2-4x512-v8k", family="gpt2", layers=4, hidden=512, heads=4, seq=256, batch=8,
                 vocab=8192, ffn=2048),
            dict(name="gpt2-4x512-h8-v8k", family="gpt2", layers=4, hidden=512, heads=8, seq=256, batch=8,
                 vocab=8192, ffn=2048),
            dict(name="llama-4x512", family="llama", layers=4, hidden=512, heads=8, groups=8, seq=256, batch=8,
                 vocab=8192, ffn=1376)],
    # Llama-3-8B's layer shape (hidden 4096, 32 heads, 8 KV groups, FFN 14336, vocabulary 128256), 4 layers
    "gpu": [dict(name="llama3-8b-4-layers", family="llama", layers=4, hidden=4096, heads=32, groups=8, seq=4096,
                 batch=1, vocab=128256, ffn=14336)],
    "gpu_small": [dict(name="gpt2-350m", family="gpt2", layers=24, hidden=1024, heads=16, seq=1024, batch=8,
                       vocab=50257, ffn=4096),
                  dict(name="llama-0.85b", family="llama", layers=16, hidden=2048, heads=16, groups=4, seq=2048,
                       batch=4, vocab=32000, ffn=5632)],
}


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def hybrid_flags(c: dict, device: torch.device, compile_layers: bool) -> list[str]:
    flags = ["--num-layers", c["layers"], "--hidden-size", c["hidden"], "--num-attention-heads", c["heads"],
             "--ffn-hidden-size", c["ffn"], "--seq-length", c["seq"], "--max-position-embeddings", c["seq"],
             "--micro-batch-size", c["batch"], "--global-batch-size", c["batch"], "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", c["vocab"], "--lr", 1e-4, "--weight-decay", 0.01,
             "--clip-grad", 1.0, "--hidden-dropout", 0, "--attention-dropout", 0, "--train-iters", 1000,
             "--lr-decay-style", "constant", "--eval-iters", 0, "--no-progress-bar"]
    if c["family"] == "llama":
        flags += ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                  "--group-query-attention", "--num-query-groups", c["groups"], "--disable-bias-linear",
                  "--untie-embeddings-and-output-weights"]
    if device.type == "cuda":
        flags += ["--bf16", "--use-distributed-optimizer"]
    if compile_layers:
        flags += ["--torch-compile"]
    return [str(f) for f in flags]


class HybridStep:
    """hybrid's own training step (the Trainer's) on a one-rank DeepSpeed engine."""

    def __init__(self, c: dict, device: torch.device, compile_layers: bool, extra_flags: tuple = ()):
        from hybrid.config import build_run_config
        from hybrid.flags import build_parser
        from hybrid.parallel.random import model_parallel_seed
        from hybrid.parallel.groups import build_groups
        from hybrid.training.engine import build_engine
        from hybrid.training.loop import Trainer
        flags = hybrid_flags(c, device, compile_layers) + [str(f) for f in extra_flags]
        run = build_run_config(build_parser().parse_args(flags), 1, c["vocab"])
        topology = build_groups()
        model_parallel_seed(1234, 0)
        self.engine, _ = build_engine(run, topology)
        self.trainer = Trainer(run, topology, self.engine, (None, None, None))
        self.run, self.c = run, c

    def __call__(self, batch):
        ids, labels = batch
        return self.trainer.step.train(iter([(ids, labels)]))


class TransformersStep:
    """transformers' model, torch AdamW, clipping; bf16 autocast on CUDA; optionally compiled."""

    def __init__(self, c: dict, device: torch.device, compiled: bool):
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
        torch.manual_seed(1234)
        if c["family"] == "gpt2":
            config = GPT2Config(vocab_size=c["vocab"], n_positions=c["seq"], n_embd=c["hidden"], n_layer=c["layers"],
                                n_head=c["heads"], n_inner=c["ffn"], resid_pdrop=0.0, embd_pdrop=0.0,
                                attn_pdrop=0.0)
            model = GPT2LMHeadModel(config)
        else:
            config = LlamaConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["ffn"],
                                 num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                                 num_key_value_heads=c["groups"], max_position_embeddings=c["seq"])
            model = LlamaForCausalLM(config)
        model.config._attn_implementation = "sdpa"
        self.model = model.to(device).train()
        cuda = device.type == "cuda"
        # fused, as transformers' Trainer defaults to (adamw_torch_fused) and as hybrid picks
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
        self.forward = torch.compile(self.model) if compiled else self.model

    def __call__(self, batch):
        ids, labels = batch
        with self.autocast:
            logits = self.forward(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(step, batch, steps, device) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        loss = step(batch)
    float(loss)  # one host sync at the end, as a training loop that logs every `steps` iterations
    _sync(device)
    return (time.perf_counter() - start) / steps


def bench_config(c: dict, device: torch.device, variants: list[str], rounds: int, steps: int) -> dict:
    from hybrid.training.flops import flops_per_iteration
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"] + 1), generator=generator)
    batch = (ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device))
    builders = {"hybrid": lambda: HybridStep(c, device, False),
                "hybrid_compiled": lambda: HybridStep(c, device, True),
                "transformers_eager": lambda: TransformersStep(c, device, False),
                "transformers_compiled": lambda: TransformersStep(c, device, True)}
    steps_by_name, persistent, times, peaks = {}, {}, {name: [] for name in variants}, {}
    for name in variants:
        before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        steps_by_name[name] = builders[name]()
        for _ in range(3):  # warm-up: compilation, optimizer state, allocator
            steps_by_name[name](batch)
        _sync(device)
        persistent[name] = (torch.cuda.memory_allocated() - before) if device.type == "cuda" else 0
    for round_index in range(rounds):  # the order flips every round, so neither side always goes first
        for name in (variants if round_index % 2 == 0 else variants[::-1]):
            if device.type == "cuda":
                others = torch.cuda.memory_allocated() - persistent[name]
                torch.cuda.reset_peak_memory_stats()
            times[name].append(_timed(steps_by_name[name], batch, steps, device))
            if device.type == "cuda":
                peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated() - others)
    run = steps_by_name.get("hybrid") or steps_by_name.get("hybrid_compiled")
    flops = flops_per_iteration(run.run.model, c["batch"], c["seq"], run.run.model.padded_vocab_size(1))
    from hybrid.training.metrics import device_peak_tflops  # the one table of peaks (the run's MFU's)
    peak = device_peak_tflops(device, "bf16", False)
    out = {}
    for name in variants:
        seconds = statistics.median(times[name])
        tflops = flops / seconds / 1e12
        out[name] = {"tokens_per_s": c["batch"] * c["seq"] / seconds, "step_ms": seconds * 1e3,
                     "model_tflops": tflops, "mfu": tflops / peak if peak else None,
                     "peak_memory_gib": peaks[name] / 2**30 if name in peaks else None}
    ratios = {}
    for name in variants:
        for ref in ("transformers_eager", "transformers_compiled"):
            if ref in out and name.startswith("hybrid"):
                ratios[f"{name}_vs_{ref}"] = out[name]["tokens_per_s"] / out[ref]["tokens_per_s"]
    return {"config": c, "results": out, "ratios": ratios}


def chart(report: dict, path: str) -> None:
    """Bars of tokens/s per variant and config (PNG)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("chart skipped: pip install matplotlib", file=sys.stderr)
        return
    configs = report["configs"]
    fig, axes = plt.subplots(1, len(configs), figsize=(5 * len(configs), 4), squeeze=False)
    for ax, entry in zip(axes[0], configs):
        names = list(entry["results"])
        values = [entry["results"][n]["tokens_per_s"] / 1e3 for n in names]
        ax.bar(range(len(names)), values, color=["#3b7dd8" if n.startswith("hybrid") else "#999999" for n in names])
        ax.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=8)
        ax.set_ylabel("k tokens/s")
        ax.set_title(f"{entry['config']['name']} ({report['device']}, {report['precision']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=list(PRESETS), default=None, help="default: gpu on CUDA, else cpu")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=2, help="steps per round per variant")
    parser.add_argument("--variants", default="hybrid,transformers_eager",
                        help="comma-separated: hybrid, hybrid_compiled, transformers_eager, transformers_compiled")
    parser.add_argument("--configs", default=None, help="comma-separated config names of the preset (default: all)")
    parser.add_argument("--chart", default=None, help="write a PNG bar chart here")
    parser.add_argument("--json", default=None, help="also write the JSON report here")
    args = parser.parse_args()
    device = _device()
    os.environ.setdefault("HYBRID_VERBOSE", "")
    from hybrid.distributed import init_distributed
    init_distributed()
    from hybrid.training.run import _quiet_deepspeed
    _quiet_deepspeed()
    preset = args.preset or ("gpu" if device.type == "cuda" else "cpu")
    variants = args.variants.split(",")
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "precision": "bf16" if device.type == "cuda" else "fp32", "torch": torch.__version__,
              "configs": [bench_config(c, device, variants, args.rounds, args.steps) for c in PRESETS[preset]
                          if not args.configs or c["name"] in args.configs.split(",")]}
    text = json.dumps(report)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.chart:
        chart(report, args.chart)


if __name__ == "__main__":
    main()
