"""The capability table is the one source: flag checks raise its messages, the dry-run advisor only
proposes what it allows, and the README's tables are generated from it (and from the compat table)."""

import os

import pytest

from checks.docs import page_with
from hybrid import capabilities, megatron_compat
from hybrid.capabilities import RULES, Setup
from hybrid.config import build_run_config
from hybrid.errors import ConfigError
from hybrid.flags import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--num-layers", 4, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 16,
        "--micro-batch-size", 1, "--global-batch-size", 4, "--train-iters", 2, "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", 64]
PP2 = ["--pipeline-model-parallel-size", 2]
GDN = ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", 2, "--linear-num-key-heads", 2,
       "--linear-num-value-heads", 4, "--linear-key-head-dim", 8, "--linear-value-head-dim", 8]

# one command line per rule that the rule (and no earlier one) refuses: (flags, world size)
EXAMPLES = {
    "cp-ulysses": (["--context-parallel-size", 2, "--ds-sequence-parallel-size", 2], 4),
    "fp16-cpu": (["--fp16"], 1),
    "bf16-fp32-accumulation-pipeline": None,  # a DeepSpeed config's data_types: checked with one below
    "dualpipev-micro-batches": (PP2 + ["--pipeline-schedule", "dualpipev", "--global-batch-size", 2], 2),
    "torch-schedule-micro-batches": (PP2 + ["--pipeline-schedule", "zbv", "--global-batch-size", 1], 2),
    "compile-zero3": (["--torch-compile", "--zero-stage", 3], 1),
    "rampup-pipeline": (PP2 + ["--rampup-batch-size", 2, 2, 8, "--global-batch-size", 4], 2),
    "universal-zero0-fp32": (["--universal-checkpoint", "--load", "/tmp"], 1),
    "universal-zero3-tp": (["--universal-checkpoint", "--load", "/tmp", "--zero-stage", 3,
                            "--tensor-model-parallel-size", 2], 2),
    "flash-attn-cpu": None,  # flash-attn is not installable here: its absence is refused first; Setup below
    "flash-attn-fp32": None,
    "moe-zero3-ep": (["--num-experts", 4, "--disable-bias-linear", "--zero-stage", 3, "--expert-model-parallel-size",
                      2], 2),
    "grad-reduce-bf16-precision": (["--grad-reduce-in-bf16"], 1),
    "moe-tp-without-sp": (["--num-experts", 4, "--disable-bias-linear", "--tensor-model-parallel-size", 2], 2),
    "moe-stage-without-experts": (PP2 + ["--num-experts", 4, "--disable-bias-linear", "--moe-layer-freq", "[1,1,0,0]",
                                         "--pipeline-partition", "2,2"], 2),
    "moe-universal-pipeline": (PP2 + ["--num-experts", 4, "--disable-bias-linear", "--universal-checkpoint", "--load",
                                      "/tmp", "--zero-stage", 1], 2),
    "cp-sequence-chunks": (["--context-parallel-size", 2, "--seq-length", 18], 2),
    "cp-sp-shards": (["--context-parallel-size", 2, "--tensor-model-parallel-size", 4, "--sequence-parallel",
                      "--seq-length", 12], 8),
    "ulysses-sequence": (["--ds-sequence-parallel-size", 2, "--seq-length", 15], 2),
    "ulysses-heads": (["--ds-sequence-parallel-size", 4, "--group-query-attention", "--num-query-groups", 2], 4),
    "ulysses-sp-shards": (["--ds-sequence-parallel-size", 2, "--tensor-model-parallel-size", 2, "--sequence-parallel",
                           "--seq-length", 18], 4),
    "fp8-mxfp8": (["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"], 1),
    "fp8-blockwise": (["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"], 1),
    "fp8-param-gather": (["--fp8-format", "hybrid", "--fp8-param-gather"], 1),
    "fp8-fp16": None,  # --fp16 is refused first on this CPU (fp16-cpu); a GPU's Setup below
    "cpu-offloading-recompute": (["--cpu-offloading", "--recompute-granularity", "selective"], 1),
    "dpo-pipeline-reference": None,  # --dpo needs pair data and --load-hf: tests/test_sft.py checks the refusal
    "grpo-kl-pipeline": (PP2 + ["--grpo", "--grpo-beta", 0.1, "--load-hf", "hf-dir", "--global-batch-size", 16], 2),
    "grpo-moe-capacity": (["--grpo", "--num-experts", 4, "--disable-bias-linear", "--moe-expert-capacity-factor", 1.0,
                           "--global-batch-size", 16], 1),
    "grpo-rampup": (["--grpo", "--rampup-batch-size", 8, 8, 64, "--global-batch-size", 16], 1),
    "muon-precision": (["--optimizer", "muon", "--bf16"], 1),
    "mtp-objective": (["--grpo", "--position-embedding-type", "rope", "--mtp-num-layers", 1, "--global-batch-size", 16],
                      1),
    "mla-fp8": (["--multi-latent-attention", "--qk-layernorm", "--position-embedding-type", "rope", "--fp8-format",
                 "hybrid"], 1),
    "dsa-sequence-split": (["--multi-latent-attention", "--qk-layernorm", "--position-embedding-type", "rope",
                            "--q-lora-rank", 8, "--experimental-attention-variant", "dsa",
                            "--context-parallel-size", 2], 2),
    "dsa-share-recompute": (["--multi-latent-attention", "--qk-layernorm", "--position-embedding-type", "rope",
                             "--q-lora-rank", 8, "--experimental-attention-variant", "dsa", "--dsa-indexer-topk-freq",
                             2, "--dsa-indexer-skip-topk-offset", 1, "--recompute-granularity", "full"], 1),
    "dsa-share-stages": (PP2 + ["--multi-latent-attention", "--qk-layernorm", "--position-embedding-type", "rope",
                                "--q-lora-rank", 8, "--experimental-attention-variant", "dsa",
                                "--dsa-indexer-topk-freq", 2, "--dsa-indexer-skip-topk-offset", 1,
                                "--pipeline-schedule", "zbv"], 2),
    "per-layer-inputs-pipeline": (PP2 + ["--position-embedding-type", "rope", "--per-layer-input-size", 4], 2),
    "kv-share-recompute": (["--position-embedding-type", "rope", "--num-kv-shared-layers", 2, "--recompute-granularity",
                            "full"], 1),
    "kv-share-stages": (PP2 + ["--position-embedding-type", "rope", "--num-kv-shared-layers", 2], 2),
    "dsa-universal": (["--multi-latent-attention", "--qk-layernorm", "--position-embedding-type", "rope",
                       "--q-lora-rank", 8, "--experimental-attention-variant", "dsa", "--universal-checkpoint",
                       "--load", "/tmp", "--zero-stage", 1], 1),
    "muon-mla-mtp": (["--position-embedding-type", "rope", "--mtp-num-layers", 1, "--optimizer", "muon"], 1),
    "mtp-split-backward": (PP2 + ["--position-embedding-type", "rope", "--mtp-num-layers", 1, "--pipeline-schedule",
                                  "zbv"], 2),
    "lora-fp8": (["--lora-rank", 4, "--fp8-format", "hybrid"], 1),
    "lora-muon": (["--lora-rank", 4, "--optimizer", "muon"], 1),
    "lora-universal": (["--lora-rank", 4, "--universal-checkpoint", "--load", "/tmp", "--zero-stage", 1], 1),
    "lora-moe-zero": (["--lora-rank", 4, "--num-experts", 4, "--disable-bias-linear", "--zero-stage", 1], 1),
    "gdn-sequence-split": (GDN + ["--context-parallel-size", 2, "--linear-num-key-heads", 1], 2),
    "gdn-fp8-muon-lora": (["--position-embedding-type", "rope", "--attention-output-gate", "--optimizer", "muon"], 1),
}


