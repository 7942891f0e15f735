"""Llama 3.x, Qwen2, Qwen3, Mistral, Gemma and Gemma 3 against transformers itself: imported models give
transformers' logits and loss (one rank in-process; TP 2 + SP x PP 2 through launch/evaluate.py),
exports are bit-identical and generate what the original generates, `--load-hf` trains at TP 2 x PP 2
exactly as at one rank and ends in an export of the same family; each family's options are training
flags that build the same architecture; unsupported config fields are one message naming them.

The models come from tests/hf_families.py (tiny, random, saved locally)."""

import dataclasses
import json

import pytest
import torch

from hybrid.conversion.hf import read_hf_config, read_hf_dir, write_hf_dir
from hybrid.errors import ConfigError
from tests.hf_families import FAMILIES, FAMILY_CONFIGS, RECORDED, make_family
from checks.launch_helpers import read_log, run

# the option that makes each family what it is: turned off, the logits must change (so the proof can fail)
DISTINCTIVE = {"llama3": dict(rope_scaling=None), "qwen2": dict(add_qkv_bias=False),
               "qwen3": dict(qk_layernorm=False), "mistral": dict(sliding_window=None),
               "gemma": dict(apply_layernorm_1p=False), "gemma3": dict(sandwich_norms=False),
               "mixtral": dict(moe_router_topk=1),
               "qwen2_moe": dict(moe_router_pre_softmax=False), "qwen3_moe": dict(moe_router_pre_softmax=True),
               "glm4_moe": dict(rotary_percent=1.0), "deepseek_v3": dict(rope_scaling=None),
               "gpt_oss": dict(activation_func_clamp_value=None),
               "mistral4": dict(llama_4_scaling_beta=None, llama_4_scaling_length=None),
               "minimax_m2": dict(qk_layernorm=False, qk_norm_across_heads=False),
               "deepseek_v32": dict(dsa_indexer_topk=None), "glm_moe_dsa": dict(dsa_index_share=[0, 1, 1, 1]),
               "gemma4": dict(v_norm=False), "gemma4_e": dict(per_layer_input_size=0),
               "gemma4_moe": dict(moe_gemma4_block=False), "qwen3_5": dict(attention_output_gate=False),
               "qwen3_5_moe": dict(apply_layernorm_1p=False), "qwen3_next": dict(moe_router_pre_softmax=False)}
# config.json fields that must survive import -> training -> export (what changes the model)
KEPT_FIELDS = ("architectures", "layer_types", "query_pre_attn_scalar", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rope_parameters", "sliding_window", "use_sliding_window",
               "rms_norm_eps", "tie_word_embeddings", "attention_bias", "hidden_act", "hidden_activation",
               "vocab_size", "max_position_embeddings", "num_local_experts", "num_experts", "num_experts_per_tok",
               "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "n_routed_experts",
               "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace",
               "use_qk_norm", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
               "rope_interleave", "num_local_experts", "swiglu_limit", "swiglu_alpha", "index_topk", "index_n_heads",
               "index_head_dim", "mlp_layer_types", "layer_types", "indexer_types", "per_layer_config",
               "attention_k_eq_v", "final_logit_softcapping", "hidden_size_per_layer_input", "num_kv_shared_layers",
               "enable_moe_block")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """family -> (directory, transformers model), made once for the module."""
    root = tmp_path_factory.mktemp("hf")
    return {family: (root / family, make_family(family, root / family)) for family in FAMILIES}


def our_model(path, **overrides):
    from hybrid.conversion.layout import shard_for_rank
    from hybrid.model.gpt import GPTModel
    state, config, _ = read_hf_dir(str(path))
    config = dataclasses.replace(config, **overrides)
    model = GPTModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard_for_rank(name, state[name], config, 1, 0))
        for name, buffer in model.named_buffers():  # the routers' score biases
            if name in state:
                buffer.copy_(state[name])
    return model, config


