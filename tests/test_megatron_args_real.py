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
    from hybrid.conversion.megatron.args import NOT_MODEL_ARGS, REFUSED_ARGS, config_from_args
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
    # DeepSeek's MLA (the latents normed: --qk-layernorm), YaRN and MoE, as their config.json hold them
    "deepseek-ai/DeepSeek-R1.sh": dict(
        DENSE, num_layers=61, hidden_size=7168, num_attention_heads=128, multi_latent_attention=True, q_lora_rank=1536,
        kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True, num_experts=256,
        moe_router_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=8,
        moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5, moe_layer_freq=[0] * 3 + [1] * 58,
        rope_scaling=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                          beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
    "deepseek-ai/DeepSeek-V2-Lite.sh": dict(
        DENSE, num_layers=27, hidden_size=2048, num_attention_heads=16, multi_latent_attention=True, q_lora_rank=None,
        kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, num_experts=64, moe_router_topk=6,
        moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=2816, moe_router_score_function="softmax",
        moe_layer_freq=[0] + [1] * 26,
        rope_scaling=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                          beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)),
    "moonshotai/Kimi-K2-Instruct.sh": dict(
        DENSE, num_layers=61, hidden_size=7168, num_attention_heads=64, multi_latent_attention=True, q_lora_rank=1536,
        kv_lora_rank=512, v_head_dim=128, num_experts=384, moe_router_topk=8, moe_ffn_hidden_size=2048,
        moe_shared_expert_intermediate_size=2048, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_num_groups=None, moe_router_topk_scaling_factor=2.827,
        moe_layer_freq=[0] + [1] * 60, rope_scaling=dict(rope_type="yarn", factor=32.0,
                                                         original_max_position_embeddings=4096, beta_fast=32.0,
                                                         beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
    # GPT-OSS: learned sinks, windowed and full layers alternating, biases everywhere, the clamped quick-GeGLU,
    # --enable-gpt-oss's YaRN (post-training's flag: added below, the fixtures' parser lacks it)
    **{f"openai/gpt-oss-{size}.sh": dict(
        num_layers=layers, hidden_size=2880, num_attention_heads=64, num_query_groups=8, kv_channels=64,
        ffn_hidden_size=2880, num_experts=experts, moe_router_topk=4, moe_ffn_hidden_size=2880, attention_sinks=True,
        quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0, sliding_window=128,
        window_attn_skip_freq=2, add_bias_linear=True, add_qkv_bias=False, swiglu=False, rotary_base=150000.0,
        untie_embeddings_and_output_weights=True,
        rope_scaling=dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=131072, beta_fast=32.0,
                          beta_slow=1.0, truncate=False)) for size, layers,
       experts in (("20b", 24, 32), ("120b", 36, 128))},
}
HYBRID = "a hybrid (Mamba / attention)"
REFUSALS = {
    "meta-llama/Llama-4-Maverick-17B-128E-Instruct.sh": "--no-rope-freq 4",
    "meta-llama/Llama-4-Scout-17B-16E-Instruct.sh": "--rotary-interleaved",
    "nvidia/Nemotron-Mini-4B-Instruct.sh": "--squared-relu",  # (its --rotary-percent 0.5 is read)
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
    from hybrid.conversion.megatron.args import config_from_args
    from hybrid.errors import ConfigError
    from hybrid.flags import build_parser
    from hybrid.megatron_compat import check_compat
    gpt_oss = {"enable_gpt_oss": True} if "--enable-gpt-oss" in RUNS[script]["argv"] else {}
    config = config_from_args(megatron_args(dict(RUNS[script]["args"], **gpt_oss)), where=script)
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
    from hybrid.conversion.megatron.args import config_from_args
    from hybrid.errors import ConfigError
    with pytest.raises(ConfigError, match=REFUSALS[script].replace("(", r"\(").replace(")", r"\)")):
        config_from_args(megatron_args(RUNS[script]["args"]), where=script)


# --- Megatron-DeepSpeed: its own parser on its example scripts (tests/fixtures/megatron_deepspeed_args) ---------

MDS_FIXTURES = os.path.join(os.path.dirname(FIXTURES), "megatron_deepspeed_args")


def _load_mds(name: str) -> dict:
    with open(os.path.join(MDS_FIXTURES, name)) as f:
        return json.load(f)


MDS_TABLE = {entry["dest"]: entry for entry in _load_mds("arguments.json")["arguments"]}
MDS_SCRIPTS = _load_mds("run_scripts.json")["scripts"]
MDS_PARSED = {name: run for name, run in MDS_SCRIPTS.items() if "error" not in run["args"]}


def mds_config(changes: dict, read=None):
    """hybrid's model of Megatron-DeepSpeed args: its parser's defaults with `changes`, read as a checkpoint's
    stored args are (megatron_lm_args, then config_from_args); `read` collects every name either reads."""
    from hybrid.conversion.megatron.args import config_from_args
    from hybrid.conversion.megatron.megatron_deepspeed import megatron_lm_args
    values = {name: entry["default"] for name, entry in MDS_TABLE.items()}
    values.update(changes)
    values["padded_vocab_size"] = values.get("padded_vocab_size") or 1024
    args = _Reads(read, **values) if read is not None else argparse.Namespace(**values)
    spelled = megatron_lm_args(args, "x")
    if read is not None:
        spelled = _Reads(read, **vars(spelled))
    return config_from_args(spelled, where="x")


def test_every_model_argument_of_megatron_deepspeeds_parser_is_read_refused_or_explained():
    """Megatron-DeepSpeed's parser (its "network size" group and its MoE training arguments), as it parsed its own
    example scripts: each argument is read, refused by name, or listed with why it leaves the model alone."""
    from hybrid.conversion.megatron.args import NOT_MODEL_ARGS, REFUSED_ARGS
    from hybrid.conversion.megatron.megatron_deepspeed import (MEGATRON_DEEPSPEED_REFUSED,
                                                               NOT_MODEL_ARGS_MEGATRON_DEEPSPEED)
    from hybrid.errors import ConfigError
    read = set()
    small = dict(num_layers=2, hidden_size=64, num_attention_heads=4, max_position_embeddings=32, seq_length=32)
    for changes in [small, dict(small, use_rotary_position_embeddings=True, add_position_embedding=False)] + \
            [run["args"] for run in MDS_PARSED.values()]:
        try:
            mds_config(changes, read)
        except ConfigError:
            pass
    explained = {name for names in (*NOT_MODEL_ARGS.values(), *NOT_MODEL_ARGS_MEGATRON_DEEPSPEED.values())
                 for name in names}
    model = [name for name, entry in MDS_TABLE.items()
             if entry["group"] == "network size" or name.startswith("moe_") or name in ("topk", "mlp_type")]
    assert len(model) == 39
    missing = [name for name in model if name not in read | set(REFUSED_ARGS) | set(MEGATRON_DEEPSPEED_REFUSED)
               | explained]
    assert missing == []
    assert [name for names in NOT_MODEL_ARGS_MEGATRON_DEEPSPEED.values() for name in names
            if name not in MDS_TABLE] == []


MDS_POSITIONS_AND_ROPE = "adds a learned position table to the embeddings besides rotary embeddings"
MDS_REFUSED = {name: "a Megatron-DeepSpeed mixture of experts" for name, run in MDS_PARSED.items()
               if any(int(e) > 1 for e in run["args"]["num_experts"])}
MDS_REFUSED.update({name: MDS_POSITIONS_AND_ROPE for name, run in MDS_PARSED.items()
                    if run["args"]["use_rotary_position_embeddings"]})


def test_megatron_deepspeeds_example_scripts_were_all_parsed_but_a_template():
    """48 example scripts launch a GPT entry point; every one parsed but the data-efficiency base script (a
    template its run script calls with positional arguments); 31 GPT models read, 7 MoE and 9 rotary ones refused."""
    assert len(MDS_SCRIPTS) == 48 and [name for name in MDS_SCRIPTS if name not in MDS_PARSED] == [
        "examples_deepspeed/data_efficiency/gpt/pretrain/ds_pretrain_gpt_1.3B_dense_base_script.sh"]
    assert len(MDS_REFUSED) == 16 and len(MDS_PARSED) - len(MDS_REFUSED) == 31


@pytest.mark.parametrize("script", sorted(MDS_PARSED))
def test_a_megatron_deepspeed_example_script_is_its_model_or_refused_by_name(script):
    """What Megatron-DeepSpeed's parser made of its own example: the GPT's size, heads, FFN, positions, norm and its
    epsilon, dropout, tied head and the QK layer scaling as hybrid reads them from a checkpoint with those args; its
    DeepSpeed-MoE models and its rotary models (which keep the learned position table: its Llama scripts give no
    --no-position-embedding) refused by name."""
    from hybrid.errors import ConfigError
    args = MDS_PARSED[script]["args"]
    if script in MDS_REFUSED:
        with pytest.raises(ConfigError, match=MDS_REFUSED[script]):
            mds_config(args)
        return
    config = mds_config(args)
    want = dict(num_layers=args["num_layers"], hidden_size=args["hidden_size"],
                num_attention_heads=args["num_attention_heads"],
                ffn_hidden_size=args["ffn_hidden_size"] or 4 * args["hidden_size"],
                max_position_embeddings=args["max_position_embeddings"], position_embedding_type="learned_absolute",
                normalization="LayerNorm", norm_epsilon=args["layernorm_epsilon"], swiglu=False,
                hidden_dropout=args["hidden_dropout"], attention_dropout=args["attention_dropout"],
                untie_embeddings_and_output_weights=args["untie_embeddings_and_output_weights"])
    for field, value in want.items():
        assert getattr(config, field) == value, (script, field, getattr(config, field), value)



def test_megatron_deepspeeds_switch_mlp_is_refused_by_name():
    from hybrid.errors import ConfigError
    small = dict(num_layers=2, hidden_size=64, num_attention_heads=4, max_position_embeddings=32, seq_length=32)
    with pytest.raises(ConfigError, match="--num-experts-switch 8: Megatron-LM's old Switch MLP"):
        mds_config(dict(small, num_experts_switch=8))
