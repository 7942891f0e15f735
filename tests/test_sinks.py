"""Attention sinks (--softmax-type learnable, GPT-OSS; hybrid.model.sinks): the kernels' output scaled by
sigmoid(lse - sink) equals transformers' eager formula (a sink column in the softmax, dropped after it), forward
and backward, causal, through a window, over packed documents and under GQA; and a model with sinks trains at
CP 2 (the ring applies them to its merged output), Ulysses 2 (each rank its heads' sinks) and TP 2 + SP with packed
documents exactly as at one rank (GPT-OSS itself, windowed, is proved against transformers in test_families /
test_gradients)."""

import pytest
import torch

from tests.model_harness import assemble_grads, compare_grads
from tests.test_context_parallel import restoring_ring_settings
from checks.rank_pool import run_on_ranks


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
    want = _eager(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), sinks, core.scale, mask)
    want = want.permute(2, 0, 1, 3).reshape(s, b, -1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out, generator=g) if hasattr(torch, "randn_like") else torch.randn(out.shape)
    got = torch.autograd.grad(out, (q, k, v, sinks), grad)
    expected = torch.autograd.grad(want, (q, k, v, sinks), grad)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    assert expected[3].abs().max() > 1e-3  # the sinks take a gradient


P_DROP, SEED = 0.3, 1234


def _eager_dropped(q, k, v, sinks, scale, mask, keep):
    """transformers' GptOss eager attention with dropout on its probabilities (the sink column dropped first),
    the keep mask given: [b, heads, s, d]."""
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~mask, float("-inf"))
    combined = torch.cat([scores, sinks.reshape(1, -1, 1, 1).expand(q.size(0), -1, q.size(2), 1)], dim=-1)
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return (probs * keep / (1 - P_DROP)) @ v


@pytest.mark.parametrize("window,documents", [(None, False), (5, False), (None, True), (6, True)])
def test_sink_attention_with_dropout_equals_transformers_eager_dropped_by_the_same_keep_mask(window, documents,
                                                                                              monkeypatch):
    """Attention dropout with sinks (GPT-OSS run scripts keep Megatron-LM's default --attention-dropout 0.1): the
    local path, in query blocks of max(window, 4) where a window or documents mask keys, equals transformers'
    eager formula with its probabilities dropped by the keep mask hashed from (seed, row, head, positions),
    forward and backward (the sinks' gradient included)."""
    from hybrid.model import attention
    from hybrid.model.config import ModelConfig
    from hybrid.parallel.ring_attention import allowed_keys, keep_mask
    monkeypatch.setattr(attention, "WINDOW_BLOCK", 4)
    monkeypatch.setattr(attention, "DOCUMENT_BLOCK", 4)
    g = torch.Generator().manual_seed(1)
    s, b, heads, groups, d = 19, 2, 4, 2, 8
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=heads, num_query_groups=groups,
                         position_embedding_type="rope", attention_dropout=P_DROP, attention_sinks=True,
                         sliding_window=window)
    core = attention.CoreAttention(config, 0).train()
    monkeypatch.setattr(core, "dropout_seed", lambda q: torch.tensor(SEED))
    q = torch.randn(s, b, heads, d, generator=g, requires_grad=True)
    k, v = (torch.randn(s, b, groups, d, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.randn(heads, generator=g, requires_grad=True)
    docs = (torch.arange(s)[None, :].expand(b, s) >= torch.tensor([[7], [12]])).long() if documents else None
    out = core(q, k, v, docs, sinks=sinks)
    mask = allowed_keys(torch.arange(s), torch.arange(s), window)[None, None]
    if documents:
        mask = mask & (docs[:, None, :, None] == docs[:, None, None, :])
    keep = keep_mask(torch.tensor(SEED), b, heads, torch.arange(s), torch.arange(s), P_DROP)
    want = _eager_dropped(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), sinks, core.scale, mask, keep)
    want = want.permute(2, 0, 1, 3).reshape(s, b, -1)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    undropped = core.eval()(q, k, v, docs, sinks=sinks)
    assert (undropped - out).abs().max() > 1e-2  # dropout ran
    grad = torch.randn(out.shape, generator=g)
    for a, e in zip(torch.autograd.grad(out, (q, k, v, sinks), grad),
                    torch.autograd.grad(want, (q, k, v, sinks), grad)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


@restoring_ring_settings
def _ring_with_sinks_dropout_and_window(window: int):
    import torch.distributed as dist
    from hybrid.parallel import ring_attention as ring
    from hybrid.parallel.groups import Axis
    from tests.test_context_parallel import _attention_inputs
    axis = Axis.of(dist.group.WORLD)
    ring.MATH_TILE_BYTES, ring.BAND_ROWS = 4096, 1  # math tiles of a few rows; bands of the window's 12 rows
    q, k, v, grad, _ = _attention_inputs()
    sinks = torch.linspace(-1.0, 1.5, q.size(1))
    index = ring.local_index(q.size(2), axis.size, axis.rank)
    local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
    out = ring.ring_attention(*local[:3], axis, 0.3, dropout=P_DROP, seed=torch.tensor(SEED), sinks=local[3],
                              window=window)
    out.backward(grad[:, :, index])
    return index, out.detach(), [t.grad for t in local]


def test_the_ring_with_sinks_dropout_and_a_window_equals_transformers_eager_on_the_whole_sequence():
    """GPT-OSS's windowed layers under CP with attention dropout: the ring (its blocks masked to the window,
    dropped by the keep mask, the sinks on the merged output) equals the eager formula over the whole sequence:
    outputs and the q/k/v and sinks' gradients (the K/V ones summed where blocks travelled; the sinks' over ranks)."""
    from hybrid.parallel.ring_attention import allowed_keys, keep_mask
    from tests.test_context_parallel import _attention_inputs
    q, k, v, grad, _ = _attention_inputs()
    b, heads, s, _ = q.shape
    leaves = [t.clone().requires_grad_() for t in (q, k, v, torch.linspace(-1.0, 1.5, heads))]
    keep = keep_mask(torch.tensor(SEED), b, heads, torch.arange(s), torch.arange(s), P_DROP)
    want = _eager_dropped(*leaves, 0.3, allowed_keys(torch.arange(s), torch.arange(s), 12)[None, None], keep)
    want_grads = torch.autograd.grad(want, leaves, grad)
    got = [torch.zeros_like(t) for t in want_grads]
    for index, out, grads in run_on_ranks(_ring_with_sinks_dropout_and_window, 2, 12):
        torch.testing.assert_close(out, want[:, :, index].detach(), rtol=1e-5, atol=1e-6)
        got[0][:, :, index] = grads[0]
        got[1][:, :, index] += grads[1]
        got[2][:, :, index] += grads[2]
        got[3] += grads[3]
    for a, e in zip(got, want_grads):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


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


@pytest.mark.slow
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
