"""The --dry-run memory estimator against reality: parameter, gradient and optimizer bytes equal
DeepSpeed's own buffers exactly (fp32, DP = 2, ZeRO-0/1/2/3, on CPU ranks); activation bytes per
layer within 10% of what torch's saved-tensor hooks see (no, selective, full recompute; TP 1 and
TP 2 with and without SP; GPT-2 and Llama style); Korthikanti et al.'s Table 2 reproduced term by
term; the parameter inventory equals the real model's parameters; `launch/train.py --dry-run`."""

import dataclasses
import json
import math
import os

import pytest
import torch

from hybrid import memory
from hybrid.memory import activations
from hybrid.config import build_run_config
from hybrid.flags import build_parser
from hybrid.model.config import ModelConfig
from checks.rank_pool import run_on_ranks

# hidden 34 / 1 layer: the no-decay group (510 elements) is not a multiple of 2 x DP, so the
# estimate must reproduce DeepSpeed's padding
TINY = ["--num-layers", "1", "--hidden-size", "34", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
        "--train-iters", "3", "--no-progress-bar", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _deepspeed_state_bytes(stage: int, ds_path: str, extra: tuple = ()) -> dict:
    """One real step at DP = 2; the bytes of DeepSpeed 0.19's own buffers by category."""
    from hybrid.parallel.groups import build_groups
    from hybrid.training.engine import build_engine
    run = build_run_config(build_parser().parse_args(TINY + ["--deepspeed_config", ds_path, *extra]), 2, 100)
    engine, model = build_engine(run, build_groups())
    opt = engine.optimizer
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = engine(ids, ids)
    engine.backward(loss)
    if stage == 0:
        grads = _bytes(p.grad for p in model.parameters())
    elif stage in (1, 2):
        grads = _bytes(t for group in opt.averaged_gradients.values() for t in group)
    else:
        grads = _bytes([opt.grad_partitions_flat_buffer])
    engine.step()
    inner = getattr(opt, "optimizer", opt)
    states = _bytes(v for state in inner.state.values() for v in state.values() if torch.is_tensor(v))
    frozen = [p for p in model.parameters() if not p.requires_grad]  # (LoRA's base: no flat group holds them)
    if stage == 0:
        params, master = _bytes(model.parameters()), 0
    elif stage in (1, 2):
        params, master = _bytes(opt.bit16_groups_flat) + _bytes(frozen), _bytes(opt.single_partition_of_fp32_groups)
    else:
        flat = opt.fp16_partitioned_groups_flat
        persistent = [p for p in model.parameters() if p.ds_persist]
        params = (_bytes(flat) + sum(p.ds_numel * p.element_size() for p in persistent)
                  + sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in frozen))
        master = _bytes(opt.fp32_partitioned_groups_flat)
        assert {t.data_ptr() for t in flat}.isdisjoint(t.data_ptr() for t in opt.fp32_partitioned_groups_flat)
    groups = [[p.numel() if stage < 3 else p.ds_numel for p in g["params"]] for g in param_groups_of(engine)]
    from hybrid.training.deepspeed_fixes import release_engine  # (the pool's ranks serve later modules)
    release_engine(engine)
    return dict(params=params, grads=grads, optimizer=states + master, groups=groups)


