"""The frontier families' blocks against transformers' own modules on the same shapes, one rank, one process:
forward + backward step time of DeepSeek-V3's multi-latent attention (hybrid.model.mla against DeepseekV3Attention),
DeepSeek's MoE (hybrid's MoE layer with group-limited sigmoid routing and a shared expert against DeepseekV3MoE) and
GPT-OSS's attention with sinks (hybrid.model.attention with hybrid.model.sinks against GptOssAttention), as JSON.

    python benchmarks/bench_frontier.py                 # CPU, fp32: benchmarks/results/frontier_cpu.json
    python benchmarks/bench_frontier.py --preset gpu    # CUDA, bf16

Both sides get the same input and an all-ones output gradient; transformers runs its default attention
(SDPA where the module allows it, eager for GPT-OSS's sinks, which its SDPA path does not take). The variants
alternate in rounds after warm-up, the order flipping each round (this machine's speed drifts); each figure is
the median over the rounds and every ratio is hybrid / transformers measured in the same run (below 1: faster).
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
    "cpu": dict(hidden=512, heads=8, seq=256, batch=2, q_rank=192, kv_rank=128, nope=64, rope=32, v=64, experts=16,
                topk=4, groups=4, group_topk=2, moe_ffn=256, kv_heads=2, head=64, dtype="float32", rounds=6),
    "gpu": dict(hidden=2048, heads=16, seq=4096, batch=1, q_rank=768, kv_rank=512, nope=128, rope=64, v=128,
                experts=64, topk=6, groups=8, group_topk=3, moe_ffn=1408, kv_heads=8, head=64, dtype="bfloat16",
                rounds=10),
}


def _timed(step, rounds: int) -> list[float]:
    return [step() for _ in range(rounds)]


def _step(module_call, x: torch.Tensor):
    """Seconds of one forward + backward (an all-ones gradient)."""
    def run() -> float:
        sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
        inp = x.detach().requires_grad_(True)
        sync()
        start = time.perf_counter()
        out = module_call(inp)
        out.backward(torch.ones_like(out))
        sync()
        return time.perf_counter() - start
    return run


def _compare(ours, theirs, rounds: int) -> dict:
    for f in (ours, theirs):  # warm-up
        f(), f()
    times = {"hybrid": [], "transformers": []}
    for r in range(rounds):
        order = [("hybrid", ours), ("transformers", theirs)]
        for name, f in (order if r % 2 == 0 else order[::-1]):
            times[name].append(f())
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"hybrid_ms": round(med["hybrid"] * 1e3, 3), "transformers_ms": round(med["transformers"] * 1e3, 3),
            "ratio": round(med["hybrid"] / med["transformers"], 3)}


def mla(p: dict, device, dtype) -> dict:
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    from hybrid.model.config import ModelConfig
    from hybrid.model.mla import MultiLatentAttention
    config = ModelConfig(num_layers=1, hidden_size=p["hidden"], num_attention_heads=p["heads"], vocab_size=128,
                         position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                         multi_latent_attention=True, qk_layernorm=True, q_lora_rank=p["q_rank"],
                         kv_lora_rank=p["kv_rank"], qk_head_dim=p["nope"], qk_pos_emb_head_dim=p["rope"],
                         v_head_dim=p["v"], hidden_dropout=0.0, attention_dropout=0.0)
    ours = MultiLatentAttention(config, None, 0, "layers.0.attention").to(device, dtype).train()
    hf_config = transformers.DeepseekV3Config(hidden_size=p["hidden"], num_attention_heads=p["heads"],
                                              num_key_value_heads=p["heads"], q_lora_rank=p["q_rank"],
                                              kv_lora_rank=p["kv_rank"], qk_nope_head_dim=p["nope"],
                                              qk_rope_head_dim=p["rope"], v_head_dim=p["v"],
                                              max_position_embeddings=p["seq"], attn_implementation="sdpa")
    theirs = DeepseekV3Attention(hf_config, 0).to(device, dtype).train()
    rotary = DeepseekV3RotaryEmbedding(hf_config).to(device)
    x = torch.randn(p["seq"], p["batch"], p["hidden"], device=device, dtype=dtype)
    positions = torch.arange(p["seq"], device=device)[None].expand(p["batch"], -1)
    mask = None  # is_causal in transformers' SDPA path

    def hf_call(inp):
        h = inp.transpose(0, 1).contiguous()
        cos, sin = rotary(h, positions)
        return theirs(h, (cos, sin), mask)[0]
    return _compare(_step(lambda inp: ours(inp), x), _step(hf_call, x), p["rounds"])


def moe(p: dict, device, dtype) -> dict:
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from hybrid.model.config import ModelConfig
    from hybrid.model.mlp import build_moe
    from hybrid.parallel.groups import ParallelGroups
    config = ModelConfig(num_layers=1, hidden_size=p["hidden"], num_attention_heads=p["heads"], vocab_size=128,
                         position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                         num_experts=p["experts"], moe_router_topk=p["topk"], moe_ffn_hidden_size=p["moe_ffn"],
                         moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                         moe_router_num_groups=p["groups"], moe_router_group_topk=p["group_topk"],
                         moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=p["moe_ffn"],
                         moe_grouped_gemm=device.type == "cuda", hidden_dropout=0.0, attention_dropout=0.0)
    ours = build_moe(config, ParallelGroups.single(), "layers.0.mlp").to(device, dtype).train()
    hf_config = transformers.DeepseekV3Config(hidden_size=p["hidden"], n_routed_experts=p["experts"],
                                              num_experts_per_tok=p["topk"], moe_intermediate_size=p["moe_ffn"],
                                              n_shared_experts=1, n_group=p["groups"], topk_group=p["group_topk"],
                                              routed_scaling_factor=2.5)
    theirs = DeepseekV3MoE(hf_config).to(device, dtype).train()
    with torch.no_grad():
        for param in theirs.parameters():
            param.normal_(0, 0.02)
    x = torch.randn(p["seq"], p["batch"], p["hidden"], device=device, dtype=dtype)
    return _compare(_step(lambda inp: ours(inp), x), _step(lambda inp: theirs(inp.transpose(0, 1).contiguous()), x),
                    p["rounds"])


def sinks(p: dict, device, dtype) -> dict:
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding
    from hybrid.model.attention import SelfAttention
    from hybrid.model.config import ModelConfig
    config = ModelConfig(num_layers=1, hidden_size=p["hidden"], num_attention_heads=p["heads"],
                         num_query_groups=p["kv_heads"], kv_channels=p["head"], vocab_size=128,
                         position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=True,
                         attention_sinks=True, hidden_dropout=0.0, attention_dropout=0.0)
    ours = SelfAttention(config, None, 0, "layers.0.attention").to(device, dtype).train()
    hf_config = transformers.GptOssConfig(hidden_size=p["hidden"], num_attention_heads=p["heads"],
                                          num_key_value_heads=p["kv_heads"], head_dim=p["head"], num_hidden_layers=1,
                                          layer_types=["full_attention"], max_position_embeddings=p["seq"],
                                          rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    theirs = GptOssAttention(hf_config, 0).to(device, dtype).train()
    with torch.no_grad():
        theirs.sinks.normal_()
    rotary = GptOssRotaryEmbedding(hf_config).to(device)
    x = torch.randn(p["seq"], p["batch"], p["hidden"], device=device, dtype=dtype)
    positions = torch.arange(p["seq"], device=device)[None].expand(p["batch"], -1)
    causal = torch.full((p["seq"], p["seq"]), float("-inf"), device=device, dtype=dtype).triu(1)[None, None]

    def hf_call(inp):
        h = inp.transpose(0, 1).contiguous()
        return theirs(h, rotary(h, positions), causal)[0]
    return _compare(_step(lambda inp: ours(inp), x), _step(hf_call, x), p["rounds"])


def main(argv=None) -> None:
    p_ = argparse.ArgumentParser()
    p_.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    p_.add_argument("--out", default=None)
    args = p_.parse_args(argv)
    p = PRESETS[args.preset]
    device = torch.device("cuda", 0) if args.preset == "gpu" else torch.device("cpu")
    dtype = getattr(torch, p["dtype"])
    torch.manual_seed(0)
    results = {"preset": args.preset, "shapes": p, "torch": torch.__version__, "threads": torch.get_num_threads(),
               "mla_attention": mla(p, device, dtype), "deepseek_moe": moe(p, device, dtype),
               "sink_attention": sinks(p, device, dtype)}
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"frontier_{args.preset}.json")
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
