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
import time

import torch
from torch.overrides import TorchFunctionMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BASE = dict(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=4096, max_position_embeddings=512,
            position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
            untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0)
EXPERTS, TOPK, EXPERT_FFN = 8, 2, 256


def _time(fn, repeats: int, device) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


class HostReads(TorchFunctionMode):
    """Records the torch calls that read a tensor's values on the host (on CUDA each waits for the device):
    item / tolist / bool / int / float / index conversions, .cpu() / .numpy(), the ops whose output shape
    depends on values (nonzero, masked_select, unique, boolean-mask indexing, repeat_interleave without
    output_size) and bincount (which reads its largest index). A CPU run counts what a CUDA run would wait on."""

    ALWAYS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
              "masked_select", "unique", "unique_consecutive", "argwhere", "bincount"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in self.ALWAYS:
            self.reads.append(name)
        elif name == "__getitem__" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                           for i in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            self.reads.append("boolean mask")
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) > 1 \
                and isinstance(args[1], torch.Tensor):
            self.reads.append("repeat_interleave")
        return func(*args, **kwargs)


def _moe_layer_and_step(tokens: int, device, dtype, **fields):
    """One MoE layer of the benchmark's shape, its input and a training step (forward + backward)."""
    from hybrid.model.config import ModelConfig
    from hybrid.model.mlp import build_moe
    from hybrid.parallel.groups import ParallelGroups
    config = ModelConfig(**BASE, num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN, **fields)
    layer = build_moe(config, ParallelGroups.single(), "layers.0.mlp").to(device, dtype)
    torch.manual_seed(0)
    x = torch.randn(tokens // 4, 4, BASE["hidden_size"], device=device, dtype=dtype)

    def step():
        layer.zero_grad(set_to_none=True)
        layer(x).float().square().mean().backward()
    return layer, x, step


def dispatch_benchmark(tokens: int, repeats: int, device, dtype) -> dict:
    out = {}
    variants = {"dropless": {}, "capacity": dict(moe_expert_capacity_factor=1.0),
                "capacity_padded": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)}
    for name, fields in variants.items():
        layer, _, step = _moe_layer_and_step(tokens, device, dtype, moe_grouped_gemm=True, **fields)
        step()
        with HostReads() as recorder:
            step()
        row = {"host_reads": len(recorder.reads), "what": sorted(set(recorder.reads)),
               "ran_grouped": bool(layer.grouped_gemm)}
        if device.type == "cuda":
            import warnings
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step()
            torch.cuda.set_sync_debug_mode(0)
            row["cuda_synchronisations"] = len(caught)
        seconds = _time(step, repeats, device)
        out[name] = dict(row, seconds=seconds, tokens_per_s=tokens / seconds)
    out["padded_over_capacity"] = out["capacity"]["seconds"] / out["capacity_padded"]["seconds"]
    return out


def experts_benchmark(tokens: int, repeats: int, device, dtype) -> dict:
    out = {}
    results = {}
    for grouped in (False, True):
        layer, x, step = _moe_layer_and_step(tokens, device, dtype, moe_grouped_gemm=grouped)
        seconds = _time(step, repeats, device)
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
        seconds = _time(step, repeats, device)
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