def param_groups_of(engine):
    opt = engine.optimizer
    if hasattr(opt, "bit16_groups"):
        return [{"params": g} for g in opt.bit16_groups]
    if hasattr(opt, "fp16_groups"):
        return [{"params": g} for g in opt.fp16_groups]
    return opt.param_groups


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_state_bytes_equal_deepspeeds_buffers_at_dp2(stage, tmp_path):
    config = {"zero_optimization": {"stage": stage, "reduce_bucket_size": 50000,
                                    "stage3_param_persistence_threshold": 1000}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    measured = run_on_ranks(_deepspeed_state_bytes, 2, stage, str(path))[0]
    args = build_parser().parse_args(TINY)
    run = build_run_config(args, 2, 100)
    inventory = memory.parameter_inventory(run.model, 1)
    groups = [[n for n, decayed in inventory.values() if decayed],
              [n for n, decayed in inventory.values() if not decayed]]
    assert sorted(map(sorted, groups)) == sorted(map(sorted, measured["groups"]))
    if stage in (1, 2):
        assert sum(groups[1]) % 4 != 0, "the test model must exercise DeepSpeed's partition padding"
    estimate = memory.model_state_bytes(groups, memory.ZeroSettings(stage=stage, dp=2, persistence_threshold=1000))
    for key in ("params", "grads", "optimizer"):
        assert estimate[key] == measured[key], (key, estimate, measured)


def _small_buckets_config(tmp_path, stage: int):
    """A DeepSpeed config at `stage` whose buckets and ZeRO-3 persistence fit the tiny model (so it partitions)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage, "reduce_bucket_size": 50000,
                                                      "stage3_param_persistence_threshold": 1000}}))
    return path


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_lora_state_bytes_equal_deepspeeds_buffers_at_dp2(stage, tmp_path):
    """--lora-rank: DeepSpeed's groups, partitions and moments hold the adapters only; the frozen base is its weights
    alone (whole under ZeRO-0/1/2, partitioned under ZeRO-3): hybrid.memory's count of each, byte for byte."""
    lora = ("--lora-rank", "2", "--lora-target-modules", "all-linear", "--swiglu", "--disable-bias-linear")
    path = _small_buckets_config(tmp_path, stage)
    measured = run_on_ranks(_deepspeed_state_bytes, 2, stage, str(path), lora)[0]
    run = build_run_config(build_parser().parse_args(TINY + list(lora)), 2, 100)
    plan = memory.MemoryPlan(run.model, dp=2, zero=memory.ZeroSettings(stage=stage, dp=2, persistence_threshold=1000))
    inventory = memory.parameter_inventory(run.model, 1)
    adapters = [n for name, (n, _) in inventory.items() if ".lora." in name]
    assert sorted(n for g in measured["groups"] for n in g) == sorted(adapters) and len(adapters) == 14
    estimate = memory._stage_model_states(inventory, plan)
    for key in ("params", "grads", "optimizer"):
        assert estimate[key] == measured[key], (key, estimate, measured)
    full = memory._stage_model_states(inventory, memory.MemoryPlan(dataclasses.replace(run.model, lora_rank=0),
                                                                    dp=2, zero=plan.zero))
    assert estimate["optimizer"] * 10 < full["optimizer"]


@pytest.mark.parametrize("stage", [1, 3])
def test_dsa_state_bytes_leave_out_the_frozen_indexer_as_deepspeed_does(stage, tmp_path):
    """DeepSeek sparse attention: the optimizer holds everything but the frozen indexer, whose weights are counted
    alone (whole under ZeRO-1, partitioned under ZeRO-3), byte for byte as DeepSpeed holds them."""
    dsa = ("--multi-latent-attention", "--qk-layernorm", "--position-embedding-type", "rope", "--q-lora-rank", "16",
           "--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "4", "--dsa-indexer-head-dim", "72",
           "--swiglu", "--disable-bias-linear")
    path = _small_buckets_config(tmp_path, stage)
    measured = run_on_ranks(_deepspeed_state_bytes, 2, stage, str(path), dsa)[0]
    run = build_run_config(build_parser().parse_args(TINY + list(dsa)), 2, 100)
    plan = memory.MemoryPlan(run.model, dp=2, zero=memory.ZeroSettings(stage=stage, dp=2, persistence_threshold=1000))
    inventory = memory.parameter_inventory(run.model, 1)
    trained = [n for name, (n, _) in inventory.items() if not memory.frozen_indexer(name, run.model)]
    assert sorted(n for g in measured["groups"] for n in g) == sorted(trained) and len(trained) < len(inventory)
    estimate = memory._stage_model_states(inventory, plan)
    for key in ("params", "grads", "optimizer"):
        assert estimate[key] == measured[key], (key, estimate, measured)


@pytest.mark.parametrize("stage", [1, 3])
def test_muon_state_bytes_under_zero_equal_what_its_optimizer_holds(stage, tmp_path):
    """--optimizer muon under ZeRO: the fp32 partitions of AdamW's two groups and of the Muon matrices, AdamW's
    moments and steps, Muon's partitioned momentum buffer, as hybrid.memory counts them."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1000}}))
    measured = run_on_ranks(_deepspeed_state_bytes, 2, stage, str(path), ("--optimizer", "muon"))[0]
    run = build_run_config(build_parser().parse_args(TINY + ["--optimizer", "muon"]), 2, 100)
    inventory = memory.parameter_inventory(run.model, 1)
    assert len(measured["groups"]) == 3  # AdamW's decayed and undecayed parameters, the Muon matrices
    estimate = memory._sharded_muon_state_bytes(inventory, memory.ZeroSettings(stage=stage, dp=2,
                                                                                persistence_threshold=1000))
    assert estimate["optimizer"] == measured["optimizer"], (estimate, measured)


def _model_config(style: str, dropout: float, recompute, sequence_parallel=False) -> ModelConfig:
    common = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, max_position_embeddings=64,
                  hidden_dropout=dropout, attention_dropout=dropout, recompute_granularity=recompute,
                  sequence_parallel=sequence_parallel)
    if style != "gpt2":
        common.update(normalization="RMSNorm", swiglu=True, num_query_groups=2, position_embedding_type="rope",
                      add_bias_linear=False)
    if style == "qwen3":  # Q/K norms, a head dimension of its own
        common.update(qk_layernorm=True, kv_channels=32)
    if style == "mistral":  # a window shorter than the sequence: the blocked path
        common.update(sliding_window=24)
    if style == "gemma":
        common.update(swiglu=False, geglu=True, apply_layernorm_1p=True, scale_embeddings=True, kv_channels=32)
    return ModelConfig(**common)


def _measured_layer_bytes(config: ModelConfig, groups, seq: int, batch: int, dtype=torch.float32,
                         layout=None) -> float:
    """Bytes kept for backward per layer by two layers (one micro-batch): what the saved-tensor
    hooks see, plus the inputs DeepSpeed's checkpoint function keeps as attributes of its
    autograd context (invisible to the hooks). Parameters are not activations."""
    import deepspeed

    from hybrid.model.recompute import run_layers
    from hybrid.model.transformer import TransformerLayer
    from hybrid.parallel.groups import as_groups
    groups = as_groups(groups)
    layers = [TransformerLayer(config, groups, i).to(dtype).train() for i in range(config.num_layers)]
    params = {p.untyped_storage().data_ptr() for layer in layers for p in layer.parameters()}
    kept = {}

    def record(t):
        if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    checkpoint = deepspeed.checkpointing.checkpoint

    def recording_checkpoint(fn, *args):
        for a in args:
            record(a)
        return checkpoint(fn, *args)

    rows = seq // groups.sequence_split  # this rank's tokens under CP / Ulysses
    rows = rows // groups.tp_size if config.sequence_parallel else rows
    x = torch.randn(rows, batch, config.hidden_size, dtype=dtype, requires_grad=True)
    deepspeed.checkpointing.checkpoint = recording_checkpoint
    try:
        with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
            run_layers(layers, x, config, training=True, layout=layout)
    finally:
        deepspeed.checkpointing.checkpoint = checkpoint
    return sum(kept.values()) / config.num_layers


def _estimated_layer_bytes(config: ModelConfig, tp: int, seq: int, batch: int, precision="fp32", cp=1,
                          ulysses=1) -> int:
    kernel = "flash" if cp > 1 else activations.attention_kernel_for("cpu", precision, config.attention_dropout, config)
    act = activations.ActivationSettings(batch, seq, tp, config.sequence_parallel, precision,
                                         config.recompute_granularity, kernel,
                                         mask_bytes=activations.BYTES[precision],  # CPU keeps masks in that dtype
                                         cp=cp, ulysses=ulysses)
    return activations.layer_activation_bytes(config, act)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("recompute", [None, "selective", "full"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_layer_activation_bytes_within_10pct_of_saved_tensors(style, recompute, dropout):
    config = _model_config(style, dropout, recompute)
    measured = _measured_layer_bytes(config, None, seq=64, batch=2)
    estimated = _estimated_layer_bytes(config, 1, seq=64, batch=2)
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured)


@pytest.mark.parametrize("style", ["qwen3", "mistral", "gemma"])
@pytest.mark.parametrize("recompute,dropout", [(None, 0.0), ("selective", 0.0), (None, 0.1)])
def test_family_layer_activation_bytes_within_10pct_of_saved_tensors(style, recompute, dropout):
    config = _model_config(style, dropout, recompute)
    measured = _measured_layer_bytes(config, None, seq=300, batch=2)
    estimated = _estimated_layer_bytes(config, 1, seq=300, batch=2)
    assert abs(estimated - measured) <= 0.10 * measured, (style, estimated, measured)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("recompute", [None, "selective"])
def test_layer_activation_bytes_in_bf16(style, recompute):
    config = _model_config(style, 0.0, recompute)
    measured = _measured_layer_bytes(config, None, seq=64, batch=2, dtype=torch.bfloat16)
    estimated = _estimated_layer_bytes(config, 1, seq=64, batch=2, precision="bf16")
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured)


def _tp2_cases():
    from hybrid.parallel.groups import build_groups
    topology = build_groups(tensor_parallel=2)
    out = []
    for style in ("gpt2", "llama"):
        for sp in (False, True):
            for recompute in (None, "selective", "full"):
                config = _model_config(style, 0.1, recompute, sequence_parallel=sp)
                out.append((style, sp, recompute, _measured_layer_bytes(config, topology, 64, 2),
                            _estimated_layer_bytes(config, 2, 64, 2)))
    return out


def test_layer_activation_bytes_at_tp2_with_and_without_sp():
    for style, sp, recompute, measured, estimated in run_on_ranks(_tp2_cases, 2)[0]:
        assert abs(estimated - measured) <= 0.10 * measured, (style, sp, recompute, estimated, measured)


def _sequence_split_cases():
    from hybrid.model.sequence import sequence_layout
    from hybrid.parallel.groups import build_groups
    out = []
    for cp, ulysses in ((2, 1), (1, 2)):
        topology = build_groups(context_parallel=cp, ulysses=ulysses)
        for style in ("gpt2", "llama"):
            for recompute in (None, "selective"):
                config = dataclasses.replace(_model_config(style, 0.1, recompute), attention_dropout=0.0)
                layout = sequence_layout(torch.zeros(2, 128, dtype=torch.long), config, topology)
                out.append((style, cp, ulysses, recompute,
                            _measured_layer_bytes(config, topology, 128, 2, layout=layout),
                            _estimated_layer_bytes(config, 1, 128, 2, cp=cp, ulysses=ulysses)))
    return out


def test_layer_activation_bytes_at_cp2_and_ulysses2():
    """Each rank keeps the activations of its seq / N tokens (the ring's merged output, Ulysses'
    all-to-all'd q, k, v besides), as the estimate says."""
    for style, cp, ulysses, recompute, measured, estimated in run_on_ranks(_sequence_split_cases, 2)[0]:
        assert abs(estimated - measured) <= 0.10 * measured, (style, cp, ulysses, recompute, estimated, measured)


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (8, False), (8, True)])
@pytest.mark.parametrize("recompute", [None, "selective", "full"])
def test_megatron_accounting_reproduces_korthikanti_table2(tp, sp, recompute):
    # GPT-3 175B's layer (h 12288, 96 heads, s 2048, micro batch 1) and a small one
    for s, b, h, a in ((2048, 1, 12288, 96), (1024, 4, 2048, 16)):
        config = ModelConfig(num_layers=1, hidden_size=h, num_attention_heads=a, vocab_size=1000,
                             max_position_embeddings=s, sequence_parallel=sp)
        act = activations.ActivationSettings(b, s, tp, sp, "bf16", recompute, "math", mask_bytes=1)
        assert activations.layer_activation_bytes(config, act, style="megatron") == pytest.approx(
            activations.korthikanti_layer_bytes(s, b, h, a, tp, sp, recompute), rel=1e-12)


