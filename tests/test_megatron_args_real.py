"""Megatron-LM's arguments as its own parser makes them (tests/fixtures/megatron_lm_args, written by
make_fixtures.py there from a Megatron-LM checkout): every argument that could describe the model is read, refused
or explained by hybrid's Megatron reader, and the model flags of Megatron-LM's public run scripts for HF models
(examples/post_training/modelopt/conf) become the model those HF checkpoints hold, or one message naming what
hybrid does not compute."""

from __future__ import annotations

import argparse
import json
import os

import pytest

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "megatron_lm_args")
# the parser's groups whose arguments can describe the model (the rest: optimizer, data, logging, checkpointing, ...)
MODEL_GROUPS = {"network size", "transformer configuration", "mla", "moe", "experimental",
                "heterogeneous architecture", "experimental_attention_variant"}


def _load(name: str) -> dict:
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


TABLE = _load("arguments.json")["arguments"]
RUNS = _load("run_scripts.json")["runs"]


def _value(value):
    from hybrid.safe_loading import MegatronEnum
    if isinstance(value, dict) and "enum" in value:  # a megatron-core enum, as a checkpoint's args are read
        return MegatronEnum(value["value"])
    return [_value(v) for v in value] if isinstance(value, list) else value


class _Reads(argparse.Namespace):
    """Args that record every name read from them."""

    def __init__(self, read: set, **values):
        super().__init__(**values)
        object.__setattr__(self, "_read", read)

    def __getattribute__(self, name):
        if not name.startswith("_"):
            object.__getattribute__(self, "_read").add(name)
        return object.__getattribute__(self, name)


def megatron_args(changes: dict, read=None) -> argparse.Namespace:
    """Megatron-LM's parser's defaults with `changes` (a parsed script's values), and the padded vocabulary a
    run adds once its tokenizer is built (not a parser argument)."""
    values = {name: _value(entry["default"]) for name, entry in TABLE.items()}
    values.update({name: _value(v) for name, v in changes.items()})
    values["padded_vocab_size"] = values.get("padded_vocab_size") or 1024
    return _Reads(read, **values) if read is not None else argparse.Namespace(**values)


def test_every_model_argument_of_megatron_lms_parser_is_read_refused_or_explained():
    """Each of the parser's 300 arguments of its model groups is read by config_from_args (on a dense model, a MoE
    model and every real script), refused by name (REFUSED_ARGS), or listed in NOT_MODEL_ARGS with why it leaves
    the model alone; in one of them only, and no listed name is one the parser does not have."""
    from hybrid.conversion.megatron import NOT_MODEL_ARGS, REFUSED_ARGS, config_from_args
    from hybrid.errors import ConfigError
    read = set()
    small = dict(num_layers=2, hidden_size=64, num_attention_heads=4, max_position_embeddings=32, seq_length=32)
    for changes in [small, dict(small, num_experts=4), dict(small, position_embedding_type="rope")] + \
            [run["args"] for run in RUNS.values()]:
        try:
            config_from_args(megatron_args(changes, read), where="x")
        except ConfigError:
            pass
    explained = [name for names in NOT_MODEL_ARGS.values() for name in names]
    model = [name for name, entry in TABLE.items() if entry["group"] in MODEL_GROUPS]
    assert len(model) == 300
    assert [name for name in model if name not in read | set(REFUSED_ARGS) | set(explained)] == []
    assert len(explained) == len(set(explained)) and not set(explained) & (read | set(REFUSED_ARGS))
    assert [name for name in [*explained, *REFUSED_ARGS] if name not in TABLE] == []