_HF_DIR: list = []


def _hf_dir() -> str:
    """A tiny HF Llama (the start plan reads --load-hf's architecture when the run's config is built)."""
    if not _HF_DIR:
        import tempfile

        from tests.hf_families import make_family
        path = tempfile.mkdtemp(prefix="hybrid-capabilities-hf-")
        make_family("llama3", path, tokenizer=False, vocab_size=64)
        _HF_DIR.append(path)
    return _HF_DIR[0]


def _argv(flags):
    flags = [_hf_dir() if f == "hf-dir" else f for f in flags]
    base = list(BASE)
    if "--rampup-batch-size" in flags:  # a sample-based run length, as Megatron-LM needs for a ramp
        i = base.index("--train-iters")
        base[i:i + 2] = ["--train-samples", 64]
    if "--grpo" in flags:  # GRPO makes its own samples: no --mock-data
        base.remove("--mock-data")
        base += ["--max-new-tokens", 4]
    return [str(f) for f in base + flags]


def _build(flags, world):
    return build_run_config(build_parser().parse_args(_argv(flags)), world, 64, eod_token=63)


def test_every_rule_has_an_example():
    assert set(EXAMPLES) == {rule.name for rule in RULES}


@pytest.mark.parametrize("rule", [r for r in RULES if EXAMPLES[r.name] is not None], ids=lambda r: r.name)
def test_flag_checks_raise_the_tables_message(rule):
    """The rule's own message (replaced here by a marker) is what flag checking raises: the checks read
    the table, they do not restate it."""
    flags, world = EXAMPLES[rule.name]
    with pytest.raises(ConfigError) as real:
        _build(flags, world)
    original = rule.message
    object.__setattr__(rule, "message", lambda setup: f"RULE {rule.name}")  # Rule is frozen
    try:
        with pytest.raises(ConfigError) as marked:
            _build(flags, world)
    finally:
        object.__setattr__(rule, "message", original)
    assert str(marked.value) == f"RULE {rule.name}", str(real.value)
    assert str(real.value) == original(_setup_of(flags, world)) or str(real.value).startswith(
        original(_setup_of(flags, world)).split(":")[0])


