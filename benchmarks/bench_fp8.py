"""FP8 (hybrid.parallel.fp8 on torchao's casts) against the high precision, every figure against a baseline of
the same run; JSON to stdout (and --out).

    python benchmarks/bench_fp8.py                          # CPU: the emulated loss gap only
    python benchmarks/bench_fp8.py --preset gpu --out r.json # one H100/H200: speed, memory and the loss gap

1. Linear layers (GPU only): a Llama-3-8B layer's four GEMM shapes (QKV 4096 -> 6144, output 4096 -> 4096,
   fc1 4096 -> 2 x 14336, fc2 14336 -> 4096) forward + backward on 8192 tokens through the column/row
   layers, FP8 (each recipe) against bf16: tokens per second, their ratio (target 1.3x).
2. Whole step (GPU only): a stack of Llama-3-8B-shaped layers (--layers, default 4) forward + backward +
   AdamW, FP8 against bf16: tokens per second, ratio (target 1.15x), peak memory of each.
3. Loss gap: a small Llama trained --steps steps on the embedded corpus, FP8 (each recipe) against the
   high precision (bf16 on GPUs, fp32 on CPU, where torchao emulates the FP8 GEMMs): the last 20 steps' mean
   loss of each and their relative difference (target within 1%).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LLAMA3_8B = dict(hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
                 position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                 untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
                 rotary_base=500000.0)
SMALL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=704,
             position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
             untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0)
RECIPES = ("tensorwise", "rowwise", "delayed")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, repeats: int, device) -> float:
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / repeats


def linear_layers(tokens: int, repeats: int, device) -> dict:
    """The four GEMMs of a Llama-3-8B layer, forward + backward, FP8 against bf16 (tokens per second)."""
    from hybrid.model.config import ModelConfig
    from hybrid.parallel.fp8 import gemm_for
    from hybrid.parallel.groups import ParallelGroups
    from hybrid.parallel.layers import ColumnParallelLinear, RowParallelLinear
    groups, out = ParallelGroups.single(), {}
    shapes = [("qkv", 4096, 6144, "column", [(0, 512), (1, 128), (2, 128)] * 8), ("dense", 4096, 4096, "row", None),
              ("fc1", 4096, 2 * 14336, "column", [(0, 14336), (1, 14336)]), ("fc2", 14336, 4096, "row", None)]
    for recipe in (None, *RECIPES):
        config = ModelConfig(num_layers=1, **LLAMA3_8B, fp8_recipe=recipe)
        layers = []
        for name, n_in, n_out, kind, segments in shapes:
            fp8 = gemm_for(config, groups, "layers.0.x", kind, segments) if recipe else None
            cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
            layer = cls(n_in, n_out, groups, torch.nn.init.normal_, bias=False, fp8=fp8)
            layers.append((layer.to(device, torch.bfloat16),
                           torch.randn(tokens, 1, n_in, device=device, dtype=torch.bfloat16, requires_grad=True)))

        def step():
            for layer, x in layers:
                y = layer(x)
                (y[0] if isinstance(y, tuple) else y).float().square().mean().backward()
        seconds = _timed(step, repeats, device)
        out[recipe or "bf16"] = {"tokens_per_s": tokens / seconds}
    for recipe in RECIPES:
        out[recipe]["speedup_vs_bf16"] = out[recipe]["tokens_per_s"] / out["bf16"]["tokens_per_s"]
    return out


def whole_step(num_layers: int, seq: int, batch: int, repeats: int, device) -> dict:
    """A stack of Llama-3-8B layers (vocabulary 32000) forward + backward + AdamW, FP8 against bf16."""
    from hybrid.model.config import ModelConfig
    from hybrid.model.gpt import GPTModel
    out = {}
    for recipe in (None, "tensorwise", "delayed"):
        config = ModelConfig(num_layers=num_layers, vocab_size=32000, max_position_embeddings=seq, **LLAMA3_8B,
                             fp8_recipe=recipe)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = GPTModel(config).to(device, torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        ids = torch.randint(0, 32000, (batch, seq), device=device)

        def step():
            model(ids, ids).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        seconds = _timed(step, repeats, device)
        out[recipe or "bf16"] = {"tokens_per_s": batch * seq / seconds,
                                 "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        del model, optimizer
    for recipe in ("tensorwise", "delayed"):
        out[recipe]["speedup_vs_bf16"] = out[recipe]["tokens_per_s"] / out["bf16"]["tokens_per_s"]
    return out


def loss_gap(steps: int, device, dtype) -> dict:
    """A small Llama on the embedded corpus, FP8 (each recipe) against the high precision: the mean of the
    last 20 steps' losses and the relative gap."""
    import numpy as np

    from hybrid.data import default as default_data
    from hybrid.data.tokenizer import GPT2BPETokenizer
    from hybrid.model.config import ModelConfig
    from hybrid.model.gpt import GPTModel
    from hybrid.parallel.fp8 import end_iteration
    tokenizer = GPT2BPETokenizer(str(default_data.VOCAB), str(default_data.MERGES))
    text = " ".join(default_data.read_corpus()[:300])
    tokens = torch.tensor(np.array(tokenizer.tokenize(text)[: 64 * 1024]), dtype=torch.long)
    seq, batch = 128, 8
    windows = tokens[: (tokens.numel() // (seq + 1)) * (seq + 1)].view(-1, seq + 1)
    out = {}
    for recipe in (None, *RECIPES):
        torch.manual_seed(0)
        config = ModelConfig(**SMALL, vocab_size=tokenizer.vocab_size, max_position_embeddings=seq, fp8_recipe=recipe)
        model = GPTModel(config).to(device, dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(steps):
            rows = windows[(step * batch) % (windows.size(0) - batch):][:batch].to(device)
            loss = model(rows[:, :-1], rows[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            end_iteration(model, None)
            losses.append(loss.item())
        out[recipe or "high_precision"] = {"last_20_mean_loss": sum(losses[-20:]) / 20}
    base = out["high_precision"]["last_20_mean_loss"]
    for recipe in RECIPES:
        out[recipe]["relative_gap"] = out[recipe]["last_20_mean_loss"] / base - 1
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=["cpu", "gpu"], default="gpu" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=None, help="loss-gap training steps (cpu 60, gpu 200)")
    p.add_argument("--layers", type=int, default=4, help="Llama-3-8B layers in the whole-step benchmark")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    if device.type == "cuda":
        from hybrid.parallel.fp8 import check_device
        check_device(device)
        result["linear_layers"] = linear_layers(8192, a.repeats, device)
        result["whole_step"] = whole_step(a.layers, 4096, 1, a.repeats, device)
        result["loss_gap"] = loss_gap(a.steps or 200, device, torch.bfloat16)
    else:
        result["note"] = ("CPU: torchao emulates the FP8 GEMMs (dequantize, then an fp32 matmul), so only the loss "
                          "gap is measured; speed and memory wait for a GPU with FP8 units")
        result["loss_gap"] = loss_gap(a.steps or 60, device, torch.float32)
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