# what each script's model is (the HF model's config.json, which the script describes for Megatron-LM), or the
# refusal; the norm epsilon is Megatron-LM's default where a script does not give it (1e-5; those HF models: 1e-6)
DENSE = dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope")
MODELS = {
    "Qwen/Qwen2.5-0.5B-Instruct.sh": dict(DENSE, num_layers=24, hidden_size=896, num_attention_heads=14,
                                          num_query_groups=2, ffn_hidden_size=4864, add_qkv_bias=True,
                                          untie_embeddings_and_output_weights=False, rotary_base=1e6),
    "Qwen/Qwen2.5-7B-Instruct.sh": dict(DENSE, num_layers=28, hidden_size=3584, num_attention_heads=28,
                                        num_query_groups=4, ffn_hidden_size=18944, add_qkv_bias=True,
                                        untie_embeddings_and_output_weights=True, rotary_base=1e6),
    "Qwen/Qwen3-0.6B.sh": dict(DENSE, num_layers=28, hidden_size=1024, num_attention_heads=16, num_query_groups=8,
                               kv_channels=128, ffn_hidden_size=3072, qk_layernorm=True,
                               untie_embeddings_and_output_weights=False, rotary_base=1e6),
    "Qwen/Qwen3-8B.sh": dict(DENSE, num_layers=36, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                             ffn_hidden_size=12288, qk_layernorm=True, untie_embeddings_and_output_weights=True),
    "Qwen/Qwen3-30B-A3B.sh": dict(DENSE, num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                                  kv_channels=128, qk_layernorm=True, num_experts=128, moe_router_topk=8,
                                  moe_ffn_hidden_size=768, moe_router_load_balancing_type="aux_loss",
                                  moe_aux_loss_coeff=1e-3),
    "Qwen/Qwen3-235B-A22B.sh": dict(DENSE, num_layers=94, hidden_size=4096, num_attention_heads=64, num_query_groups=4,
                                    kv_channels=128, qk_layernorm=True, num_experts=128, moe_router_topk=8,
                                    moe_ffn_hidden_size=1536),
    "meta-llama/Llama-3.1-8B-Instruct.sh": dict(DENSE, num_layers=32, hidden_size=4096, num_attention_heads=32,
                                                num_query_groups=8, ffn_hidden_size=14336, rotary_base=500000.0,
                                                untie_embeddings_and_output_weights=True, norm_epsilon=1e-5),
    "meta-llama/Llama-3.2-1B-Instruct.sh": dict(DENSE, num_layers=16, hidden_size=2048, num_attention_heads=32,
                                                num_query_groups=8, ffn_hidden_size=8192, rotary_base=500000.0,
                                                untie_embeddings_and_output_weights=False),
}
HYBRID = "a hybrid (Mamba / attention)"
REFUSALS = {
    "deepseek-ai/DeepSeek-R1.sh": "multi-latent attention", "deepseek-ai/DeepSeek-V2-Lite.sh": "multi-latent attention",
    "moonshotai/Kimi-K2-Instruct.sh": "multi-latent attention",
    "meta-llama/Llama-4-Maverick-17B-128E-Instruct.sh": "--no-rope-freq 4",
    "meta-llama/Llama-4-Scout-17B-16E-Instruct.sh": "--rotary-interleaved",
    "nvidia/Nemotron-Mini-4B-Instruct.sh": "--rotary-percent 0.5",
    "openai/gpt-oss-20b.sh": "--window-attn-skip-freq 2", "openai/gpt-oss-120b.sh": "--window-attn-skip-freq 2",
    **{name: HYBRID for name in RUNS if name.startswith("nvidia/") and "Nemotron-Mini" not in name},
    # helpers beside Kimi-K2's script that set a few flags, no model
    "moonshotai/kimi_k2_instruct.sh": "lack num_layers", "moonshotai/kimi_k2_instruct_export.sh": "lack num_layers",
}


def test_the_fixtures_cover_every_script():
    assert sorted(MODELS) + sorted(REFUSALS) and set(MODELS) | set(REFUSALS) == set(RUNS)
    assert not set(MODELS) & set(REFUSALS)


@pytest.mark.parametrize("script", sorted(MODELS))
def test_a_public_run_script_parsed_by_megatron_lm_is_the_hf_models_architecture(script):
    """The model flags Megatron-LM's own parser made of the script become the HF model's architecture: GQA, the
    tied or untied head, QKV biases, Q/K norms, the rope base and Llama 3's scaling, the MoE (before: Qwen3-MoE's
    one-element balancing list, as the parser makes it, was refused); and hybrid's own parser knows every flag of
    the script (accepted, mapped, or refused by name: --trust-remote-code, --moe-layer-recompute)."""
    from hybrid.conversion.megatron import config_from_args
    from hybrid.errors import ConfigError
    from hybrid.flags import build_parser
    from hybrid.megatron_compat import check_compat
    config = config_from_args(megatron_args(RUNS[script]["args"]), where=script)
    for field, want in MODELS[script].items():
        assert getattr(config, field) == want, (script, field, getattr(config, field))
    if "Llama-3" in script:
        assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 8.0
    argv = [a for a in RUNS[script]["argv"] if a not in RUNS[script]["not_megatron_lm_flags"]]
    args, unknown = build_parser().parse_known_args(argv)
    assert unknown == [], (script, unknown)
    try:
        check_compat(args)
    except ConfigError as e:  # refused by name, with what to use instead
        named = [line for line in str(e).splitlines() if "is not supported" in line]
        assert named and all(n.lstrip().startswith(("--trust-remote-code", "--moe-layer-recompute"))
                             for n in named), (script, e)


@pytest.mark.parametrize("script", sorted(REFUSALS))
def test_a_public_run_script_of_a_model_hybrid_does_not_build_is_refused_by_name(script):
    from hybrid.conversion.megatron import config_from_args
    from hybrid.errors import ConfigError
    with pytest.raises(ConfigError, match=REFUSALS[script].replace("(", r"\(").replace(")", r"\)")):
        config_from_args(megatron_args(RUNS[script]["args"]), where=script)