def test_korthikanti_gpt3_figure():
    # the paper's section 4: GPT-3 175B, no parallelism, sbh(34 + 5as/h) = 34 + 80 per sbh
    s, b, h, a = 2048, 1, 12288, 96
    assert activations.korthikanti_layer_bytes(s, b, h, a) / (s * b * h) == pytest.approx(34 + 5 * 96 * 2048 / 12288)
    assert activations.korthikanti_layer_bytes(s, b, h, a, 8, True, "selective") / (s * b * h) == pytest.approx(34 / 8)


def _real_stage_parameters(config_kwargs: dict, tp: int, pp: int, partition: str) -> dict:
    """On a rank of a real TP x PP topology: its stage, the canonical parameter sizes of the model the runtime
    builds there (1f1b, the stages as --pipeline-partition divides them), and DeepSpeed's own PipelineModule
    partition of the same layer list (the split its pipeline engine gave checkpoints: the reference)."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    from hybrid.memory import partition_layers
    from hybrid.model.build import build_rank_model
    from hybrid.model.embedding import Embedding, OutputHead
    from hybrid.model.naming import canonical_parameters
    from hybrid.model.norms import LayerNorm, RMSNorm
    from hybrid.model.transformer import TransformerLayer
    from hybrid.parallel.groups import build_groups
    from hybrid.pipeline_plan import PipelineSchedule, resolve_partition
    topology = build_groups(tensor_parallel=tp, pipeline_parallel=pp)
    config = ModelConfig(**config_kwargs)
    layers = partition_layers(config, tp, pp, partition)
    model = build_rank_model(config, topology, PipelineSchedule("1f1b", 1, partition, layers))
    params = canonical_parameters(model, config.num_layers)
    method = resolve_partition(partition, config.num_layers, pp)
    specs = ([LayerSpec(Embedding, config, topology)] + [LayerSpec(TransformerLayer, config, topology, i)
                                                         for i in range(config.num_layers)]
             + [LayerSpec(RMSNorm if config.normalization == "RMSNorm" else LayerNorm, config.hidden_size,
                          config.norm_epsilon, topology, False, one_plus=config.apply_layernorm_1p),
                LayerSpec(_TiedHead if config.tied_embeddings else OutputHead, config, topology)])
    reference = None
    if not method.startswith("list:"):
        reference = PipelineModule(layers=specs, topology=topology.ds_topology, partition_method=method).parts
    return {"stage": topology.pp.rank, "params": {n: p.numel() for n, p in params.items()}, "layers": layers,
            "deepspeed_bounds": reference}


class _TiedHead(__import__("torch").nn.Module):
    """What DeepSpeed's TiedLayerSpec put on the last stage: the word embeddings again (counted in its partition)."""

    def __init__(self, config, groups):
        super().__init__()
        from hybrid.model.embedding import Embedding
        self.word_embeddings = Embedding(config, groups).word_embeddings


