"""DeepSeek sparse attention's blocks (hybrid.model.dsa): the queries scored and attended DSA_BLOCK rows at a time,
each block recomputed in backward, give the values and gradients of one block over the whole sequence (with packed
documents too), keep memory linear in the sequence, and decode a prompt in blocks as transformers' generate does.
The model against transformers: tests/test_families.py, test_gradients.py, test_moe.py, test_generation.py."""

from __future__ import annotations

import pytest
import torch

from hybrid.model import dsa
from hybrid.model.config import ModelConfig


def _case(s: int, seed: int = 0):
    torch.manual_seed(seed)
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, multi_latent_attention=True,
                         position_embedding_type="rope",
                         qk_layernorm=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4,
                         v_head_dim=6, dsa_indexer_topk=5, dsa_indexer_n_heads=4, dsa_indexer_head_dim=8)
    indexer = dsa.Indexer(config, "layers.0.attention")
    b, h = 2, 4
    x, latent = torch.randn(s, b, 32), torch.randn(s, b, 16)
    cos, sin = torch.ones(s, 1, 1, 4), torch.zeros(s, 1, 1, 4)
    index = indexer.project(x, latent, cos, sin)
    q, k = (torch.randn(s, b, h, 12, requires_grad=True) for _ in range(2))
    v = torch.randn(s, b, h, 6, requires_grad=True)
    return indexer, index, q, k, v


@pytest.mark.parametrize("documents", [False, True])
def test_blocks_give_the_whole_sequence_s_values_and_gradients(documents, monkeypatch):
    s = 23
    indexer, index, q, k, v = _case(s)
    docs = torch.tensor([[0] * 9 + [1] * 14, [0] * 17 + [1] * 6]) if documents else None
    results = []
    for block in (1024, 5):  # one block; blocks of 5 rows (the last one short)
        monkeypatch.setattr(dsa, "DSA_BLOCK", block)
        out = dsa.sparse_attention(q, k, v, indexer, index, 0.3, documents=docs)[0]
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), (q, k, v))
        results.append((out, grads))
    (whole, whole_grads), (blocked, blocked_grads) = results
    torch.testing.assert_close(blocked, whole, rtol=1e-6, atol=1e-6)
    for a, b in zip(blocked_grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # the selection matters: attending every allowed key instead gives other values
    monkeypatch.setattr(indexer, "topk", s)
    assert (dsa.sparse_attention(q, k, v, indexer, index, 0.3, documents=docs)[0] - whole).abs().max() > 1e-3


def test_a_layer_keeps_memory_linear_in_the_sequence(monkeypatch):
    """The distinct tensors autograd keeps for backward double with the sequence (the blocks recomputed: no [s, s]
    mask kept; each block's checkpoint refers to the same q, k and v)."""
    monkeypatch.setattr(dsa, "DSA_BLOCK", 32)
    saved = []
    for s in (128, 256):
        indexer, index, q, k, v = _case(s)
        storages = {}

        def keep(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            dsa.sparse_attention(q, k, v, indexer, index, 0.3)
        saved.append(sum(storages.values()))
    assert saved[1] <= 2.2 * saved[0], saved
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda f, *args, **kwargs: f(*args))
    monkeypatch.setattr(dsa, "checkpoint", torch.utils.checkpoint.checkpoint)
    indexer, index, q, k, v = _case(256)  # (without the recompute the masks are kept: the measure can fail)
    storages = {}
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        dsa.sparse_attention(q, k, v, indexer, index, 0.3)
    assert sum(storages.values()) > 2.2 * saved[0]


def test_a_prompt_decoded_in_blocks_equals_transformers_generate(monkeypatch, tmp_path):
    from hybrid.model.generate import SamplingOptions, generate
    from tests.hf_families import make_family
    from tests.test_generation import hf_greedy, one_rank_model, prompts
    monkeypatch.setattr(dsa, "DSA_BLOCK", 3)  # (hybrid.model.kv_cache reads it when it imports hybrid.model.dsa)
    import hybrid.model.kv_cache as kv_cache
    monkeypatch.setattr(kv_cache, "DSA_BLOCK", 3)
    hf = make_family("deepseek_v32", tmp_path, tokenizer=False)
    batch = prompts(lengths=(11, 7))
    out = generate(one_rank_model(tmp_path), None, batch, SamplingOptions(max_new_tokens=10))
    for prompt, tokens in zip(batch, out.tokens):
        assert tokens == hf_greedy(hf, prompt, 10)


def test_a_pipeline_stage_without_a_sharing_layer_s_source_is_one_message():
    """GLM-5's index sharing: a stage holding layer 1 (which reuses layer 0's choice) but not layer 0 is refused."""
    from types import SimpleNamespace

    from hybrid.errors import ConfigError
    from hybrid.model.virtual_stages import _link_index_sharing
    config = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, position_embedding_type="rope",
                         multi_latent_attention=True, qk_layernorm=True, q_lora_rank=16, dsa_indexer_topk=4,
                         dsa_indexer_head_dim=64, dsa_index_share=[0, 1, 0, 1])
    assert [config.dsa_source(i) for i in range(4)] == [None, 0, None, 2]
    layers = {str(i): SimpleNamespace(attention=SimpleNamespace(index_readers=0)) for i in range(4)}
    _link_index_sharing(SimpleNamespace(plans=[SimpleNamespace(layers=[0, 1]), SimpleNamespace(layers=[2, 3])],
                                        layers=layers), config)
    assert layers["3"].attention.index_source is layers["2"].attention
    assert layers["2"].attention.index_readers == 1 and layers["3"].attention.last_reader  # (it releases the choice)
    with pytest.raises(ConfigError, match="layer 1 reuses the keys layer 0's DSA indexer chose"):
        _link_index_sharing(SimpleNamespace(plans=[SimpleNamespace(layers=[1, 2, 3])], layers=layers), config)


