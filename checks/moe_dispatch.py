"""One MoE layer's host reads of the device in forward + backward (what a CUDA run waits for), dropless, with a
capacity and padded to it, beside each one's tokens per second; on CUDA torch's own count of synchronisations.
Shared by benchmarks/bench_moe.py (its dispatch figures) and the GPU check (checks/gpu_paths.py)."""

from __future__ import annotations

import time

import torch

from checks.host_reads import HostReads

BASE = dict(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=4096, max_position_embeddings=512,
            position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
            untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0)
EXPERTS, TOPK, EXPERT_FFN = 8, 2, 256


def timed(fn, repeats: int, device) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def moe_layer_and_step(tokens: int, device, dtype, **fields):
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
        layer, _, step = moe_layer_and_step(tokens, device, dtype, moe_grouped_gemm=True, **fields)
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
        seconds = timed(step, repeats, device)
        out[name] = dict(row, seconds=seconds, tokens_per_s=tokens / seconds)
    out["padded_over_capacity"] = out["capacity"]["seconds"] / out["capacity_padded"]["seconds"]
    return out