def _shapes_only_parameters(config_kwargs: dict, tp: int) -> list[dict]:
    """PP = 1: every TP rank's parameter sizes, built in this process for shapes only (no ranks)."""
    from hybrid.model.gpt import GPTModel
    from hybrid.model.naming import canonical_parameters
    from hybrid.parallel.groups import ParallelGroups
    config = ModelConfig(**config_kwargs)
    return [{"stage": 0, "params": {n: p.numel() for n, p in canonical_parameters(
        GPTModel(config, ParallelGroups.shapes_only(tp, rank)), config.num_layers).items()}} for rank in range(tp)]


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("tp,pp,partition", [(1, 1, "parameters"), (2, 1, "parameters"), (1, 2, "parameters"),
                                             (1, 2, "uniform"), (1, 2, "1,4")])
def test_parameter_inventory_equals_the_real_model_per_rank_and_stage(style, tp, pp, partition):
    kwargs = dict(num_layers=5, hidden_size=64, num_attention_heads=4, vocab_size=1000, max_position_embeddings=32)
    if style == "llama":
        kwargs.update(normalization="RMSNorm", swiglu=True, num_query_groups=2, position_embedding_type="rope",
                      add_bias_linear=False, untie_embeddings_and_output_weights=True)
    stages = memory.stage_parameters(ModelConfig(**kwargs), tp, pp, partition)
    reals = (_shapes_only_parameters(kwargs, tp) if pp == 1 else
             run_on_ranks(_real_stage_parameters, tp * pp, kwargs, tp, pp, partition))
    for real in reals:
        estimated = {n: numel for n, (numel, _) in stages[real["stage"]]["params"].items()}
        assert estimated == real["params"]
        if real.get("deepspeed_bounds"):  # the transformer layers per stage, as DeepSpeed's PipelineModule splits
            bounds = real["deepspeed_bounds"]
            assert list(real["layers"]) == [sum(1 for i in range(5) if bounds[s] <= i + 1 < bounds[s + 1])
                                            for s in range(pp)]


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_zero3s_row_blocks_of_the_vocabulary_tables_are_counted_as_the_model_holds_them(tp, pp):
    """Under ZeRO-3 an untied vocabulary table is row blocks, separate parameters (ModelConfig.zero3_vocab_block_rows,
    DeepSpeed's TiledLinear), so ZeRO-3 gathers a block, not the table: here 4 blocks per table on each TP rank, none
    larger than the layer's largest matrix. The estimator's blocks (memory.vocab_blocks) are the real model's
    parameters at each TP rank and stage. A tied table, or one multi-token prediction reads, stays whole."""
    from hybrid.model.naming import vocab_block
    kwargs = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=1000, max_position_embeddings=32,
                  normalization="RMSNorm", swiglu=True, num_query_groups=2, position_embedding_type="rope",
                  add_bias_linear=False, untie_embeddings_and_output_weights=True)
    whole = ModelConfig(**kwargs)
    assert dataclasses.replace(whole, untie_embeddings_and_output_weights=False).zero3_vocab_block_rows(tp) == 0
    assert dataclasses.replace(whole, mtp_num_layers=1).zero3_vocab_block_rows(tp) == 0
    kwargs["vocab_block_rows"] = whole.zero3_vocab_block_rows(tp)
    config = ModelConfig(**kwargs)
    assert config.vocab_blocked(tp) and not whole.vocab_blocked(tp)
    stages = memory.stage_parameters(config, tp, pp)
    reals = (_shapes_only_parameters(kwargs, tp) if pp == 1 else
             run_on_ranks(_real_stage_parameters, tp * pp, kwargs, tp, pp, "parameters"))
    for real in reals:
        estimated = memory.vocab_blocks(stages[real["stage"]]["params"], config, tp)
        assert {n: numel for n, (numel, _) in estimated.items()} == real["params"]
        blocks = [n for n in real["params"] if vocab_block(n)]
        assert len(blocks) == 4 * (2 if pp == 1 else 1)
        largest_matrix = max(n for name, n in real["params"].items() if name.startswith("layers."))
        assert max(real["params"][n] for n in blocks) <= largest_matrix
        assert sum(real["params"][n] for n in blocks) == (2 if pp == 1 else 1) * whole.padded_vocab_size(tp) // tp * 64


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("schedule,virtual", [("interleaved-1f1b", 2), ("zero-bubble", 1), ("zbv", 2)])
def test_parameter_inventory_equals_each_ranks_virtual_stages(style, schedule, virtual):
    """The estimator's per-rank parameters for the torch.distributed.pipelining schedules equal what
    RankModel builds on each of 2 pipeline ranks (tied tables: the parameter on rank 0, a copy without optimizer
    state on the last stage's rank in a loop; one table on rank 0 in a V)."""
    from hybrid.model.naming import canonical_parameters
    from hybrid.model.virtual_stages import RankModel
    from hybrid.parallel.groups import ParallelGroups
    from hybrid.pipeline_plan import plan_stages
    kwargs = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=1000, max_position_embeddings=32)
    if style == "llama":
        kwargs.update(normalization="RMSNorm", swiglu=True, num_query_groups=2, position_embedding_type="rope",
                      add_bias_linear=False, untie_embeddings_and_output_weights=True)
    config = ModelConfig(**kwargs)
    ranks = memory.stage_parameters(config, 1, 2, schedule=schedule, virtual=virtual)
    plans = plan_stages(4, 2, virtual, schedule)
    for rank in range(2):
        model = RankModel(config, ParallelGroups.single(), plans, rank)
        real = canonical_parameters(model, config.num_layers)
        estimated = {n: numel for n, (numel, _) in ranks[rank]["params"].items()}
        assert estimated == {n: p.numel() for n, p in real.items()}
        assert ranks[rank]["replica"] == (model.tied_table.numel() if model.tied_table is not None else 0)
        assert ranks[rank]["layers"] == sorted(i for p in plans if p.rank == rank for i in p.layers)


