"""Attention sinks (--softmax-type learnable, GPT-OSS; hybrid.model.sinks): the kernels' output scaled by
sigmoid(lse - sink) equals transformers' eager formula (a sink column in the softmax, dropped after it), forward
and backward, causal, through a window, over packed documents and under GQA; and a model with sinks trains at
CP 2 (the ring applies them to its merged output), Ulysses 2 (each rank its heads' sinks) and TP 2 + SP with packed
documents exactly as at one rank (GPT-OSS itself, windowed, is proved against transformers in test_families /
test_gradients)."""

import pytest
import torch

from tests.model_harness import assemble_grads, compare_grads
from tests.rank_pool import run_on_ranks


def _eager(q, k, v, sinks, scale, mask):
    """transformers' GptOss eager_attention_forward on [b, heads, s, d] (GQA: K/V repeated)."""
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.reshape(1, -1, 1, 1).expand(q.size(0), -1, q.size(2), 1)
    combined = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(combined - combined.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return probs @ v


@pytest.mark.parametrize("window,documents,groups", [(None, False, 4), (None, False, 2), (5, False, 2),
                                                     (None, True, 2), (6, True, 1)])
def test_sink_attention_equals_transformers_eager_forward_and_backward(window, documents, groups):
    from hybrid.model.attention import CoreAttention
    from hybrid.model.config import ModelConfig
    g = torch.Generator().manual_seed(0)
    s, b, heads, d = 19, 2, 4, 8
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=heads, num_query_groups=groups,
                         position_embedding_type="rope", attention_dropout=0.0, attention_sinks=True,
                         sliding_window=window)
    core = CoreAttention(config, 0)
    q = torch.randn(s, b, heads, d, generator=g, requires_grad=True)
    k, v = (torch.randn(s, b, groups, d, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.randn(heads, generator=g, requires_grad=True)
    docs = (torch.arange(s)[None, :].expand(b, s) >= torch.tensor([[7], [12]])).long() if documents else None
    out = core(q, k, v, docs, sinks=sinks)  # [s, b, heads * d]
    pos = torch.arange(s)
    mask = pos[None, :] <= pos[:, None]
    if window:
        mask &= pos[None, :] > pos[:, None] - window
    mask = mask[None, None]
    if documents:
        mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
    want = _eager(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), sinks, core.scale, mask).permute(2, 0, 1, 3).reshape(s, b, -1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out, generator=g) if hasattr(torch, "randn_like") else torch.randn(out.shape)
    got = torch.autograd.grad(out, (q, k, v, sinks), grad)
    expected = torch.autograd.grad(want, (q, k, v, sinks), grad)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    assert expected[3].abs().max() > 1e-3  # the sinks take a gradient


def _iteration(layout: dict) -> dict:
    from hybrid.model.build import build_model
    from hybrid.model.config import ModelConfig
    from hybrid.model.naming import canonical_parameters
    from hybrid.parallel.groups import build_groups
    from hybrid.pipeline_plan import PipelineSchedule
    from tests.model_harness import _result, runtime_iteration
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=256,
                         position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=True,
                         hidden_dropout=0.0, attention_dropout=0.0, attention_sinks=True, reset_attention_mask=True,
                         reset_position_ids=True, eod_token=7,
                         sequence_parallel=layout.get("tensor_parallel", 1) > 1)
    groups = build_groups(**layout)
    model = build_model(config, groups, PipelineSchedule()).train()
    with torch.no_grad():  # sinks away from zero, so that they matter
        for name, param in model.named_parameters():
            if name.endswith("attention.sinks"):  # this TP rank's heads' of the full values
                n = param.numel()
                param.copy_(torch.linspace(-1.0, 1.5, 4)[groups.tp.rank * n:(groups.tp.rank + 1) * n])
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(4))
    tokens[0, 5] = tokens[1, 11] = 7  # packed documents
    micro = [(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())]
    loss, recorded, _ = runtime_iteration(model, groups, PipelineSchedule(), micro)
    params = canonical_parameters(model, config.num_layers)
    return _result(groups, loss, None, params, {n: recorded[id(p)] for n, p in params.items()})


@pytest.mark.parametrize("layout", [dict(context_parallel=2), dict(ulysses=2), dict(tensor_parallel=2)],
                         ids=["cp2", "ulysses2", "tp2_sp"])
def test_a_model_with_sinks_and_packed_documents_trains_at_cp2_ulysses2_and_tp2_as_at_one_rank(layout):
    one = run_on_ranks(_iteration, 1, {})
    results = run_on_ranks(_iteration, 2, layout)
    assert all(abs(r["loss"] - one[0]["loss"]) <= 1e-6 * one[0]["loss"] for r in results), \
        (one[0]["loss"], [r["loss"] for r in results])
    full = assemble_grads(one)
    assert all(full[f"layers.{i}.attention.sinks"].abs().max() > 0 for i in range(2))
    compare_grads(assemble_grads(results), full, 256, 1e-6)