def _setup_of(flags, world):
    """A Setup close to the one the flags describe (for the message text only)."""
    args = build_parser().parse_args(_argv(flags))
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    split = args.context_parallel_size * args.ds_sequence_parallel_size
    return Setup(pp=pp, tp=tp, schedule=args.pipeline_schedule or "1f1b", zero_stage=args.zero_stage or 0,
                 precision="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
                 micro_batches=args.global_batch_size // (args.micro_batch_size * (world // (pp * tp * split))),
                 zero_source="--zero-stage", cp=args.context_parallel_size,
                 ulysses=args.ds_sequence_parallel_size, experts=bool(args.num_experts),
                 ep=args.expert_model_parallel_size, optimizer=args.optimizer or "adam")


def test_the_same_flags_without_the_conflict_build():
    _build(PP2 + ["--pipeline-schedule", "zbv"], 2)  # ZB-V itself is fine: the rules above refuse combinations
    _build(PP2 + ["--zero-stage", 1], 2)
    _build(["--torch-compile", "--zero-stage", 2], 1)
    # lifted with the one runtime: ZeRO-2/3 and bf16 on every schedule, recompute and compile with zero-bubble
    for schedule in ("1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev"):
        extra = [] if schedule in ("1f1b", "zbv", "dualpipev") else ["--num-virtual-stages-per-pipeline-rank", 2]
        for zero in (2, 3):
            _build(PP2 + ["--pipeline-schedule", schedule, *extra, "--zero-stage", zero, "--global-batch-size", 8], 4)
        _build(PP2 + ["--pipeline-schedule", schedule, *extra, "--bf16", "--global-batch-size", 8], 2)
    _build(PP2 + ["--pipeline-schedule", "zbv", "--recompute-granularity", "full"], 2)
    _build(PP2 + ["--pipeline-schedule", "zero-bubble", "--num-virtual-stages-per-pipeline-rank", 2,
                  "--torch-compile"], 2)
    _build(PP2 + ["--global-batch-size", 1], 2)  # 1f1b with fewer micro-batches than stages (torch's GPipe order)


