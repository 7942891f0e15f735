"""Where one training step's time goes, per rank: torch.profiler's per-op self time of hybrid's real
step (the Trainer's, on its DeepSpeed engine) at a given TP size, and the collectives among them.

    torchrun --nproc_per_node 2 benchmarks/profile_step.py --tp 2 [--sequence-parallel] [--json out.json]
    python benchmarks/profile_step.py                                # one rank

Same Llama shape as benchmarks/bench_tp.py (fp32, dropout off, AdamW, clipping 1.0, ZeRO-1 unless
--zero 0). After two warm-up steps, `--steps` steps are profiled; every figure is milliseconds per
step. The JSON has, per rank, the step time, the top ops by self time, and each collective's time
(gloo/NCCL ops named by torch.distributed's c10d, e.g. `c10d::allreduce_`, `gloo:all_reduce`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

COLLECTIVE_WORDS = ("allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter", "_reduce_scatter",
                    "broadcast", "alltoall", "all_to_all", "send", "recv", "wait")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--zero", type=int, default=1, choices=(0, 1))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", default=None)
    for name, default in dict(layers=4, hidden=512, heads=8, ffn=1376, vocab=8192, seq=256, micro=8).items():
        parser.add_argument(f"--{name}", type=int, default=default)
    a = parser.parse_args()
    a.iters = 1000
    os.environ.setdefault("HYBRID_VERBOSE", "")
    if "RANK" not in os.environ:  # one process, described as the launchers would
        from hybrid.distributed import free_port
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    import torch.distributed as dist
    from bench_tp import _hybrid_flags
    from hybrid.config import build_run_config
    from hybrid.distributed import init_distributed
    from hybrid.flags import build_parser
    from hybrid.parallel.random import model_parallel_seed
    from hybrid.parallel.groups import build_groups
    from hybrid.training.engine import build_engine
    from hybrid.training.loop import Trainer
    from hybrid.training.run import _quiet_deepspeed
    init_distributed()
    _quiet_deepspeed()
    flags = _hybrid_flags(a) + ["--tensor-model-parallel-size", str(a.tp)]
    flags += ["--sequence-parallel"] if a.sequence_parallel else []
    deepspeed_flag = flags.index("--deepspeed")
    del flags[deepspeed_flag:deepspeed_flag + 2]  # no config file: --zero-stage picks the stage
    flags += ["--zero-stage", str(a.zero)]
    world = dist.get_world_size()
    run = build_run_config(build_parser().parse_args(flags), world, a.vocab)
    topology = build_groups(tensor_parallel=a.tp)
    model_parallel_seed(1234, topology.tp.rank)
    engine, _ = build_engine(run, topology)
    trainer = Trainer(run, topology, engine, (None, None, None))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab, (a.micro, a.seq + 1), generator=generator)
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())

    def step():
        return trainer.step.train(iter([batch]))

    for _ in range(2):
        step()
    from torch.profiler import profile
    dist.barrier()
    start = time.perf_counter()
    with profile() as prof:
        for _ in range(a.steps):
            loss = step()
        float(loss["lm loss"] if isinstance(loss, dict) else loss)
    step_ms = (time.perf_counter() - start) / a.steps * 1e3
    events = [(e.key, e.self_cpu_time_total / 1e3 / a.steps, e.count // a.steps) for e in prof.key_averages()]
    events.sort(key=lambda x: -x[1])
    total = sum(ms for _, ms, _ in events)
    report = {"rank": dist.get_rank(), "tp": a.tp, "sequence_parallel": a.sequence_parallel,
              "step_ms": step_ms, "profiled_self_ms": total,
              "top_ops": [{"op": k, "ms": ms, "calls": n} for k, ms, n in events[:a.top]],
              "collectives": [{"op": k, "ms": ms, "calls": n} for k, ms, n in events
                              if any(w in k.lower() for w in COLLECTIVE_WORDS)]}
    parents: dict = {}  # (op, the autograd node or op that called it): ms per step, for the largest ops
    for event in prof.events():
        if event.name in ("aten::copy_", "aten::mul", "aten::cat", "aten::add", "aten::fill_"):
            parent = event.cpu_parent
            while parent is not None and parent.name.startswith("aten::") and parent.cpu_parent is not None:
                parent = parent.cpu_parent
            key = f"{event.name} < {parent.name if parent is not None else '(top)'}"
            parents[key] = parents.get(key, 0.0) + event.self_cpu_time_total / 1e3 / a.steps
    report["callers"] = [{"op": k, "ms": ms} for k, ms in sorted(parents.items(), key=lambda kv: -kv[1])[:a.top]]
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        text = json.dumps({"dims": {k: getattr(a, k) for k in ("layers", "hidden", "heads", "ffn", "vocab", "seq",
                                                                   "micro")}, "ranks": reports}, indent=1)
        print(text)
        if a.json:
            with open(a.json, "w") as f:
                f.write(text + "\n")


if __name__ == "__main__":
    main()
