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
        out = dsa.sparse_attention(q, k, v, indexer, index, 0.3, documents=docs)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), (q, k, v))
        results.append((out, grads))
    (whole, whole_grads), (blocked, blocked_grads) = results
    torch.testing.assert_close(blocked, whole, rtol=1e-6, atol=1e-6)
    for a, b in zip(blocked_grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # the selection matters: attending every allowed key instead gives other values
    monkeypatch.setattr(indexer, "topk", s)
    assert (dsa.sparse_attention(q, k, v, indexer, index, 0.3, documents=docs) - whole).abs().max() > 1e-3


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