def test_megatron_s_frequency_and_offset_give_transformers_indexer_types():
    """--dsa-indexer-topk-freq / --dsa-indexer-skip-topk-offset as transformers' GlmMoeDsaConfig derives
    indexer_types from index_topk_freq / index_skip_topk_offset."""
    import transformers

    from hybrid.architecture import dsa_index_share
    for layers, freq, offset in [(8, 2, 1), (9, 3, 2), (6, 4, 3), (5, 1, 0)]:
        hf = transformers.GlmMoeDsaConfig(num_hidden_layers=layers, index_topk_freq=freq,
                                          index_skip_topk_offset=offset)
        want = [int(kind == "shared") for kind in hf.indexer_types]
        assert (dsa_index_share(layers, freq, offset) or [0] * layers) == want, (layers, freq, offset)


def _megatron_indexer_loss(index, topk, q, k, scale, coeff, sparse):
    """megatron-core's own compute_dsa_indexer_loss at TP 1 (its process-group argument is read for the TP size)."""
    from types import SimpleNamespace
    from megatron.core.transformer.experimental_attention_variant.dsa import compute_dsa_indexer_loss
    one = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    return compute_dsa_indexer_loss(index, topk, q, k, scale, coeff, sparse, one)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense_loss", "sparse_loss"])
def test_indexer_kl_in_blocks_equals_megatron_cores_loss_and_gradient(sparse):
    """indexer_kl row block by row block, summed and averaged over the queries, is megatron-core's
    compute_dsa_indexer_loss (the dense warm-up's and, with --dsa-indexer-use-sparse-loss, the sparse stage's) on the
    same scores and attention, in value and in its gradient to the index scores."""
    torch.manual_seed(3)
    b, s, heads, d, topk, scale, coeff = 2, 23, 3, 8, 6, 0.3, 0.25
    causal = torch.full((s, s), float("-inf")).triu(1)
    raw = torch.randn(b, s, s, requires_grad=True)
    q, k = torch.randn(s, b, heads, d), torch.randn(s, b, heads, d)
    masked = raw + causal  # (what megatron-core's indexer returns: the causal mask on its scores)
    chosen = masked.detach().topk(topk, dim=-1).indices
    want = _megatron_indexer_loss(masked.clone(), chosen, q, k, scale, coeff, sparse)
    want_grad, = torch.autograd.grad(want, raw)
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, multi_latent_attention=True,
                         position_embedding_type="rope", qk_layernorm=True, q_lora_rank=16, kv_lora_rank=12,
                         qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, dsa_indexer_topk=topk)
    indexer = dsa.Indexer(config, "layers.0.attention")
    total = 0
    for start in range(0, s, 5):  # blocks of 5 query rows, the last short
        rows = torch.arange(start, min(start + 5, s))
        allowed = dsa.allowed_keys_of(rows, s).expand(b, -1, -1)
        keep = indexer.choose(raw[:, rows], allowed)
        total = total + dsa.indexer_kl(raw[:, rows], keep, allowed, q[rows].permute(1, 2, 0, 3),
                                       k.permute(1, 2, 0, 3), scale, sparse).sum()
    got = total * coeff / (b * s)
    got_grad, = torch.autograd.grad(got, raw)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-8)


