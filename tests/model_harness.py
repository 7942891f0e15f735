"""Shared helpers for model tests: tiny configs, a fixed batch, sharded runs and reassembly."""

from __future__ import annotations

import torch

from hybrid.parallel.layers import unshard

GPT2 = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=100, max_position_embeddings=32,
            make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0, seed=7)
LLAMA = dict(GPT2, position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2,
             add_bias_linear=False, untie_embeddings_and_output_weights=True, ffn_hidden_size=64,
             rotary_base=10000.0)
# every option of the Llama family members at once (Qwen2's Q/K/V bias, Qwen3's Q/K norms and head dim,
# Mistral's window (shorter than the test sequences), Llama 3's rope scaling), and Gemma's
FAMILY_OPTIONS = dict(LLAMA, add_qkv_bias=True, qk_layernorm=True, kv_channels=16, sliding_window=6,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8})
GEMMA = dict(LLAMA, swiglu=False, geglu=True, apply_layernorm_1p=True, scale_embeddings=True, kv_channels=16,
             untie_embeddings_and_output_weights=False)
CONFIGS = {"gpt2": GPT2, "llama": LLAMA, "family_options": FAMILY_OPTIONS, "gemma": GEMMA}


def batch(batch_size=4, seq=16, vocab=100, seed=0):
    """(ids, labels) with some positions masked (IGNORE_INDEX), as many in every micro-batch."""
    from hybrid.parallel.cross_entropy import IGNORE_INDEX
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[::2, :3] = IGNORE_INDEX
    return tokens[:, :-1].contiguous(), labels


def reference(cfg: dict, data, **overrides):
    """Loss, logits and gradients of the single-process model (no torch.distributed)."""
    from hybrid.model.config import ModelConfig
    from hybrid.model.gpt import GPTModel
    model = GPTModel(ModelConfig(**dict(cfg, **overrides)))
    ids, labels = data
    logits = model(ids)
    loss = model(ids, labels)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.item(), logits.detach(), grads


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of every gradient it is asked to apply (what DeepSpeed computed)."""

    def step(self, closure=None):
        self.recorded = {id(p): p.grad.detach().clone() for g in self.param_groups for p in g["params"]
                         if p.grad is not None}
        return super().step(closure)


def sharded_run(cfg: dict, tp: int, pp: int, data, sequence_parallel=False, grad_acc=2, partition="parameters",
                cp=1, **overrides):
    """On each rank: loss, this rank's logits shard (PP = 1), and canonical-named grad shards (PP > 1: one
    iteration of the runtime's 1F1B schedule, `grad_acc` micro-batches, the stages split by `partition`)."""
    from hybrid.model.config import ModelConfig
    from hybrid.model.gpt import GPTModel
    from hybrid.model.naming import canonical_parameters
    from hybrid.parallel.random import model_parallel_seed
    from hybrid.parallel.groups import build_groups

    if pp > 1:
        return scheduled_run(cfg, tp, pp, data, "1f1b", 1, micro_batches=grad_acc,
                             sequence_parallel=sequence_parallel, partition=partition, cp=cp, **overrides)
    topo = build_groups(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp)
    model_parallel_seed(1, topo.tp.rank)
    config = ModelConfig(**dict(cfg, sequence_parallel=sequence_parallel, **overrides))
    ids, labels = data
    model = GPTModel(config, topo)
    logits = model(ids).detach()
    loss = model(ids, labels)
    loss.backward()
    params = canonical_parameters(model, config.num_layers)
    grads = {n: p.grad for n, p in params.items()}
    return _result(topo, loss.item(), logits, params, grads)


def _result(topo, loss, logits, params, grads) -> dict:
    """What a sharded run returns: loss, logits shard and canonical-named gradient shards with their TP split."""
    shards = {n: (grads[n].detach().clone(), getattr(params[n], "partition_dim", None),
                  getattr(params[n], "partition_stride", 1)) for n in params}
    return dict(tp_rank=topo.tp.rank, pp_rank=topo.pp.rank, loss=loss, logits=logits, grads=shards)


def assemble_grads(results) -> dict:
    """Full gradients from every rank's shards (TP shards joined, PP stages merged)."""
    by_name: dict = {}
    for r in results:
        for name, (grad, dim, stride) in r["grads"].items():
            by_name.setdefault(name, {})[r["tp_rank"]] = (grad, dim, stride)
    full = {}
    for name, shards in by_name.items():
        grads = [shards[t][0] for t in sorted(shards)]
        dim, stride = shards[0][1], shards[0][2]
        full[name] = unshard(grads, dim, stride) if dim is not None else grads[0]
    return full