def test_in_flight_micro_batches_equal_the_measured_peak_of_every_schedule():
    """benchmarks/pipeline_bubble.py measured, for PP 2 and 4, every schedule and 4-32 micro-batches, the
    live activations of each rank (benchmarks/results/pipeline_bubble_cpu.jsonl): the estimator's
    in-flight figure equals each rank's peak for 1F1B and interleaved 1F1B, and the largest over ranks
    (the rank that sets the memory needed) for the zero-bubble schedules."""
    import glob
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    records = []
    for path in glob.glob(os.path.join(root, "benchmarks", "results", "pipeline_bubble_cpu*.jsonl")):
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    checked = 0
    for r in records:
        if "skipped" in r:
            continue
        name = "1f1b" if r["schedule"] == "torch-1f1b" else r["schedule"]
        p, m, v = r["pp"], r["micro_batches"], r["virtual_stages"]
        estimated = [activations.in_flight_micro_batches(rank, p, m, name, v) for rank in range(p)]
        if name in ("1f1b", "interleaved-1f1b"):
            assert estimated == r["peak_activations_per_rank"], r
        else:
            assert max(estimated) == r["peak_activations"], r
        assert r["peak_activations"] == r["planned_activations"], r  # the schedule's own action order
        checked += 1
    assert checked >= 40


def test_dry_run_of_virtual_stages_counts_their_activations():
    flags = [*BIG, "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
    result = _train(*flags)
    assert result.returncode == 0, result.stderr
    assert "interleaved-1f1b x 2 virtual stages" in result.stdout
    stages = json.loads(result.stdout.strip().splitlines()[-1])["dry_run"]["stages"]
    assert [s["in_flight_micro_batches"] for s in stages] == [2.5, 1.5]  # p + (p-1)/v on rank 0
    assert [s["layers"] for s in stages] == [12, 12]


def _train(*flags):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, os.path.join(root, "launch", "train.py"), *flags], capture_output=True,
                          text=True, cwd=root, timeout=300, env=dict(os.environ, WORLD_SIZE="1", RANK="0"))


BIG = ["--dry-run", "--no-demo", "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
       "--seq-length", "2048", "--micro-batch-size", "8", "--global-batch-size", "256", "--bf16",
       "--dry-run-world-size", "16", "--deepspeed", "ds_configs/zero1.json"]


