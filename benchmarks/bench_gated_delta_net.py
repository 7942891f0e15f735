"""Gated DeltaNet on the CPU: hybrid's chunked PyTorch form against transformers' own fallback, as JSON.

    python benchmarks/bench_gated_delta_net.py [--seq 2048 --batch 1 --key-heads 4 --value-heads 8 --head-dim 64]

Three measurements on the same inputs, each the median of alternating rounds after warm-up (the order flipping each
round), every ratio against transformers measured in the same run:
  rule    the gated delta rule alone, forward and backward: hybrid.model.gated_delta_net.chunk_gated_delta_rule
          against transformers' torch_chunk_gated_delta_rule (what Qwen3.5 runs without flash-linear-attention);
  layer   one whole layer, forward and backward, with the same weights: hybrid's GatedDeltaNet (projection, conv,
          rule, gated norm, output) against transformers' Qwen3_5GatedDeltaNet;
  decode  one decoding step of a batch of 8 rows from a cached state: recurrent_gated_delta_rule against
          torch_recurrent_gated_delta_rule.
The outputs are checked equal (fp32, 1e-4) before timing. Writes benchmarks/results/gated_delta_net_cpu.json (--out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _timed(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _compare(pairs: dict, rounds: int, repeats: int) -> dict:
    """Median seconds of each variant over alternating rounds (first a warm-up of each)."""
    for fn in pairs.values():
        fn()
    times = {name: [] for name in pairs}
    names = list(pairs)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(_timed(pairs[name], repeats))
    return {name: statistics.median(t) for name, t in times.items()}


def _rule_inputs(a):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(a.batch, a.seq, a.key_heads, a.head_dim, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(a.batch, a.seq, a.value_heads, a.head_dim, generator=gen, requires_grad=True)
    g = (-torch.rand(a.batch, a.seq, a.value_heads, generator=gen)).requires_grad_()
    beta = torch.rand(a.batch, a.seq, a.value_heads, generator=gen).requires_grad_()
    return q, k, v, g, beta


def _ours(q, k, v, g, beta, chunk):
    from hybrid.model.gated_delta_net import chunk_gated_delta_rule, l2_normalize
    ratio = v.size(2) // q.size(2)
    qh, kh = (t.repeat_interleave(ratio, dim=2).transpose(1, 2) for t in (q, k))
    out, _ = chunk_gated_delta_rule(l2_normalize(qh) * qh.size(-1) ** -0.5, l2_normalize(kh), v.transpose(1, 2),
                                    g.transpose(1, 2), beta.transpose(1, 2), chunk)
    return out.transpose(1, 2)


def rule(a) -> dict:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    inputs = _rule_inputs(a)
    want = torch_chunk_gated_delta_rule(*inputs[:3], g=inputs[3], beta=inputs[4], chunk_size=a.chunk,
                                        use_qk_l2norm_in_kernel=True)[0]
    assert (_ours(*inputs, a.chunk) - want).abs().max() < 1e-4

    def ours():
        _ours(*inputs, a.chunk).sum().backward()

    def theirs():
        torch_chunk_gated_delta_rule(*inputs[:3], g=inputs[3], beta=inputs[4], chunk_size=a.chunk,
                                     use_qk_l2norm_in_kernel=True)[0].sum().backward()
    return _compare({"hybrid": ours, "transformers": theirs}, a.rounds, 1)


def _layers(a):
    """transformers' Qwen3_5GatedDeltaNet and hybrid's GatedDeltaNet with the same weights (the adapter's mapping)."""
    import transformers
    from hybrid.conversion.families.linear_attention import gdn_to_canonical
    from hybrid.model.config import ModelConfig
    from hybrid.model.gated_delta_net import GatedDeltaNet
    from hybrid.parallel.groups import ParallelGroups
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    hf_config = transformers.Qwen3_5TextConfig(
        hidden_size=a.hidden, num_hidden_layers=1, linear_num_key_heads=a.key_heads,
        linear_num_value_heads=a.value_heads, linear_key_head_dim=a.head_dim, linear_value_head_dim=a.head_dim,
        layer_types=["linear_attention"])
    theirs = Qwen3_5GatedDeltaNet(hf_config, 0).train()
    config = ModelConfig(num_layers=1, hidden_size=a.hidden, num_attention_heads=4, position_embedding_type="rope",
                         normalization="RMSNorm", norm_epsilon=hf_config.rms_norm_eps, linear_attention_freq=[1],
                         linear_num_key_heads=a.key_heads, linear_num_value_heads=a.value_heads,
                         linear_key_head_dim=a.head_dim, linear_value_head_dim=a.head_dim,
                         linear_attention_chunk_size=a.chunk, hidden_dropout=0.0, attention_dropout=0.0)
    ours = GatedDeltaNet(config, ParallelGroups.single(), 0, "layers.0.attention").train()
    state = {f"model.layers.0.linear_attn.{n}": t for n, t in theirs.state_dict().items()}
    canonical = {}
    gdn_to_canonical(dataclasses.replace(config), state, 0, canonical, grouped=False)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.copy_(canonical[f"layers.0.attention.{name}"])
    return ours, theirs


def layer(a) -> dict:
    ours, theirs = _layers(a)
    x = torch.randn(a.seq, a.batch, a.hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)
    xt = x.detach().transpose(0, 1).contiguous().requires_grad_()
    assert (ours(x).transpose(0, 1) - theirs(xt)).abs().max() < 1e-4
    return _compare({"hybrid": lambda: ours(x).sum().backward(), "transformers": lambda: theirs(xt).sum().backward()},
                    a.rounds, 1)


def decode(a) -> dict:
    from hybrid.model.gated_delta_net import l2_normalize, recurrent_gated_delta_rule
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule
    b, h, d = 8, a.value_heads, a.head_dim
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(b, 1, h, d, generator=gen) for _ in range(3))
    g, beta = -torch.rand(b, 1, h, generator=gen), torch.rand(b, 1, h, generator=gen)
    state = torch.randn(b, h, d, d, generator=gen) * 0.1
    qn, kn = l2_normalize(q.transpose(1, 2)) * d ** -0.5, l2_normalize(k.transpose(1, 2))
    args = (qn, kn, v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2))
    want = torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state,
                                            use_qk_l2norm_in_kernel=True)[0]
    assert (recurrent_gated_delta_rule(*args, initial_state=state)[0].transpose(1, 2) - want).abs().max() < 1e-4
    with torch.no_grad():
        return _compare({"hybrid": lambda: recurrent_gated_delta_rule(*args, initial_state=state),
                         "transformers": lambda: torch_recurrent_gated_delta_rule(
                             q, k, v, g=g, beta=beta, initial_state=state, use_qk_l2norm_in_kernel=True)},
                        a.rounds, 50)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--key-heads", type=int, default=4)
    p.add_argument("--value-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gated_delta_net_cpu.json"))
    a = p.parse_args()
    torch.manual_seed(0)
    result = {"shape": {k: v for k, v in vars(a).items() if k not in ("out", "rounds")},
              "threads": torch.get_num_threads(), "torch": torch.__version__}
    for name, fn in (("rule", rule), ("layer", layer), ("decode", decode)):
        seconds = fn(a)
        result[name] = {"hybrid_s": round(seconds["hybrid"], 5), "transformers_s": round(seconds["transformers"], 5),
                        "speedup_vs_transformers": round(seconds["transformers"] / seconds["hybrid"], 3)}
        print(name, result[name], flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
