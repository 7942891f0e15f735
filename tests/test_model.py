"""GPT-2 and Llama style models: every layout computes what one rank computes (fp32, <= 1e-5)."""

import math

import pytest
import torch

from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig
from checks.rank_pool import assert_close, run_on_ranks
from tests.model_harness import CONFIGS, assemble_grads, batch, compare_grads, reference, sharded_run

ATOL = 1e-5


@pytest.mark.parametrize("style,sequence_parallel", [("gpt2", False), ("gpt2", True), ("llama", False), ("llama", True),
                                                     ("family_options", True), ("gemma", True)])
def test_tp2_logits_loss_and_grads_equal_tp1(style, sequence_parallel):
    cfg, data = CONFIGS[style], batch()
    ref_loss, ref_logits, ref_grads = reference(cfg, data)
    results = run_on_ranks(sharded_run, 2, cfg, 2, 1, data, sequence_parallel)
    assert abs(results[0]["loss"] - ref_loss) <= ATOL and results[0]["loss"] == results[1]["loss"]
    logits = torch.cat([r["logits"] for r in results], dim=-1)
    assert logits.size(-1) == ModelConfig(**cfg).padded_vocab_size(2)
    assert_close(logits[..., :cfg["vocab_size"]], ref_logits[..., :cfg["vocab_size"]], ATOL, "logits")
    compare_grads(assemble_grads(results), ref_grads, cfg["vocab_size"], ATOL)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_pp2_loss_and_every_grad_equal_one_rank(style):
    cfg, data = CONFIGS[style], batch()
    ref_loss, _, ref_grads = reference(cfg, data)
    results = run_on_ranks(sharded_run, 2, cfg, 1, 2, data)
    assert all(abs(r["loss"] - ref_loss) <= ATOL for r in results)
    compare_grads(assemble_grads(results), ref_grads, cfg["vocab_size"], ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("style", ["gpt2", "llama", "family_options", "gemma"])
def test_tp2_pp2_loss_and_every_grad_equal_one_rank(style):
    cfg, data = CONFIGS[style], batch()
    ref_loss, _, ref_grads = reference(cfg, data)
    results = run_on_ranks(sharded_run, 4, cfg, 2, 2, data, True)
    assert all(abs(r["loss"] - ref_loss) <= ATOL for r in results)
    compare_grads(assemble_grads(results), ref_grads, cfg["vocab_size"], ATOL)


def test_pp2_explicit_partition_list_equals_one_rank():
    cfg, data = CONFIGS["gpt2"], batch()
    ref_loss, _, ref_grads = reference(cfg, data)
    results = run_on_ranks(sharded_run, 2, cfg, 1, 2, data, partition="list:1,3")
    assert sorted(n for n in results[0]["grads"] if n.startswith("layers.")) == \
        sorted(f"layers.0.{k}" for k in _layer_param_suffixes(results[0]["grads"]))
    assert all(abs(r["loss"] - ref_loss) <= ATOL for r in results)
    compare_grads(assemble_grads(results), ref_grads, cfg["vocab_size"], ATOL)


def _layer_param_suffixes(grads):
    return {n.split(".", 2)[2] for n in grads if n.startswith("layers.")}


def _recompute_grads(cfg, recompute):
    """Gradients with dropout on, from the same seeds: recompute must replay identical masks."""
    cfg = dict(cfg, hidden_dropout=0.1, attention_dropout=0.1)
    overrides = {}
    if recompute:
        granularity, method, n = recompute
        overrides = dict(recompute_granularity=granularity, recompute_method=method, recompute_num_layers=n)
    import deepspeed
    original, calls = deepspeed.checkpointing.checkpoint, []

    def counting(fn, *args):
        calls.append(type(fn).__name__)
        return original(fn, *args)

    deepspeed.checkpointing.checkpoint = counting
    try:
        out = sharded_run(cfg, 2, 1, batch(), sequence_parallel=True, **overrides)
    finally:
        deepspeed.checkpointing.checkpoint = original
    out["checkpointed"] = calls
    return out


@pytest.mark.parametrize("style", ["gpt2", "llama", "family_options"])
def test_full_and_selective_recompute_give_the_same_gradients_as_none(style):
    cfg = CONFIGS[style]
    baseline = run_on_ranks(_recompute_grads, 2, cfg, None)
    assert baseline[0]["checkpointed"] == []
    no_dropout = run_on_ranks(sharded_run, 2, cfg, 2, 1, batch(), True)
    assert no_dropout[0]["loss"] != baseline[0]["loss"], "dropout must be active for this test to mean anything"
    # sharded_run makes two forward passes (logits, then loss) over 4 layers
    expected_calls = {("full", "uniform", 2): ["LayerChunk"] * 4, ("full", "block", 1): ["TransformerLayer"] * 2,
                      ("selective", "uniform", 1): ["CoreAttention"] * 8}
    for recompute, calls in expected_calls.items():
        results = run_on_ranks(_recompute_grads, 2, cfg, recompute)
        assert results[0]["checkpointed"] == calls, recompute
        for base, got in zip(baseline, results):
            assert got["loss"] == base["loss"], recompute
            for name, (grad, _, _) in base["grads"].items():
                assert torch.equal(got["grads"][name][0], grad), (recompute, name)


def _offloaded_recompute_grads(cfg, ds_config):
    """Full recompute with dropout, DeepSpeed's checkpointing configured from `ds_config` as build_engine
    does: the checkpointed inputs that took DeepSpeed's host-copy path, and the gradients."""
    import deepspeed
    from deepspeed.runtime.activation_checkpointing import checkpointing
    from hybrid.training.deepspeed_fixes import keep_host_activations_when_offloading
    cfg = dict(cfg, hidden_dropout=0.1, attention_dropout=0.1)
    deepspeed.init_distributed(dist_backend="gloo")  # (configure logs through DeepSpeed's comm)
    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=bool(
        (ds_config.get("activation_checkpointing") or {}).get("cpu_checkpointing")))
    keep_host_activations_when_offloading()
    original, offloaded = checkpointing.get_cpu_activations_for_backward, []

    def recording(args, inputs):
        offloaded.extend(t.device.type for t in inputs if checkpointing.is_activation_to_checkpoint(t))
        return original(args, inputs)

    checkpointing.get_cpu_activations_for_backward = recording
    try:
        out = sharded_run(cfg, 2, 1, batch(), sequence_parallel=True, recompute_granularity="full",
                          recompute_method="uniform", recompute_num_layers=1)
    finally:
        checkpointing.get_cpu_activations_for_backward = original
        deepspeed.checkpointing.configure(None, checkpoint_in_cpu=False)
    out["offloaded"] = offloaded
    return out