def tokens(seq=40, batch=2, seed=1):
    return torch.randint(0, 8192, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_imported_family_gives_transformers_logits_and_loss_and_its_option_matters(family, hf_models):
    path, hf = hf_models[family]
    model, config = our_model(path)
    assert config.family == RECORDED[family]
    ids = tokens()
    with torch.no_grad():
        ours, want = model(ids[:, :-1]), hf(ids[:, :-1]).logits
        loss = model(ids[:, :-1], ids[:, 1:]).item()
        changed, _ = our_model(path, **DISTINCTIVE[family])
        without_option = changed(ids[:, :-1])
    want_loss = torch.nn.functional.cross_entropy(want.reshape(-1, want.size(-1)), ids[:, 1:].reshape(-1)).item()
    assert (ours - want).abs().max().item() <= 1e-4
    assert abs(loss - want_loss) <= 1e-5 * want_loss
    assert (without_option - want).abs().max().item() > 1e-3, "the family's own option must change the logits"


@pytest.mark.parametrize("family", FAMILIES)
def test_export_is_bit_identical_loads_cleanly_and_generates_what_the_original_does(family, hf_models, tmp_path):
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    path, hf = hf_models[family]
    state, config, _ = read_hf_dir(str(path))
    write_hf_dir(state, config, str(tmp_path / "out"))
    original = load_file(str(path / "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(original) == set(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)
    # (transformers 5.25's AutoModelForCausalLM lacks Mistral 4, which it loads as a text model of Mistral3: its class)
    loader = getattr(transformers, type(hf).__name__) if family == "mistral4" else AutoModelForCausalLM
    reloaded, info = loader.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(reloaded).__name__ == type(hf).__name__
    _assert_kept_fields(path, tmp_path / "out")
    prompt = tokens(seq=6, batch=1, seed=3)
    out = reloaded.eval().generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert out.shape[1] == prompt.shape[1] + 20
    assert torch.equal(out, hf.generate(prompt, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                        pad_token_id=0))


@pytest.mark.parametrize("family", ["qwen2", "gemma"])
def test_a_bf16_model_exports_bit_identical_in_bf16(family, tmp_path):
    from safetensors.torch import load_file
    make_family(family, tmp_path / "hf", tokenizer=False, dtype="bfloat16")
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in original.values())
    state, config, _ = read_hf_dir(str(tmp_path / "hf"))
    assert config.hf_dtype == "bfloat16"
    write_hf_dir(state, config, str(tmp_path / "out"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == set(original) and all(torch.equal(exported[k], original[k]) for k in original)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def _assert_kept_fields(source, export):
    a, b = (json.loads((d / "config.json").read_text()) for d in (source, export))
    for field in KEPT_FIELDS:
        if field in a:
            assert b.get(field) == a[field], (field, a[field], b.get(field))


# each family's architecture as Megatron-LM training flags (the same shapes pretrain from scratch)
COMMON_FLAGS = ["--num-layers", 4, "--hidden-size", 32, "--num-attention-heads", 4, "--ffn-hidden-size", 64,
                "--seq-length", 32, "--max-position-embeddings", 64, "--position-embedding-type", "rope",
                "--normalization", "RMSNorm", "--disable-bias-linear", "--hidden-dropout", 0,
                "--attention-dropout", 0]
GDN_FLAGS = ["--swiglu", "--num-query-groups", 2, "--qk-layernorm", "--kv-channels", 8, "--apply-layernorm-1p",
             "--rotary-percent", 0.25, "--attention-output-gate", "--experimental-attention-variant", "gated_delta_net",
             "--linear-attention-freq", "([1]*3+[0])", "--linear-key-head-dim", 8, "--linear-value-head-dim", 6,
             "--linear-num-key-heads", 2, "--linear-num-value-heads", 4, "--untie-embeddings-and-output-weights",
             "--norm-epsilon", 1e-6]  # Qwen3.5's
GDN_MOE_FLAGS = ["--num-experts", 4, "--moe-router-topk", 2, "--moe-ffn-hidden-size", 16,
                 "--moe-shared-expert-intermediate-size", 24, "--moe-shared-expert-gate"]
FAMILY_FLAGS = {
    "llama3": ["--swiglu", "--group-query-attention", "--num-query-groups", 2, "--rotary-base", 500000,
               "--use-rope-scaling", "--rope-scaling-factor", 32, "--norm-epsilon", 1e-5],
    "qwen2": ["--swiglu", "--num-query-groups", 2, "--add-qkv-bias", "--rotary-base", 1000000, "--norm-epsilon", 1e-6],
    "qwen3": ["--swiglu", "--num-query-groups", 2, "--qk-layernorm", "--kv-channels", 16,
              "--untie-embeddings-and-output-weights", "--norm-epsilon", 1e-6],
    "mistral": ["--swiglu", "--num-query-groups", 2, "--window-size", "7,0", "--untie-embeddings-and-output-weights",
                "--norm-epsilon", 1e-5],
    "gemma": ["--geglu", "--num-query-groups", 2, "--kv-channels", 16, "--apply-layernorm-1p", "--scale-embeddings",
              "--norm-epsilon", 1e-6],
    "gemma3": ["--geglu", "--num-query-groups", 2, "--kv-channels", 16, "--apply-layernorm-1p", "--scale-embeddings",
               "--qk-layernorm", "--sandwich-norms", "--window-size", "7,0", "--window-attn-skip-freq", 3,
               "--rotary-base", 1000000, "--rotary-seq-len-interpolation-factor", 4, "--local-rotary-base", 10000,
               "--softmax-scale", 24 ** -0.5, "--norm-epsilon", 1e-6],
    "gemma4": ["--geglu", "--num-query-groups", 2, "--kv-channels", 16, "--scale-embeddings", "--qk-layernorm",
               "--sandwich-norms", "--window-size", "5,0", "--window-attn-skip-freq", 2, "--rotary-base", 1000000,
               "--rotary-proportional-percent", 0.25, "--local-rotary-base", 10000, "--softmax-scale", 1,
               "--global-kv-channels", 32, "--global-num-query-groups", 4, "--attention-k-eq-v", "--v-norm",
               "--rmsnorm-fp32-scale",
               "--final-logit-softcapping", 2, "--untie-embeddings-and-output-weights", "--norm-epsilon", 1e-6],
    "gemma4_e": ["--geglu", "--num-query-groups", 2, "--kv-channels", 16, "--scale-embeddings", "--qk-layernorm",
                 "--sandwich-norms", "--window-size", "5,0", "--window-attn-skip-freq", 2, "--rotary-base", 1000000,
                 "--rotary-proportional-percent", 0.25, "--local-rotary-base", 10000, "--softmax-scale", 1,
                 "--global-kv-channels", 32, "--v-norm", "--rmsnorm-fp32-scale", "--final-logit-softcapping", 2,
                 "--per-layer-input-size", 8,
                 "--num-kv-shared-layers", 2, "--double-wide-shared-mlp", "--norm-epsilon", 1e-6],
    "gemma4_moe": ["--geglu", "--num-query-groups", 2, "--kv-channels", 16, "--scale-embeddings", "--qk-layernorm",
                   "--sandwich-norms", "--window-size", "5,0", "--window-attn-skip-freq", 2, "--rotary-base", 1000000,
                   "--rotary-proportional-percent", 0.25, "--local-rotary-base", 10000, "--softmax-scale", 1,
                   "--global-kv-channels", 32, "--global-num-query-groups", 4, "--attention-k-eq-v", "--v-norm",
                   "--rmsnorm-fp32-scale", "--final-logit-softcapping", 2, "--untie-embeddings-and-output-weights",
                   "--norm-epsilon", 1e-6, "--num-experts", 4, "--moe-router-topk", 2, "--moe-ffn-hidden-size", 16,
                   "--moe-shared-expert-intermediate-size", 64, "--moe-gemma4-block"],
    "mixtral": ["--swiglu", "--num-query-groups", 2, "--window-size", "7,0", "--untie-embeddings-and-output-weights",
                "--rotary-base", 1000000,
                "--norm-epsilon", 1e-5, "--num-experts", 4, "--moe-router-topk", 2, "--moe-ffn-hidden-size", 64],
    "qwen2_moe": ["--swiglu", "--num-query-groups", 2, "--add-qkv-bias", "--untie-embeddings-and-output-weights",
                  "--norm-epsilon", 1e-6, "--num-experts", 4, "--moe-ffn-hidden-size", 24, "--moe-layer-freq",
                  "[1]*3+[0]", "--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size", 40,
                  "--moe-shared-expert-gate"],
    "qwen3_moe": ["--swiglu", "--num-query-groups", 2, "--qk-layernorm", "--kv-channels", 16,
                  "--untie-embeddings-and-output-weights", "--norm-epsilon", 1e-6, "--num-experts", 4,
                  "--moe-ffn-hidden-size", 24, "--moe-layer-freq", "[0,1,0,1]"],
    "glm4_moe": ["--swiglu", "--num-query-groups", 2, "--qk-layernorm", "--add-qkv-bias", "--kv-channels", 16,
                 "--rotary-percent", 0.5, "--rotary-seq-len-interpolation-factor", 2,
                 "--untie-embeddings-and-output-weights", "--norm-epsilon", 1e-5, "--num-experts", 8,
                 "--moe-ffn-hidden-size", 24, "--moe-layer-freq", "[0]+[1]*3", "--moe-router-score-function", "sigmoid",
                 "--moe-router-enable-expert-bias", "--moe-router-num-groups", 4, "--moe-router-group-topk", 1,
                 "--moe-router-topk-scaling-factor", 2.5, "--moe-shared-expert-intermediate-size", 24,
                 "--moe-router-dtype", "fp32"],
    "deepseek_v3": ["--swiglu", "--untie-embeddings-and-output-weights", "--norm-epsilon", 1e-6,
                    "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", 16, "--kv-lora-rank", 12,
                    "--qk-head-dim", 8,
                    "--qk-pos-emb-head-dim", 4, "--v-head-dim", 6, "--rotary-scaling-factor", 4, "--mscale", 1,
                    "--mscale-all-dim", 0.7, "--yarn-original-max-position-embeddings", 16, "--num-experts", 8,
                    "--moe-router-topk", 4, "--moe-ffn-hidden-size", 24, "--moe-layer-freq", "[0]+[1]*3",
                    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-dtype",
                    "fp32", "--moe-router-num-groups", 4, "--moe-router-group-topk", 2,
                    "--moe-router-topk-scaling-factor", 2.5,
                    "--moe-shared-expert-intermediate-size", 24],
    "gpt_oss": ["--num-query-groups", 2, "--kv-channels", 16, "--untie-embeddings-and-output-weights",
                "--norm-epsilon", 1e-5, "--softmax-type", "learnable", "--quick-geglu", "--glu-linear-offset", 1,
                "--activation-func-clamp-value", 0.2, "--window-size", "7,0", "--window-attn-skip-freq", 2,
                "--position-embedding-type", "yarn", "--rotary-base", 150000, "--rotary-scaling-factor", 4,
                "--yarn-original-max-position-embeddings", 16, "--no-yarn-correction-range-round-to-int",
                "--num-experts", 4, "--moe-ffn-hidden-size", 24, "--ffn-hidden-size", 24],
    "mistral4": ["--swiglu", "--untie-embeddings-and-output-weights", "--norm-epsilon", 1e-6,
                 "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", 16, "--kv-lora-rank", 12,
                 "--qk-head-dim", 8, "--qk-pos-emb-head-dim", 4, "--v-head-dim", 6, "--rotary-scaling-factor", 4,
                 "--mscale", 1, "--mscale-all-dim", 0.7, "--yarn-original-max-position-embeddings", 16,
                 "--llama-4-scaling-beta", 0.3, "--llama-4-scaling-length", 16, "--num-experts", 8,
                 "--moe-router-topk", 2, "--moe-ffn-hidden-size", 24, "--moe-layer-freq", "[0]+[1]*3",
                 "--moe-router-topk-scaling-factor", 2.5, "--moe-shared-expert-intermediate-size", 24],
    "deepseek_v32": ["--swiglu", "--untie-embeddings-and-output-weights", "--norm-epsilon", 1e-6,
                     "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", 16, "--kv-lora-rank", 12,
                     "--qk-head-dim", 8, "--qk-pos-emb-head-dim", 4, "--v-head-dim", 6, "--rotary-scaling-factor", 4,
                     "--mscale", 1, "--mscale-all-dim", 0.7, "--yarn-original-max-position-embeddings", 16,
                     "--experimental-attention-variant", "dsa", "--dsa-indexer-topk", 8, "--dsa-indexer-n-heads", 8,
                     "--dsa-indexer-head-dim", 16, "--num-experts", 8,
                     "--moe-router-topk", 4, "--moe-ffn-hidden-size", 24, "--moe-layer-freq", "[0]+[1]*3",
                     "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-dtype",
                     "fp32", "--moe-router-num-groups", 4, "--moe-router-group-topk", 2,
                     "--moe-router-topk-scaling-factor", 2.5, "--moe-shared-expert-intermediate-size", 24],
    "glm_moe_dsa": ["--swiglu", "--untie-embeddings-and-output-weights", "--norm-epsilon", 1e-5,
                    "--mla-latent-norm-epsilon", 1e-6, "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank",
                    16, "--kv-lora-rank", 12, "--qk-head-dim", 8, "--qk-pos-emb-head-dim", 4, "--v-head-dim", 6,
                    "--rope-type", "rope", "--experimental-attention-variant", "dsa", "--dsa-indexer-topk", 8,
                    "--dsa-indexer-n-heads", 8, "--dsa-indexer-head-dim", 16, "--dsa-indexer-topk-freq", 2,
                    "--dsa-indexer-skip-topk-offset", 1, "--num-experts", 8, "--moe-router-topk", 2,
                    "--moe-ffn-hidden-size", 24, "--moe-layer-freq", "[0]+[1]*3", "--moe-router-score-function",
                    "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-dtype", "fp32",
                    "--moe-router-topk-scaling-factor", 2.5, "--moe-shared-expert-intermediate-size", 24],
    "minimax_m2": ["--swiglu", "--num-query-groups", 2, "--kv-channels", 16, "--qk-layernorm",
                   "--qk-norm-across-heads", "--rotary-percent", 0.5, "--rotary-base", 5000000,
                   "--untie-embeddings-and-output-weights", "--norm-epsilon", 1e-6, "--num-experts", 4,
                   "--moe-ffn-hidden-size", 24, "--ffn-hidden-size", 24, "--moe-router-score-function", "sigmoid",
                   "--moe-router-enable-expert-bias"],
    "qwen3_5": GDN_FLAGS,
    "qwen3_5_moe": GDN_FLAGS + GDN_MOE_FLAGS,
    "qwen3_next": GDN_FLAGS + GDN_MOE_FLAGS + ["--moe-layer-freq", "[1,0,1,1]", "--moe-router-pre-softmax"],
}
# fields an import takes from the HF config that flags leave at their defaults (not the architecture)
NOT_ARCHITECTURE = ("family", "init_method_std", "seed", "vocab_size", "max_position_embeddings", "hf_dtype")


@pytest.mark.parametrize("family", FAMILIES)
def test_family_flags_build_the_imported_architecture_and_dry_run_counts_its_parameters(family, tmp_path):
    from hybrid.architecture import architecture_from_flags
    from hybrid.conversion.families import family_of, infer_family
    from hybrid.flags import build_parser
    from hybrid.memory import parameter_inventory
    from hybrid.model.gpt import GPTModel
    from hybrid.model.naming import canonical_parameters
    from hybrid.parallel.groups import ParallelGroups
    overrides = {"num_key_value_heads": 2} if family == "gemma" else {}
    if family == "llama3":  # --use-rope-scaling has Llama 3.1's original length, 8192, as Megatron-LM
        overrides["rope_parameters"] = dict(FAMILY_CONFIGS["llama3"][2]["rope_parameters"],
                                            original_max_position_embeddings=8192)
    make_family(family, tmp_path, tokenizer=False, **overrides)
    imported = read_hf_config(str(tmp_path))
    common = [f for f in COMMON_FLAGS if not (family == "gpt_oss" and f == "--disable-bias-linear")]  # (biased)
    scalars = ["--layer-scalars", ",".join(map(repr, imported.layer_scalars))] if imported.layer_scalars else []
    args = build_parser().parse_args([str(f) for f in common + FAMILY_FLAGS[family] + scalars])
    from hybrid.megatron_compat import check_compat
    check_compat(args)
    flagged = architecture_from_flags(args, 8192)
    clear = {k: None for k in ("family",)}
    assert dataclasses.replace(flagged, **clear) == dataclasses.replace(
        imported, **clear, **{k: getattr(flagged, k) for k in NOT_ARCHITECTURE if k != "family"})
    assert family_of(flagged) == infer_family(flagged) == RECORDED[family]  # trained from flags: recorded and exported
    for tp in (1, 2):
        model = GPTModel(flagged, ParallelGroups.shapes_only(tp, 0))
        real = {n: p.numel() for n, p in canonical_parameters(model, flagged.num_layers).items()}
        assert {n: numel for n, (numel, _) in parameter_inventory(flagged, tp).items()} == real


def test_windowed_attention_in_blocks_equals_the_dense_masked_reference():
    from hybrid.model.attention import allowed_keys, windowed_attention
    g = torch.Generator().manual_seed(0)
    for s, window, block, heads, groups in [(37, 5, 5, 4, 2), (64, 16, 24, 2, 2), (50, 1, 7, 4, 1), (33, 40, 8, 2, 1)]:
        q = torch.randn(2, heads, s, 8, generator=g)
        k, v = (torch.randn(2, groups, s, 8, generator=g) for _ in range(2))
        pos = torch.arange(s)
        mask = allowed_keys(pos, pos, window)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3,
                                                                enable_gqa=heads != groups)
        got = windowed_attention(q, k, v, window, 0.0, 0.3, block=block)
        assert (got - want).abs().max().item() <= 1e-6, (s, window, block)
    # the window is what transformers calls sliding_window: the token itself and window - 1 before it
    assert allowed_keys(torch.tensor([5]), torch.arange(6), 3).tolist() == [[False, False, False, True, True, True]]


def test_rope_scaling_frequencies_equal_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from hybrid.model.rotary import RotaryEmbedding
    for rope in [{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
                 {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                  "original_max_position_embeddings": 4096},
                 {"rope_type": "linear", "factor": 4.0},
                 # YaRN: GPT-OSS's (no mscale: the tables x 0.1 ln(32) + 1), DeepSeek-V3's (mscale = mscale_all_dim:
                 # tables unscaled), mscale against mscale_all_dim, an untruncated ramp, an explicit attention factor
                 {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                  "beta_slow": 1.0},
                 {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                 {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 16.0,
                  "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 0.5, "truncate": False},
                 {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192,
                  "attention_factor": 1.3}]:
        config = LlamaConfig(hidden_size=2048, num_attention_heads=16, max_position_embeddings=131072,
                             rope_parameters=dict(rope, rope_theta=500000.0))
        theirs = LlamaRotaryEmbedding(config)
        ours = RotaryEmbedding(128, 500000.0, rope)
        assert torch.allclose(ours.inv_freq, theirs.inv_freq, rtol=1e-6, atol=0), rope
        cos, sin = ours(64, "cpu")
        x = torch.zeros(1, 64, 128)
        want_cos, want_sin = theirs(x, torch.arange(64)[None])
        assert torch.allclose(cos[:, 0, 0], want_cos[0], atol=1e-6)
        assert torch.allclose(sin[:, 0, 0], want_sin[0], atol=1e-6)


@pytest.mark.parametrize("family,field,fields,message", [
    ("llama3", "rope_scaling.rope_type",
     {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}},
     "rope_scaling.rope_type='dynamic'"),
    ("deepseek_v3", "rope_interleave", {"rope_interleave": False}, "rope_interleave=False"),
    ("deepseek_v3", "num_key_value_heads", {"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ("glm4_moe", "norm_topk_prob", {"norm_topk_prob": False}, "norm_topk_prob=False"),
    ("deepseek_v3", "quantization_config", {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                                     "weight_block_size": [128, 128]}},
     "quantization_config='fp8'"),
    ("glm4_moe", "topk_group", {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2}, "topk_group=2"),
    ("llama3", "attention_bias", {"attention_bias": True}, "attention_bias=True"),
    ("llama3", "mlp_bias", {"mlp_bias": True}, "mlp_bias=True"),
    ("qwen2", "layer_types", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
     "layer_types='mixed sliding/full'"),
    ("qwen3", "attention_bias", {"attention_bias": True}, "attention_bias=True"),
    ("llama3", "hidden_act", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("llama3", "partial_rotary_factor", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                                             "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ("mistral4", "n_group", {"n_routed_experts": 8, "n_group": 4, "topk_group": 2}, "n_group=4"),
    ("mistral4", "rope_type", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                   "llama_4_scaling_beta": 0.1}}, "rope_type='default'"),
    ("minimax_m2", "router_jitter_noise", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ("minimax_m2", "num_experts_per_tok", {"num_experts_per_tok": 1}, "num_experts_per_tok=1"),
    ("gemma4_e", "vocab_size_per_layer_input", {"vocab_size_per_layer_input": 4096}, "vocab_size_per_layer_input=4096"),
    ("gemma4_e", "use_double_wide_mlp", {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                                         "moe_intermediate_size": 16}, "use_double_wide_mlp=True"),
    ("gemma4", "rope_type", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                 "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1e4}}}, "rope_type='linear'"),
])
def test_unsupported_config_field_is_one_message_naming_it(family, field, fields, message, tmp_path):
    make_family(family, tmp_path, tokenizer=False, **fields)
    with pytest.raises(ConfigError) as e:
        read_hf_config(str(tmp_path), "--load-hf")
    assert message in str(e.value) and str(tmp_path) in str(e.value) and "--load-hf" in str(e.value)


def test_mixed_attention_qwen2_window_on_every_layer_imports_as_a_window(tmp_path):
    make_family("qwen2", tmp_path, tokenizer=False, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert read_hf_config(str(tmp_path)).sliding_window == 8


def test_a_field_transformers_never_reads_is_ignored_gpt_oss_hidden_act(tmp_path):
    """GPT-OSS's `hidden_act` (transformers' GptOss model never reads it: its experts' clamped GLU is fixed): another
    value imports as the same model (before: refused as Llama's would be)."""
    make_family("gpt_oss", tmp_path / "act", tokenizer=False, hidden_act="gelu")
    make_family("gpt_oss", tmp_path / "silu", tokenizer=False)
    assert read_hf_config(str(tmp_path / "act")) == read_hf_config(str(tmp_path / "silu"))


# --- launched: evaluation at TP 2 + SP x PP 2, --load-hf training at TP 2 x PP 2, export --------------

TRAIN = ["--seq-length", 32, "--micro-batch-size", 2, "--global-batch-size", 8, "--train-iters", 4, "--lr", 1e-3,
         "--min-lr", 1e-4, "--lr-warmup-iters", 1, "--clip-grad", 1.0, "--eval-iters", 0, "--log-interval", 1,
         "--no-progress-bar"]


# launched for Llama 3, Gemma 3, MiniMax-M2 (whose Q/K norms across heads sum their statistics over TP, forward
# and backward), DeepSeek-V3.2 (its frozen indexer under SP and a pipeline) and Gemma 4 (its full layers' own head
# size and KV heads split over TP, layer scalars in the run's config) (the suite's time; qwen2, qwen3,
# mistral and gemma passed it too): their import, export and resharding are proved in-process above, the MoE
# families' launched evaluations are in tests/test_moe.py
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "gemma3", "minimax_m2", "deepseek_v32", "gemma4"])
def test_load_hf_trains_at_tp2_pp2_sp_as_at_one_rank_evaluates_to_transformers_and_exports_its_family(
        family, hf_models, data, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from tests.test_conversion import hf_windows_loss
    path, hf = hf_models[family]
    if family == "gemma":  # its one KV head cannot split over TP 2: a 2-head variant
        path = tmp_path / "gemma2kv"
        hf = make_family("gemma", path, num_key_value_heads=2)
    flags = ["--load-hf", path, "--data-path", data] + TRAIN
    logs, save, export = tmp_path / "one.jsonl", tmp_path / "ckpt", tmp_path / "export"
    run("python", 1, flags + ["--log-json", logs])
    run("torchrun", 4, flags + ["--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2,
                                "--sequence-parallel", "--log-json", tmp_path / "four.jsonl", "--save", save,
                                "--export-hf", export])
    one, four = ([r["lm_loss"] for r in read_log(p)] for p in (logs, tmp_path / "four.jsonl"))
    assert len(one) == 4 and all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(one, four)), (one, four)
    assert one[0] != one[-1]  # it trained

    # the export: same class, same config fields, loads cleanly, and holds the trained weights
    reloaded, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert type(reloaded).__name__ == type(hf).__name__ and not info["missing_keys"] and not info["unexpected_keys"]
    _assert_kept_fields(path, export)
    original = load_file(str(path / "model.safetensors"))
    trained = load_file(str(export / "model.safetensors"))
    assert set(trained) == set(original) and any(not torch.equal(trained[k], original[k]) for k in original)

    # the imported model at TP 2 + SP x PP 2 evaluates to transformers' loss on the same windows
    from hybrid.conversion.checkpoint_util import main as convert
    assert convert(["--loader", "hf", "--load-dir", str(path), "--save-dir", str(tmp_path / "tp2pp2"),
                    "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2",
                    "--no-progress-bar"]) == 0
    log = tmp_path / "eval.jsonl"
    run("torchrun", 4, ["--load", tmp_path / "tp2pp2", "--data-path", data, "--seq-length", 32, "--micro-batch-size",
                        2, "--eval-iters", 3, "--sequence-parallel", "--log-json", log], script="launch/evaluate.py")
    ours, want = read_log(log)[0]["lm_loss"], hf_windows_loss(hf, data, 32, 6)
    assert abs(ours - want) <= 1e-5 * abs(want), (ours, want)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_gemma_with_windowed_layers_evaluates_to_transformers_loss_at_cp2(family, hf_models, data, tmp_path):
    """Gemma 3's windowed (8) and full layers, each kind its own rope, and Gemma 4's (window 6; its full layers with
    their own head size and KV heads, keys as values, soft-capped logits) at CP 2 (the ring, its blocks masked to the
    window, chunks of 8 over 32 positions): launch/evaluate.py gives transformers' loss on the same windows."""
    from tests.test_moe import assert_evaluation_is_transformers_loss
    path, hf = hf_models[family]
    assert_evaluation_is_transformers_loss(path, hf, data, tmp_path, [("--context-parallel-size", 2)])


@pytest.mark.parametrize("family", FAMILIES)
def test_resharding_an_imported_family_is_exact(family, hf_models, tmp_path):
    from hybrid.conversion.checkpoint_util import main as convert
    from hybrid.conversion.layout import read_hybrid
    path, _ = hf_models[family]
    if family == "gemma":  # one KV head: TP 1 only; reshard over pipeline stages
        layouts = [("1", "2"), ("1", "1")]
    else:
        layouts = [("2", "2"), ("1", "1"), ("2", "1")]
    previous = str(path)
    states = []
    for i, (tp, pp) in enumerate(layouts):
        out = str(tmp_path / f"tp{tp}pp{pp}")
        loader = ["--loader", "hf"] if i == 0 else []
        assert convert(loader + ["--load-dir", previous, "--save-dir", out, "--target-tensor-parallel-size", tp,
                                 "--target-pipeline-parallel-size", pp, "--no-progress-bar"]) == 0
        state, meta = read_hybrid(out)
        from hybrid.checkpoint.client_state import ClientState
        assert ClientState.from_meta(meta).model_config().family == RECORDED[family]
        states.append(state)
        previous = out
    want, _, _ = read_hf_dir(str(path))
    for state in states:
        assert set(state) == set(want) and all(torch.equal(state[k], want[k]) for k in want)


@pytest.mark.parametrize("flags,message", [
    (["--window-size", "5,3"], "--window-size 5,3: a causal model attends no later tokens; use 5,0"),
    (["--window-size", "five"], "argument --window-size: expected LEFT,RIGHT such as 4095,0"),
    (["--window-size=-4,0"], "--window-size -4,0: LEFT must be >= 0"),
    (["--kv-channels", "0"], "--kv-channels must be positive"),
    (["--position-embedding-type", "rope", "--use-rope-scaling", "--rotary-seq-len-interpolation-factor", "4"],
     "are two rope scalings; give one"),
    (["--use-rope-scaling"], "needs --position-embedding-type rope"),
    (["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor", "0"],
     "--rope-scaling-factor must be positive"),
    (["--swiglu", "--geglu"], "--swiglu, --geglu and --quick-geglu are three gated MLPs; give one"),
    (["--padded-vocab-size", "100"], "--padded-vocab-size 100 is smaller than the tokenizer's vocabulary"),
    (["--no-position-embedding"], "--no-position-embedding without rope"),
    (["--load-hf", "{missing}"], "--load-hf {missing}: no such directory"),
    (["--load-hf", "{empty}"], "no config.json; not a HuggingFace model directory"),
    (["--load-hf", "{gpt_neox}"], "architecture ['GPTNeoXForCausalLM'] is not supported; supported: GPT2LMHeadModel"),
    (["--load-hf", "{qwen2}", "--finetune", "--load", "{empty}"], "--load-hf starts from a HuggingFace model"),
])
def test_bad_family_flags_are_one_message_exit_2_and_nothing_written(flags, message, tmp_path, capsys, hf_models):
    from hybrid.training.run import main
    (tmp_path / "empty").mkdir()
    (tmp_path / "gpt_neox").mkdir()
    (tmp_path / "gpt_neox" / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    places = {"{missing}": str(tmp_path / "missing"), "{empty}": str(tmp_path / "empty"),
              "{gpt_neox}": str(tmp_path / "gpt_neox"), "{qwen2}": str(hf_models["qwen2"][0])}
    argv = [places.get(f, f) for f in flags] + ["--mock-data", "--train-iters", "1", "--save", str(tmp_path / "out"),
                                                "--no-progress-bar"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    want = message
    for key, value in places.items():
        want = want.replace(key, value)
    assert err.startswith("error: ") and want in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_gemma3_export_writes_each_layer_kinds_rope_as_the_model_computes_it_and_refuses_a_scale_it_cannot_write():
    """Gemma 3 from flags: without --local-rotary-base its windowed layers take the full layers' (scaled) rope, and
    the export says so (it wrote them unscaled before: other logits); with it, they take the local base unscaled;
    either way the HF config reads back to the same per-layer ropes. A --softmax-scale that is no 1/sqrt(n) for
    a whole n has no query_pre_attn_scalar: one message at the export check, not transformers' validation error."""
    from hybrid.conversion.families import Gemma3Adapter
    from hybrid.model.config import ModelConfig
    base = dict(num_layers=6, hidden_size=32, num_attention_heads=4, vocab_size=64, position_embedding_type="rope",
                normalization="RMSNorm", geglu=True, apply_layernorm_1p=True, scale_embeddings=True, qk_layernorm=True,
                sandwich_norms=True, add_bias_linear=False, sliding_window=8, window_attn_skip_freq=6,
                rope_scaling={"rope_type": "linear", "factor": 8.0}, rotary_base=1e6)
    for local in (None, 1e4):
        config = ModelConfig(**base, local_rotary_base=local)
        hf = Gemma3Adapter(config).hf_config({})
        assert hf.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
        assert hf.rope_parameters["sliding_attention"]["rope_type"] == ("linear" if local is None else "default")
        back = Gemma3Adapter.config_from_hf(hf)
        assert [back.layer_rope(i) for i in range(6)] == [config.layer_rope(i) for i in range(6)]
        assert [back.layer_window(i) for i in range(6)] == [8] * 5 + [None]
    with pytest.raises(ConfigError, match="--softmax-scale 0.09 is not 1/sqrt"):
        Gemma3Adapter(ModelConfig(**base, softmax_scale=0.09)).check_exportable()
