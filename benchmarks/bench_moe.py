"""Mixture of experts measured, every figure against a baseline of the same run; JSON to stdout (and --out).

    python benchmarks/bench_moe.py [--tokens 4096] [--repeats 5] [--out benchmarks/results/moe_cpu.json]

1. Experts: one MoE layer's forward + backward (E experts, top-k, dropless) with the grouped GEMM
   (torch._grouped_mm, --moe-grouped-gemm) against the per-expert loop (Megatron's SequentialMLP),
   tokens per second of each and their ratio; also the outputs' largest difference (they must agree).
2. Dispatch: the host reads of the device one MoE layer's forward + backward makes (the values a CUDA
   run must wait for), dropless, with a capacity (factor 1.0) and padded to that capacity
   (--moe-pad-expert-input-to-capacity), with each one's tokens per second; on CUDA torch's own count
   of synchronisations (torch.cuda.set_sync_debug_mode) beside it.
3. Models: training tokens per second (forward, backward, AdamW step; one rank, fp32 on CPU, bf16 on
   CUDA) of an MoE model against a dense model with the same active parameters per token (the dense
   MLP as wide as k experts), and against the dense model with the MoE's total parameters.
Runs on whatever device torch finds (CUDA first); the device is in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from checks.moe_dispatch import (BASE, EXPERT_FFN, EXPERTS, TOPK, dispatch_benchmark,  # noqa: E402
                                 moe_layer_and_step, timed)


def experts_benchmark(tokens: int, repeats: int, device, dtype) -> dict:
    out = {}
    results = {}
    for grouped in (False, True):
        layer, x, step = moe_layer_and_step(tokens, device, dtype, moe_grouped_gemm=grouped)
        seconds = timed(step, repeats, device)
        results[grouped] = layer(x).detach().float()
        ran_grouped = bool(layer.grouped_gemm) if grouped else False
        out["grouped_gemm" if grouped else "per_expert_loop"] = {"seconds": seconds, "tokens_per_s": tokens / seconds,
                                                                 "ran_grouped": ran_grouped}
    out["grouped_over_loop"] = out["per_expert_loop"]["seconds"] / out["grouped_gemm"]["seconds"]
    out["max_abs_difference"] = (results[True] - results[False]).abs().max().item()
    return out


def model_benchmark(tokens: int, repeats: int, device, dtype) -> dict:
    from hybrid.model.config import ModelConfig
    from hybrid.model.gpt import GPTModel
    seq, batch = 256, max(1, tokens // 256)
    ids = torch.randint(0, BASE["vocab_size"], (batch, seq + 1), generator=torch.Generator().manual_seed(1)).to(device)
    variants = {
        "moe": dict(num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN, moe_grouped_gemm=True),
        "dense_same_active": dict(ffn_hidden_size=TOPK * EXPERT_FFN),  # the FLOPs per token of k experts
        "dense_same_total": dict(ffn_hidden_size=EXPERTS * EXPERT_FFN),  # the parameters of all experts
    }
    out = {}
    for name, fields in variants.items():
        model = GPTModel(ModelConfig(**BASE, **fields)).to(device, dtype).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            optimizer.zero_grad(set_to_none=True)
            model(ids[:, :-1], ids[:, 1:]).backward()
            optimizer.step()
        seconds = timed(step, repeats, device)
        out[name] = {"seconds_per_step": seconds, "tokens_per_s": batch * seq / seconds,
                     "parameters": sum(p.numel() for p in model.parameters())}
    out["moe_over_dense_same_active"] = out["moe"]["tokens_per_s"] / out["dense_same_active"]["tokens_per_s"]
    out["moe_over_dense_same_total"] = out["moe"]["tokens_per_s"] / out["dense_same_total"]["tokens_per_s"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
              "threads": torch.get_num_threads(), "experts": EXPERTS, "topk": TOPK, "expert_ffn": EXPERT_FFN,
              "hidden": BASE["hidden_size"], "tokens": args.tokens,
              "layer": experts_benchmark(args.tokens, args.repeats, device, dtype),
              "dispatch": dispatch_benchmark(args.tokens, args.repeats, device, dtype),
              "model": model_benchmark(args.tokens, args.repeats, device, dtype)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