def test_cpu_offloading_moves_checkpointed_inputs_to_host_and_changes_no_gradient():
    from tests.test_capabilities import _build
    run = _build(["--recompute-granularity", "full", "--cpu-offloading"], 2)
    assert run.cpu_offloading and run.ds_config["activation_checkpointing"]["cpu_checkpointing"] is True
    plain = _build(["--recompute-granularity", "full"], 2)
    assert not plain.cpu_offloading
    cfg = CONFIGS["llama"]
    baseline = run_on_ranks(_offloaded_recompute_grads, 2, cfg, plain.ds_config)
    assert baseline[0]["offloaded"] == []
    results = run_on_ranks(_offloaded_recompute_grads, 2, cfg, run.ds_config)
    # two forward passes (logits, then loss) over 4 layers, one checkpoint per layer: each layer's input
    assert results[0]["offloaded"] == ["cpu"] * 8
    for base, got in zip(baseline, results):
        assert got["loss"] == base["loss"]
        for name, (grad, _, _) in base["grads"].items():
            assert torch.equal(got["grads"][name][0], grad), name


def test_rope_matches_complex_rotation_reference():
    from hybrid.model.rotary import RotaryEmbedding, apply_rotary
    s, b, n, d, base = 12, 2, 3, 8, 500.0
    x = torch.randn(s, b, n, d, dtype=torch.float64)
    cos, sin = RotaryEmbedding(d, base)(s, x.device)
    got = apply_rotary(x, cos.double(), sin.double())
    # Direct reference: pair feature j with j + d/2 as a complex number, rotate by p * theta_j.
    theta = base ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * theta[None, :]  # [s, d/2]
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * torch.polar(torch.ones_like(angle), angle)[:, None, None, :]
    want = torch.cat([z.real, z.imag], dim=-1)
    assert_close(got, want, 1e-6, "rope")


def test_rope_matches_transformers_llama():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, LlamaRotaryEmbedding
    from transformers import LlamaConfig
    from hybrid.model.rotary import RotaryEmbedding, apply_rotary
    s, n, d = 10, 2, 16
    hf_rope = LlamaRotaryEmbedding(LlamaConfig(hidden_size=n * d, num_attention_heads=n, rope_theta=10000.0,
                                               max_position_embeddings=64))
    q = torch.randn(1, n, s, d)
    cos, sin = hf_rope(q, torch.arange(s)[None])
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)
    c, si = RotaryEmbedding(d, 10000.0)(s, q.device)
    got = apply_rotary(q.permute(2, 0, 1, 3), c, si).permute(1, 2, 0, 3)
    assert_close(got, want, 1e-6, "rope vs transformers")


