"""PP 2 with ZeRO-1: the one runtime (torch.distributed.pipelining's Schedule1F1B, each stage's forward through the
DeepSpeed engine) against DeepSpeed's own PipelineEngine (its 1F1B TrainSchedule) on the same model, layers and
micro-batches, both in the same two processes, rounds alternating; tokens/s and their ratio as JSON.

    python benchmarks/bench_pipeline.py [--rounds 5] [--steps 4] [--hidden-size 256] [--num-layers 8]

DeepSpeed's engine is built here from the model's own modules (LayerSpecs of hybrid's embedding, transformer
layers, final norm and untied head, its partition `parameters`): the adapter hybrid used before the one runtime,
kept only to be measured against. Writes benchmarks/results/pipeline_cpu.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _config(a):
    from hybrid.model.config import ModelConfig
    return ModelConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=8, vocab_size=8000,
                       max_position_embeddings=a.seq_length, make_vocab_size_divisible_by=128, hidden_dropout=0.0,
                       attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                       add_bias_linear=False, untie_embeddings_and_output_weights=True, seed=7)


def _ds_config(a, groups, pipeline: bool) -> dict:
    from hybrid.ds_config import pipeline_accumulation
    config = {"train_micro_batch_size_per_gpu": a.micro_batch_size, "gradient_accumulation_steps": a.micro_batches,
              "steps_per_print": 10**9, "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True, "fused": True}}}
    if not pipeline:
        config.update(pipeline_accumulation(a.micro_batch_size, groups.dp_cp.size))
    return config


def _batches(a, step: int):
    import torch
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 8000, (a.micro_batches, a.micro_batch_size, a.seq_length + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def one_runtime(a, groups):
    """The engine and step of hybrid's runtime."""
    import deepspeed
    from hybrid.memory import partition_layers
    from hybrid.model.build import build_model
    from hybrid.model.objectives import LanguageModeling
    from hybrid.pipeline_plan import PipelineSchedule
    from hybrid.training.deepspeed_fixes import prepare_pipeline_engine
    from hybrid.training.runtime import Runtime
    config = _config(a)
    pipeline = PipelineSchedule("1f1b", 1, "parameters", partition_layers(config, 1, 2, "parameters"))
    model = build_model(config, groups, pipeline)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), mpu=groups.mpu,
                                      config=_ds_config(a, groups, pipeline=False), dist_init_required=False)
    prepare_pipeline_engine(engine, groups.mpu)
    runtime = Runtime(engine, groups, LanguageModeling(groups, config.vocab_size), a.micro_batches, a.micro_batches,
                      pipeline, a.micro_batch_size, a.seq_length)
    return lambda step: runtime.train(iter(_batches(a, step)))


def deepspeed_pipeline_engine(a, groups):
    """The same model on DeepSpeed's PipelineEngine (LayerSpecs of hybrid's own modules)."""
    import deepspeed
    import torch.nn as nn
    from deepspeed.pipe import LayerSpec, PipelineModule
    from hybrid.model.embedding import Embedding, OutputHead
    from hybrid.model.loss import LMLoss
    from hybrid.model.norms import RMSNorm
    from hybrid.model.transformer import TransformerLayer
    config = _config(a)

    class Layer(TransformerLayer):
        def forward(self, hidden):
            return super().forward(hidden)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.output_layer = OutputHead(config, groups)

        def forward(self, hidden):
            return self.output_layer.loss_logits(hidden)

    specs = ([LayerSpec(Embedding, config, groups)] + [LayerSpec(Layer, config, groups, i) for i in
                                                       range(config.num_layers)]
             + [LayerSpec(RMSNorm, config.hidden_size, config.norm_epsilon, groups, False), LayerSpec(Head)])
    loss = LMLoss(groups, config.vocab_size)
    module = PipelineModule(layers=specs, loss_fn=lambda logits, labels: loss.of_whole_sequences(logits, labels),
                            topology=groups.ds_topology, partition_method="parameters")
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                      config=_ds_config(a, groups, pipeline=True), dist_init_required=False)
    return lambda step: engine.train_batch(data_iter=iter(_batches(a, step)))


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    from hybrid.parallel.groups import build_groups
    torch.set_num_threads(1)
    groups = build_groups(pipeline_parallel=2)
    runs = {"one_runtime_1f1b": one_runtime(a, groups),
            "deepspeed_pipeline_engine": deepspeed_pipeline_engine(a, groups)}
    tokens = a.micro_batches * a.micro_batch_size * a.seq_length
    measured = {name: [] for name in runs}
    for name, step in runs.items():  # warm-up (first-step set-up)
        step(0)
    for r in range(a.rounds):
        for name, step in (runs.items() if r % 2 == 0 else reversed(list(runs.items()))):
            dist.barrier()
            start = time.perf_counter()
            for s in range(a.steps):
                step(1 + s)
            dist.barrier()
            measured[name].append(tokens * a.steps / (time.perf_counter() - start))
    if dist.get_rank() == 0:
        medians = {name: statistics.median(v) for name, v in measured.items()}
        result = {"benchmark": "pipeline_pp2_zero1_cpu", "tokens_per_s": medians, "rounds": measured,
                  "ratio_one_runtime_to_deepspeed": medians["one_runtime_1f1b"] / medians["deepspeed_pipeline_engine"],
                  "config": {k: v for k, v in vars(a).items() if k not in ("worker", "out")}}
        text = json.dumps(result, indent=2)
        print(text)
        with open(a.out, "w") as f:
            f.write(text + "\n")
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="iterations per round")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "pipeline_cpu.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    from hybrid.distributed import free_port
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.abspath(__file__), "--worker", *sys.argv[1:]]
    sys.exit(subprocess.run(cmd, env=env, cwd=ROOT).returncode)


if __name__ == "__main__":
    main()