def test_the_indexer_trains_by_megatron_cores_loss_alone_and_the_lm_gradients_stay_transformers(monkeypatch, tmp_path):
    """--dsa-indexer-loss-coeff: a DeepSeek-V3.2's layer attaches megatron-core's compute_dsa_indexer_loss of its own
    attention's queries and keys and its indexer's scores (the value, and the indexer's gradient, equal); every other
    parameter's gradient is that of the frozen indexer (transformers' backward, tests/test_gradients.py); query blocks
    of 16 over 39 positions."""
    from hybrid.model import mla
    from tests.hf_families import make_family
    from tests.test_families import our_model, tokens
    monkeypatch.setattr(dsa, "DSA_BLOCK", 16)
    make_family("deepseek_v32", tmp_path, tokenizer=False)
    ids = tokens()[:, :-1]
    frozen, _ = our_model(tmp_path)
    frozen.train()
    frozen(ids).float().pow(2).mean().backward()
    model, config = our_model(tmp_path, dsa_indexer_loss_coeff=0.5)
    model.train()
    seen, original = [], dsa.sparse_attention

    def record(q, k, v, indexer, index, scale, dropout=0.0, documents=None, kl_group=False):
        out = original(q, k, v, indexer, index, scale, dropout, documents, kl_group)
        scores = indexer.scores(*index)  # [b, s, s], its graph back to the indexer's weights (megatron-core's input)
        s = scores.size(1)
        masked = scores + torch.full((s, s), float("-inf")).triu(1)
        want = _megatron_indexer_loss(masked, masked.detach().topk(config.dsa_indexer_topk, dim=-1).indices,
                                      q.detach(), k.detach(), scale, 0.5, False)
        params = list(indexer.parameters())
        seen.append((indexer, out[1], want, torch.autograd.grad(want, params, retain_graph=True)))
        return out
    monkeypatch.setattr(mla, "sparse_attention", record)
    model(ids).float().pow(2).mean().backward()
    assert len(seen) == config.num_layers
    for indexer, loss, want, want_grads in seen:
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-7)
        for got, expected in zip(indexer.parameters(), want_grads):
            assert expected.abs().max() > 0
            torch.testing.assert_close(got.grad, expected, rtol=1e-4, atol=1e-7)
    trained = dict(model.named_parameters())
    for name, param in frozen.named_parameters():
        if ".indexer." not in name:
            torch.testing.assert_close(trained[name].grad, param.grad, rtol=0, atol=0)


def test_the_indexer_loss_flags_without_an_indexer_or_with_lora_are_one_message():
    from hybrid.config import build_run_config
    from hybrid.errors import ConfigError
    from hybrid.flags import build_parser
    from tests.test_capabilities import _argv
    with pytest.raises(ConfigError, match="the model has none"):
        build_run_config(build_parser().parse_args(_argv(["--dsa-indexer-loss-coeff", 0.1])), 1, 64, eod_token=63)
    with pytest.raises(ConfigError, match="LoRA freezes the base, DSA's indexer included"):
        ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, multi_latent_attention=True,
                    position_embedding_type="rope", qk_layernorm=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8,
                    qk_pos_emb_head_dim=4, v_head_dim=6, dsa_indexer_topk=4, dsa_indexer_loss_coeff=0.1, lora_rank=2,
                    lora_target_modules=("gate_proj", "up_proj", "down_proj"), swiglu=True)