def test_vocabulary_is_padded_as_megatron_and_padding_never_wins_the_loss():
    config = ModelConfig(**dict(CONFIGS["gpt2"], make_vocab_size_divisible_by=128))
    assert config.padded_vocab_size(1) == 128 and config.padded_vocab_size(4) == 512
    assert ModelConfig(vocab_size=50257).padded_vocab_size(2) == 50432  # GPT-2 at TP 2, as Megatron
    from hybrid.parallel.cross_entropy import vocab_parallel_cross_entropy
    logits = torch.zeros(1, 1, 8)
    logits[..., 6:] = 100.0  # huge padded logits must not change the loss
    loss = vocab_parallel_cross_entropy(logits, torch.tensor([[1]]), None, vocab_size=6)
    assert abs(loss.item() - math.log(6)) < 1e-6


def test_tied_head_has_no_output_layer_and_untied_does():
    from hybrid.model.gpt import GPTModel
    tied = dict(GPTModel(ModelConfig(**CONFIGS["gpt2"])).named_parameters())
    untied = dict(GPTModel(ModelConfig(**CONFIGS["llama"])).named_parameters())
    assert "output_layer.weight" not in tied and "output_layer.weight" in untied
    assert "embedding.position_embeddings.weight" in tied and "embedding.position_embeddings.weight" not in untied


def test_same_seed_gives_same_full_weights_at_tp1_and_tp2():
    from hybrid.model.gpt import GPTModel
    from hybrid.parallel.layers import unshard
    full = dict(GPTModel(ModelConfig(**CONFIGS["llama"])).named_parameters())
    results = [_weights_tp2(CONFIGS["llama"], rank) for rank in range(2)]  # shapes only: no ranks needed
    for name, (_, dim, stride) in results[0].items():
        shards = [r[name][0] for r in results]
        got = unshard(shards, dim, stride) if dim is not None else shards[0]
        if got.size(0) > full[name].size(0):
            got = got[: full[name].size(0)]
        assert torch.equal(got, full[name].detach()), name


def _weights_tp2(cfg, tp_rank):
    from hybrid.model.gpt import GPTModel
    from hybrid.parallel.groups import ParallelGroups
    model = GPTModel(ModelConfig(**cfg), ParallelGroups.shapes_only(2, tp_rank))
    return {n: (p.detach().clone(), getattr(p, "partition_dim", None), getattr(p, "partition_stride", 1))
            for n, p in model.named_parameters()}


def test_model_config_errors_name_the_flag():
    with pytest.raises(ConfigError, match="--num-query-groups 3 is not divisible by --tensor-model-parallel-size 2"):
        ModelConfig(**dict(CONFIGS["llama"], num_attention_heads=6, hidden_size=48, num_query_groups=3)).validate(2)
    with pytest.raises(ConfigError, match="--hidden-size 30 must be divisible by --num-attention-heads 4"):
        ModelConfig(**dict(CONFIGS["gpt2"], hidden_size=30))


def test_pipeline_larger_than_layers_is_a_clear_error():
    from hybrid.memory import partition_layers
    from hybrid.pipeline_plan import plan_stages
    config = ModelConfig(**dict(CONFIGS["gpt2"], num_layers=1))
    for check in (lambda: partition_layers(config, 1, 2), lambda: plan_stages(1, 2, 1, "1f1b")):
        with pytest.raises(ConfigError, match="--pipeline-model-parallel-size 2 is larger than --num-layers 1"):
            check()


def test_query_key_layer_scaling_math_equals_plain_attention():
    """Megatron's fp16 path (scores / (sqrt(d) x layer), softmax in fp32 after x layer) is the same
    function as plain attention; check it in fp32 on CPU (fp16 needs a GPU)."""
    from hybrid.model.attention import CoreAttention
    config = ModelConfig(**dict(CONFIGS["gpt2"], apply_query_key_layer_scaling=True))
    core = CoreAttention(config, layer_number=5).eval()
    q, k, v = (torch.randn(2, 4, 10, 8) for _ in range(3))
    got = core._scaled_math(q, k, v, 0.0)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=core.scale)
    assert_close(got, want, 1e-6, "query-key layer scaling")
    assert core.backend(q.half()) == "scaled_math" and core.backend(q) == "sdpa"


@pytest.mark.parametrize("style,sequence_parallel", [("gpt2", False), ("llama", True)])
def test_overlapped_tp_backward_is_bitwise_the_synchronous_one(style, sequence_parallel):
    """The column-parallel layers' input-gradient all-reduce (SP: reduce-scatter) started before the
    weight gradient and waited for after it (the default) changes no value: loss and every gradient
    bitwise equal to the synchronous mappings (--no-async-tensor-model-parallel-allreduce)."""
    cfg, data = CONFIGS[style], batch()
    overlapped = run_on_ranks(sharded_run, 2, cfg, 2, 1, data, sequence_parallel)
    synchronous = run_on_ranks(sharded_run, 2, cfg, 2, 1, data, sequence_parallel,
                               async_tensor_model_parallel_allreduce=False)
    for a, b in zip(overlapped, synchronous):
        assert a["loss"] == b["loss"]
        for name, (grad, _, _) in a["grads"].items():
            assert torch.equal(grad, b["grads"][name][0]), f"grad {name} differs"