@pytest.mark.slow
def test_dry_run_counts_a_grpo_runs_decoding_cache_and_zero3s_gathered_stage():
    """--grpo: a rank's rollout decodes its share of the global batch (global batch / DP rows) in up to --seq-length
    + 1 slots; the dry run counts that cache (hybrid.memory.decoding_cache_bytes; tests/test_generation.py checks it
    equal to the real cache's bytes for every family, and at TP 2, PP 2 and EP 2) as a third moment beside the
    backward and the step, with the stage's parameters gathered whole under ZeRO-3."""
    flags = [*BIG[:-2], "--num-query-groups", "4", "--tensor-model-parallel-size", "2", "--grpo", "--grpo-group-size",
             "8", "--max-new-tokens", "512"]
    stages = {}
    for zero in (1, 3):
        result = _train(*flags, "--deepspeed", f"ds_configs/zero{zero}.json")
        assert result.returncode == 0, result.stderr
        assert "--grpo rollouts:" in result.stdout and "the cache of 32 rows x 2049 slots" in result.stdout
        s = stages[zero] = json.loads(result.stdout.strip().splitlines()[-1])["dry_run"]["stages"][0]
        assert s["total"] == s["params"] + s["grads"] + s["optimizer"] + max(s["buffers"] + s["activations"],
                                                                             s["step"], s["decoding"])
    # rows (256 / DP 8) x slots x layers x (keys, values) x KV heads per TP rank x head size x bf16
    assert stages[1]["decoding"] == 32 * 2049 * 24 * 2 * (4 // 2) * 128 * 2
    # ZeRO-3: beside its partitions, the stage gathered whole (the small persistent parameters are whole already)
    # and the reduce bucket ("auto": the hidden size squared)
    gathered = stages[3]["decoding"] - stages[1]["decoding"] - 2 * 2048 ** 2
    assert 0.99 * 2 * stages[3]["parameters"] < gathered < 2 * stages[3]["parameters"]



@pytest.mark.slow
def test_dry_run_prints_table_and_json_and_advice_that_fits():
    result = _train(*BIG, "--gpu-memory-gb", "16")
    assert result.returncode == 0, result.stderr
    assert "memory per rank (GiB): TP 1 x PP 1 x DP 16, ZeRO-1, bf16" in result.stdout
    report = json.loads(result.stdout.strip().splitlines()[-1])["dry_run"]
    advice = report["advice"]
    assert not advice["fits"] and advice["change"], advice
    # the suggested change, applied: the dry run now says it fits, with the peak the advice gave
    change = advice["change"].split()
    assert change[0].startswith("--"), advice
    after = _train(*BIG, "--gpu-memory-gb", "16", *change)
    assert after.returncode == 0, after.stderr
    advice_after = json.loads(after.stdout.strip().splitlines()[-1])["dry_run"]["advice"]
    assert advice_after["fits"] and advice_after["peak_gb"] == pytest.approx(advice["peak_gb_after_change"])
    # the stage rows carry every byte count, and a PP 2 plan has two stages, the first holding more in flight
    pp = json.loads(_train(*BIG, "--pipeline-model-parallel-size", "2").stdout.strip().splitlines()[-1])
    stages = pp["dry_run"]["stages"]
    assert [s["in_flight_micro_batches"] for s in stages] == [2, 1]
    assert all(s["total"] == s["params"] + s["grads"] + s["optimizer"] + s["reference"]
               + max(s["buffers"] + s["activations"] + s["fp8"], s["step"]) for s in stages)
    assert all(s["step"] > 0 for s in stages)  # the step's fp64 gradient norm and fp32 gradient copy
    assert all(s["buffers"] > 0 for s in stages)  # ZeRO-1's reduce buckets and whole gradients are counted


@pytest.mark.slow
def test_dry_run_moves_offloaded_layer_inputs_to_host_memory():
    full = [*BIG, "--recompute-granularity", "full", "--pipeline-model-parallel-size", "2"]
    plain, offloaded = ([json.loads(_train(*full, *extra).stdout.strip().splitlines()[-1])["dry_run"]["stages"]
                         for extra in ([], ["--cpu-offloading"])])
    for before, after in zip(plain, offloaded):
        assert before["host_activations"] == 0 and after["host_activations"] > 0
        # what full recompute keeps per layer and micro-batch moves; the chunk rebuilt in backward stays
        assert after["activations"] + after["host_activations"] == before["activations"]
        assert after["total"] == before["total"] - after["host_activations"]


def test_dry_run_bad_flag_is_one_message():
    result = _train(*BIG, "--tensor-model-parallel-size", "3")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--tensor-model-parallel-size" in result.stderr


@pytest.mark.parametrize("moe", [
    dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3),
    dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_aux_loss_coeff=0.01,
         moe_shared_expert_intermediate_size=96, moe_shared_expert_gate=True, moe_grouped_gemm=True),
    dict(swiglu=False, moe_router_topk=1, moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="none"),
], ids=["softmax-aux-z", "sigmoid-shared-grouped", "gelu-top1-capacity"])
def test_moe_layer_activation_bytes_within_10pct_of_saved_tensors(moe):
    config = dataclasses.replace(_model_config("llama", 0.0, None), num_experts=4, moe_ffn_hidden_size=96, **moe)
    measured = _measured_layer_bytes(config, None, seq=64, batch=2)
    estimated = sum(activations.layer_activation_bytes(config, activations.ActivationSettings(
        2, 64, precision="fp32", attention_kernel="flash", mask_bytes=4), layer=i) for i in range(2)) / 2
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured)