def test_fp16_with_a_pipeline_is_allowed_on_a_gpu_setup():
    for schedule in ("1f1b", "interleaved-1f1b", "zbv"):
        for zero in (0, 1, 3):
            assert capabilities.allowed(Setup(pp=2, schedule=schedule, precision="fp16", zero_stage=zero,
                                              micro_batches=4))


def test_bf16_fp32_accumulation_with_zero1_is_refused_at_pp_only(tmp_path):
    import json
    config = tmp_path / "zero1_fp32_accum.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
                                  "data_types": {"grad_accum_dtype": "fp32"}}))
    with pytest.raises(ConfigError, match="BF16_Optimizer"):
        _build(PP2 + ["--deepspeed", config], 2)
    _build(["--deepspeed", config], 1)
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
                                  "data_types": {"grad_accum_dtype": "fp32"}}))
    _build(PP2 + ["--deepspeed", config], 2)


def test_fp8_with_fp16_is_refused_on_a_gpu_and_fp8_with_bf16_is_not():
    assert [r.name for r in capabilities.refusals(Setup(fp8="delayed", precision="fp16"))] == ["fp8-fp16"]
    assert [r.name for r in capabilities.refusals(Setup(fp8="tensorwise", precision="fp16"))] == ["fp8-fp16"]
    assert capabilities.allowed(Setup(fp8="delayed", precision="bf16"))
    assert capabilities.allowed(Setup(precision="fp16"))


def test_an_fp8_recipe_without_a_format_is_refused_and_the_format_alone_takes_megatrons_default():
    """--fp8-recipe only chooses how FP8 scales: given without --fp8-format (which turns FP8 on) it was ignored;
    now one message. --fp8-format alone trains with Megatron-LM's default recipe, delayed."""
    with pytest.raises(ConfigError, match="--fp8-recipe tensorwise without --fp8-format"):
        _build(["--fp8-recipe", "tensorwise"], 1)
    assert _build(["--fp8-format", "hybrid"], 1).model.fp8_recipe == "delayed"
    assert _build(["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"], 1).model.fp8_recipe == "rowwise"
    assert _build([], 1).model.fp8_recipe is None


def test_flash_attn_needs_a_gpu_and_half_precision():
    assert [r.name for r in capabilities.refusals(Setup(flash_attn=True, accelerator="cpu", precision="bf16"))] == \
        ["flash-attn-cpu"]
    assert [r.name for r in capabilities.refusals(Setup(flash_attn=True))] == ["flash-attn-fp32"]
    assert capabilities.allowed(Setup(flash_attn=True, precision="bf16"))


def test_zero_stages_and_stage_placement_come_from_the_table():
    allowed_stages = {pp: [z for z in range(4) if capabilities.allowed(Setup(pp=pp, zero_stage=z, micro_batches=4))]
                      for pp in (1, 2)}
    assert allowed_stages == {1: [0, 1, 2, 3], 2: [0, 1, 2, 3]}
    assert capabilities.stage_placement("zbv", 2) == capabilities.stage_placement("zbv", 2)
    assert capabilities.stage_placement("zero-bubble", 2) != capabilities.stage_placement("zbv", 2)


def _readme_block(marker: str) -> str:
    readme = page_with(marker)
    return readme.split(f"<!-- {marker} -->\n", 1)[1].split(f"\n<!-- /{marker} -->", 1)[0]


def test_readme_capability_table_is_generated_from_the_table():
    assert _readme_block("capability-table") == capabilities.markdown_table()


def test_readme_flag_table_is_generated_from_the_compat_table():
    assert _readme_block("compat-table") == megatron_compat.markdown_table()


def test_readme_families_table_is_generated_from_the_registry():
    from hybrid.conversion import families
    assert _readme_block("families-table") == families.markdown_table()