def compare_grads(full: dict, ref: dict, vocab: int, atol: float):
    from checks.rank_pool import assert_close
    assert set(full) == set(ref), f"parameter names differ: {set(full) ^ set(ref)}"
    for name in ref:
        got, want = full[name], ref[name]
        if name.endswith(("word_embeddings.weight", "output_layer.weight")):
            assert got.size(0) >= vocab, f"grad {name}: {got.size(0)} rows, fewer than the vocabulary {vocab}"
            if got.size(0) > vocab:  # vocabulary padding rows take no gradient
                assert got[vocab:].abs().max().item() == 0.0, f"grad {name}: padding rows have a gradient"
            got, want = got[:vocab], want[:vocab]
        assert_close(got, want, atol, f"grad {name}")


def runtime_iteration(model, groups, pipeline, micro_batches: list, zero_stage: int = 0, keep: bool = False):
    """One training iteration of the runtime (hybrid.training.runtime) over `micro_batches` [(ids, labels)] with
    a DeepSpeed engine around `model` (lr 0, no clipping): (the DP-mean loss, {id(param): the gradient DeepSpeed
    applied}, the runtime). The engine is released after it (release_engine: pool ranks serve later modules) unless
    `keep`: then the caller releases it when done with the runtime."""
    import deepspeed
    from hybrid.ds_config import pipeline_accumulation
    from hybrid.model.objectives import LanguageModeling, mtp_loss_scale
    from hybrid.training.deepspeed_fixes import prepare_pipeline_engine
    from hybrid.training.runtime import Runtime
    optimizer = RecordingSGD(model.parameters(), lr=0.0)
    micro = micro_batches[0][0].size(0)
    config = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": zero_stage}, "gradient_accumulation_steps": len(micro_batches)}
    if groups.pp.size > 1:
        config.update(pipeline_accumulation(micro, groups.dp_cp.size))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, mpu=groups.mpu, config=config)
    if groups.pp.size > 1:
        prepare_pipeline_engine(engine, groups.mpu)
    objective = LanguageModeling(groups, model.config.vocab_size, mtp_loss_scale=mtp_loss_scale(model.config))
    runtime = Runtime(engine, groups, objective, len(micro_batches),
                      len(micro_batches), pipeline, micro, micro_batches[0][0].size(1), full_backward=zero_stage >= 2)
    loss = runtime.reduce(runtime.train(iter(micro_batches)).reshape(1)).item()
    if not keep:
        from hybrid.training.deepspeed_fixes import release_engine
        release_engine(engine)
    return loss, optimizer.recorded, runtime


def scheduled_run(cfg: dict, tp: int, pp: int, data, schedule: str, virtual: int, micro_batches: int = 4,
                  sequence_parallel=False, partition="parameters", cp=1, zero_stage=0, **overrides):
    """One iteration of the runtime's schedule (lr 0): this rank's loss and canonical-named gradient shards, as
    `sharded_run` returns them, and the same batch's evaluation loss."""
    from hybrid.memory import partition_layers
    from hybrid.model.build import build_model
    from hybrid.model.config import ModelConfig
    from hybrid.model.naming import canonical_parameters
    from hybrid.parallel.groups import build_groups
    from hybrid.parallel.random import model_parallel_seed
    from hybrid.pipeline_plan import PipelineSchedule

    topo = build_groups(tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp)
    model_parallel_seed(1, topo.tp.rank)
    config = ModelConfig(**dict(cfg, sequence_parallel=sequence_parallel, **overrides))
    layers = partition_layers(config, tp, pp, partition) if virtual == 1 and pp > 1 else None
    pipeline = PipelineSchedule(schedule, virtual, partition, layers)
    model = build_model(config, topo, pipeline)
    params = canonical_parameters(model, config.num_layers)
    ids, labels = data
    micro = ids.size(0) // micro_batches
    chunks = [(ids[i:i + micro], labels[i:i + micro]) for i in range(0, ids.size(0), micro)]
    loss, recorded, runtime = runtime_iteration(model, topo, pipeline, chunks, zero_stage, keep=True)
    grads = {n: recorded[id(p)] for n, p in params.items()}
    result = _result(topo, loss, None, params, grads)
    # the same batch through the runtime's evaluation (forward only; lr 0 left the weights as they were)
    result["eval_loss"] = runtime.reduce(runtime.evaluate(iter(chunks)).reshape(1)).item()
    from hybrid.training.deepspeed_fixes import release_engine
    release_engine(runtime.engine)
    return result