def test_dry_run_counts_zero3_under_a_pipeline_stage_by_stage():
    """PP 2 x DP 2: ZeRO-3 divides a stage's parameters, gradients and optimizer by the stage's DP and adds the
    reduce bucket and the larger of the largest parameter gathered with its whole gradient and a full bucket's
    reduction (no prefetch under a pipeline); ZeRO-1 keeps the parameters and gradients whole; the tied
    table's copy on the last stage is weights and a gradient, whole. The step: fp32 weights give ZeRO-3 no
    gradient copy, only the fp64 norm of the largest partition; ZeRO-1 flattens its group's partition."""
    from hybrid.config import build_run_config
    from hybrid.dry_run import plan_from_run
    from hybrid.flags import build_parser
    base = ["--num-layers", 4, "--hidden-size", 512, "--num-attention-heads", 8, "--seq-length", 32,
            "--max-position-embeddings", 32, "--micro-batch-size", 1, "--global-batch-size", 8, "--train-iters", 1,
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", 1000, "--pipeline-model-parallel-size",
            2]
    rows = {}
    for zero in (1, 3):
        run = build_run_config(build_parser().parse_args([str(f) for f in base + ["--zero-stage", zero]]), 4, 1000)
        plan = plan_from_run(run)
        rows[zero] = memory.estimate(plan)
        stages = memory.stage_parameters(run.model, 1, 2, stage_layers=run.pipeline.stage_layers)
        for row, stage in zip(rows[zero], stages):
            numel = sum(n for n, _ in stage["params"].values())
            states = memory.model_state_bytes([[n for n, _ in stage["params"].values()]], plan.zero)
            assert row["params"] == states["params"] + 4 * stage["replica"]
            assert row["buffers"] == memory.zero_buffer_bytes(stage["params"], plan.zero, 2)
            bucket = min(plan.zero.reduce_bucket_size, numel)
            largest = max(n for n, _ in stage["params"].values())
            if zero == 3:  # the reduce bucket (whole, from the start), and the larger of the largest parameter
                # gathered with its gradient and a full bucket's reduction (its flat copy)
                assert row["buffers"] == 4 * (plan.zero.reduce_bucket_size + max(2 * largest, bucket))
                assert row["step"] == 4 * plan.zero.reduce_bucket_size + 8 * math.ceil(largest / 2)
            else:  # the whole gradients until the step (less their partitions, made from them at the end of
                # backward), and the reduce bucket, which lives through the gradient norm
                assert row["buffers"] == 4 * (bucket + numel) - (row["grads"] - 4 * stage["replica"]) > 0
                decayed = sum(n for n, d in stage["params"].values() if d)
                assert row["step"] == max(4 * bucket + 8 * min(largest, math.ceil(decayed / 2)),
                                          4 * math.ceil(decayed / 2))
    assert stages[1]["replica"] > 0 and stages[0]["replica"] == 0  # the tied table's copy: the last stage's
    for zero1, zero3 in zip(rows[1], rows[3]):
        # (beside DeepSpeed's default ZeRO-3 reduce bucket, 5e8 elements allocated whole: 2 GB here in fp32)
        assert zero3["params"] < zero1["params"] and zero3["total"] - 4 * 500_000_000 < zero1["total"]


@pytest.mark.parametrize("mla", [dict(q_lora_rank=48), dict(q_lora_rank=None)], ids=["q-latent", "q-projection"])
@pytest.mark.parametrize("recompute", [None, "selective"])
def test_mla_layer_activation_bytes_within_10pct_of_saved_tensors(mla, recompute):
    """Multi-latent attention's saved tensors (its latents, their norms, the up projections' outputs, the rotated
    query, the expanded key) as the dry run counts them."""
    config = dataclasses.replace(_model_config("llama", 0.0, recompute), multi_latent_attention=True, qk_layernorm=True,
                                 num_query_groups=None, kv_lora_rank=32, qk_head_dim=24, qk_pos_emb_head_dim=8,
                                 v_head_dim=16, rope_scaling=None, **mla)
    config = dataclasses.replace(config, num_query_groups=config.num_attention_heads)
    measured = _measured_layer_bytes(config, None, seq=64, batch=2)
    estimated = _estimated_layer_bytes(config, 1, seq=64, batch=2)
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured)


def test_dry_run_counts_mtp_layers_and_the_last_stages_embedding_copy():
    """--mtp-num-layers: the last stage holds the MTP layers (their parameters counted as the real model's), reads a
    copy of the word embeddings when another stage holds them, and keeps each depth's activations and logits."""
    from tests.test_mtp import deepseek_style
    from hybrid.model.gpt import GPTModel
    config = deepseek_style()
    real = sum(p.numel() for p in GPTModel(config).parameters())
    plain = memory.stage_parameters(dataclasses_replace(config, mtp_num_layers=None), 1, 1, "uniform")
    with_mtp = memory.stage_parameters(config, 1, 1, "uniform")
    assert sum(n for n, _ in with_mtp[0]["params"].values()) == real
    assert {n for n in with_mtp[0]["params"] if n.startswith("mtp.")} == \
        {n for n, _ in GPTModel(config).named_parameters() if n.startswith("mtp.")}
    assert sum(n for n, _ in plain[0]["params"].values()) < real
    first, last = memory.stage_parameters(config, 1, 2, "uniform")
    assert not any(n.startswith("mtp.") for n in first["params"]) and any(n.startswith("mtp.") for n in last["params"])
    assert last["replica"] == first["params"]["embedding.word_embeddings.weight"][0]
    plan = dict(micro_batch=2, seq_length=16, tp=1, pp=2, dp=1, num_micro_batches=2, zero=memory.ZeroSettings(),
                partition="uniform", device_type="cpu")
    with_rows = memory.estimate(memory.MemoryPlan(model=config, **plan))
    without_rows = memory.estimate(memory.MemoryPlan(model=dataclasses_replace(config, mtp_num_layers=None), **plan))
    assert with_rows[0]["activations"] == without_rows[0]["activations"]
    assert with_rows[1]["activations"] > without_rows[1]["activations"]


def dataclasses_replace(config, **fields):
    return dataclasses.replace(config, **fields)