def test_value_rules_refuse_with_the_flag_named():
    with pytest.raises(ConfigError, match="--position-embedding-type alibi is not supported"):
        _build(["--position-embedding-type", "alibi"], 1)
    with pytest.raises(ConfigError, match="--dataloader-type cyclic is not supported"):
        _build(["--dataloader-type", "cyclic"], 1)
    _build(["--kv-channels", 16, "--dataloader-type", "single"], 1)  # any head dimension (Qwen3, Gemma)


# --- the dry-run advisor proposes only what the table and the model's shape rules allow ---------------

def _plan(**overrides):
    from hybrid.memory import MemoryPlan, ZeroSettings
    from hybrid.model.config import ModelConfig
    model = ModelConfig(**dict(dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=1000,
                                    max_position_embeddings=64, ffn_hidden_size=96), **overrides.pop("model", {})))
    return MemoryPlan(model=model, **dict(dict(tp=1, pp=1, dp=4, micro_batch=2, seq_length=64, num_micro_batches=2,
                                               zero=ZeroSettings(stage=1, dp=4)), **overrides))


def test_advisor_skips_a_tp_the_ffn_does_not_divide_and_keeps_the_global_batch():
    from hybrid.dry_run import _candidates, _proposals
    plan = _plan(model=dict(ffn_hidden_size=98))
    changes = dict(_candidates(plan))
    assert "--tensor-model-parallel-size 2" in changes
    tp2 = changes["--tensor-model-parallel-size 2"]
    assert (tp2.dp, tp2.num_micro_batches, tp2.micro_batch) == (2, 4, 2), "global batch 2 x 2 x 4 kept"
    odd = _plan(model=dict(ffn_hidden_size=99))
    assert "--tensor-model-parallel-size 2" in dict(_proposals(odd))
    assert "--tensor-model-parallel-size 2" not in dict(_candidates(odd)), "ffn 99 does not split over TP 2"
    pp2 = changes["--pipeline-model-parallel-size 2"]
    assert (pp2.dp, pp2.num_micro_batches) == (2, 4)


def test_advisor_never_proposes_what_the_table_refuses():
    from hybrid.dry_run import _candidates, _setup
    plan = _plan(pp=2, dp=2, schedule="zbv", virtual=2, num_micro_batches=4, zero=_plan().zero.__class__(stage=1, dp=2))
    changes = dict(_candidates(plan))
    assert any(c.startswith("ZeRO-3") for c in changes), "ZeRO-3 with PP (the one runtime)"
    assert all(capabilities.allowed(_setup(candidate)) for candidate in changes.values())


def test_advisor_proposals_respect_the_experts_ep_and_compile_rules():
    from hybrid.dry_run import _candidates, _proposals
    moe = dict(num_experts=4, add_bias_linear=False, moe_ffn_hidden_size=32)
    plan = _plan(model=moe, ep=2)
    proposed, allowed = dict(_proposals(plan)), dict(_candidates(plan))
    assert "ZeRO-3 (ds_configs/zero3.json)" in proposed and "ZeRO-3 (ds_configs/zero3.json)" not in allowed, \
        "ZeRO-3 at EP 2"
    assert "--tensor-model-parallel-size 2" in proposed and "--tensor-model-parallel-size 2" not in allowed, \
        "TP 2 for experts needs --sequence-parallel"
    assert "ZeRO-2 (ds_configs/zero2.json)" in allowed
    compiled = _plan(torch_compile=True)
    assert "ZeRO-3 (ds_configs/zero3.json)" in dict(_proposals(compiled))
    assert "ZeRO-3 (ds_configs/zero3.json)" not in dict(_candidates(compiled)), "--torch-compile with ZeRO-3"
    # a DP the EP no longer divides is never proposed (TP 2 leaves DP 2 at EP 2: allowed with SP)
    plan4 = _plan(model=dict(moe, sequence_parallel=True), ep=4)
    assert "--tensor-model-parallel-size 2" not in dict(_candidates(plan4)), "EP 4 does not divide DP 2"