HF_AUTO_CONFIG = {  # as transformers' docs and accelerate users write them
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto"}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_deepspeed_config_of_auto_values_resolves_as_transformers_does_and_dry_runs(precision, tmp_path):
    """"auto" values (transformers' Trainer and accelerate's convention): buckets from the hidden size as
    transformers' integration fills them (h^2, 0.9 h^2, 10 h), batch sizes, clipping, the optimizer's
    hyperparameters and the precision from the flags; --dry-run reports (before: ValueError: invalid literal for
    int() with base 10: 'auto')."""
    from hybrid.dry_run import report
    path = tmp_path / "auto.json"
    path.write_text(json.dumps(HF_AUTO_CONFIG))
    flags = TINY + ["--deepspeed", str(path), "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-3",
                    "--clip-grad", "0.5", "--adam-beta2", "0.95"] + (["--bf16"] if precision == "bf16" else [])
    run = build_run_config(build_parser().parse_args(flags), 2, 128)
    ds, h = run.ds_config, 34
    assert run.training.precision == precision
    assert ds["zero_optimization"]["reduce_bucket_size"] == h * h
    assert ds["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * h * h)
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 10 * h
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"], ds["gradient_accumulation_steps"],
            ds["gradient_clipping"]) == (2, 8, 2, 0.5)
    assert ds["optimizer"]["params"] == dict(ds["optimizer"]["params"], lr=2e-3, betas=[0.9, 0.95], eps=1e-8)
    assert "auto" not in json.dumps(ds)
    assert json.loads(report(run, None).splitlines()[-1])["dry_run"]["stages"]


def test_zero3_left_on_deepspeeds_default_bucket_is_warned_with_its_cost(tmp_path, capsys):
    """A bare {"zero_optimization": {"stage": 3}} takes DeepSpeed's 5e8-element reduce bucket (2 GB in fp32 on every
    rank): one warning with the cost and the fix; a config that sets it, none."""
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    build_run_config(build_parser().parse_args(TINY + ["--deepspeed", str(bare), "--micro-batch-size", "2"]), 2, 128)
    out = capsys.readouterr().out
    assert "sets no zero_optimization.reduce_bucket_size" in out and "a 2 GB fp32 bucket" in out, out
    build_run_config(build_parser().parse_args(TINY + ["--deepspeed", "ds_configs/zero3.json", "--micro-batch-size",
                                                       "2"]), 2, 128)
    assert "reduce_bucket_size" not in capsys.readouterr().out


@pytest.mark.parametrize("seq,chunk,heads", [(300, 64, (2, 4, 16, 16)), (128, 16, (2, 2, 32, 16)),
                                             (100, 8, (1, 4, 8, 8))])
def test_gated_delta_net_layer_activation_bytes_within_10pct_of_saved_tensors(seq, chunk, heads):
    """A Gated DeltaNet layer's saved tensors (hybrid.model.gated_delta_net: its projection, the conv, the chunks'
    decays, triangular systems and scores, the states between chunks, the gated norm), at sequences that do and do
    not fill whole chunks, with one and with several value heads per key head, and the gated full attention's."""
    keys, values, dk, dv = heads
    config = dataclasses.replace(_model_config("qwen3", 0.0, None), attention_output_gate=True,
                                 linear_num_key_heads=keys, linear_num_value_heads=values, linear_key_head_dim=dk,
                                 linear_value_head_dim=dv, linear_attention_chunk_size=chunk)
    for pattern in ([1] * config.num_layers, None):  # every layer linear; every layer full attention with its gate
        config = dataclasses.replace(config, linear_attention_freq=pattern)
        measured = _measured_layer_bytes(config, None, seq=seq, batch=2)
        estimated = _estimated_layer_bytes(config, 1, seq=seq, batch=2)
        assert abs(estimated - measured) <= 0.10 * measured, (pattern, estimated, measured)


@pytest.mark.parametrize("config", ["zero3.json", "zero3_bf16.json", "zero3_fp16.json", "zero3_offload.json"])
def test_shipped_zero3_buckets_follow_the_hidden_size_and_a_full_buckets_reduction_is_counted(config, tmp_path):
    """At the layer-heavy shape (8 layers of hidden 1024 and FFN 4096, vocabulary 32k untied, PP 2 x DP 2, fp32)
    ZeRO-3 with the 5e7-element buckets the shipped config used to set peaked above ZeRO-1, and about 0.49 GiB above
    the same run with the shipped "auto" buckets (1M elements; benchmarks/results/memory_cpu.json, measured by
    benchmarks/bench_memory.py --shipped-configs): DeepSpeed allocates the reduce bucket whole and, when it is full,
    reduce_scatter_coalesced joins its gradients into a flat copy that gloo copies again. The shipped ZeRO-3 configs
    take their buckets from the hidden size as transformers' "auto" does, and the estimate's difference between the
    two bucket sizes is the measured one within 10%."""
    from hybrid.dry_run import plan_from_run
    from hybrid.ds_config import resolve_auto_buckets
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shipped = os.path.join(root, "ds_configs", config)
    section = json.load(open(shipped))["zero_optimization"]
    resolved = resolve_auto_buckets(section, 1024)
    buckets = (resolved["reduce_bucket_size"], resolved["stage3_prefetch_bucket_size"])
    assert buckets == (1024 ** 2, int(0.9 * 1024 ** 2))
    if config != "zero3.json":
        return
    flags = ["--num-layers", 8, "--hidden-size", 1024, "--num-attention-heads", 16, "--ffn-hidden-size", 4096,
             "--seq-length", 64, "--max-position-embeddings", 64, "--micro-batch-size", 1, "--global-batch-size", 4,
             "--train-iters", 2, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", 32000,
             "--untie-embeddings-and-output-weights", "--pipeline-model-parallel-size", 2]
    large = json.load(open(shipped))
    large["zero_optimization"].update(reduce_bucket_size=50_000_000, stage3_prefetch_bucket_size=50_000_000)
    (tmp_path / "large.json").write_text(json.dumps(large))
    runs = [build_run_config(build_parser().parse_args([str(f) for f in flags + ["--deepspeed", path]]), 4, 32001)
            for path in (shipped, tmp_path / "large.json")]
    assert runs[0].ds_config["zero_optimization"]["reduce_bucket_size"] == 1024 ** 2  # as the run resolves it
    estimated = [max(row["total"] for row in memory.estimate(dataclasses.replace(plan_from_run(r), device_type="cpu")))
                 / 1024 ** 3 for r in runs]
    with open(os.path.join(root, "benchmarks", "results", "memory_cpu.json")) as f:
        result = json.load(f)["shapes"]["layer_heavy"]["fp32"]
    measured = result["zero3_buckets_5e7"]["measured_gib"] - result["zero3"]["largest_rank"]["measured_gib"]
    assert abs((estimated[1] - estimated[0]) - measured) <= 0.1 * measured, (estimated, measured)
