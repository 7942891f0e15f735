"""Step time with --optimizer muon against AdamW, one rank and DP 2 (ZeRO-0 and ZeRO-1), printed as JSON.

    python benchmarks/bench_muon.py [--hidden-size 1024] [--num-layers 2] [--iters 6]

Runs launch/train.py (mock data, fp32) with each optimizer in the same invocation and reports the median
iteration time after the first two (warm-up), the ratio Muon / AdamW, and the Newton-Schulz share: the time of
torch.optim.Muon's step alone on the same matrices (q, k, v, o, gate, up, down of every layer), measured here.
At DP 2 with ZeRO-0 every rank steps the whole matrices (the update repeated on each rank); with ZeRO-1 each
matrix is orthogonalized on one owner rank (hybrid.training.muon.ShardedMuonWithAdamW: the work spread over the
ranks, for an all-gather and a reduce-scatter of the Muon matrices' partitions).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(flags: list[str], nproc: int, log: str) -> list[dict]:
    launch = [sys.executable, os.path.join(ROOT, "launch", "train.py")] if nproc == 1 else \
        [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", str(nproc),
         os.path.join(ROOT, "launch", "train.py")]
    proc = subprocess.run([*launch, *flags, "--log-json", log], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"train.py failed:\n{proc.stderr[-3000:]}")
    with open(log) as f:
        return [json.loads(line) for line in f if '"lm_loss"' in line]


def newton_schulz_seconds(hidden: int, ffn: int, layers: int, repeats: int = 3) -> float:
    """torch.optim.Muon's step on one model's matrices (HF shapes, MHA), the median of `repeats`."""
    import torch
    shapes = [(hidden, hidden)] * 4 + [(ffn, hidden)] * 2 + [(hidden, ffn)]
    params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes * layers]
    for p in params:
        p.grad = torch.randn_like(p)
    muon = torch.optim.Muon(params)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        muon.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--iters", type=int, default=6)
    a = p.parse_args()
    heads = max(1, a.hidden_size // 64)
    base = ["--num-layers", a.num_layers, "--hidden-size", a.hidden_size, "--num-attention-heads", heads,
            "--ffn-hidden-size", 4 * a.hidden_size, "--seq-length", a.seq_length, "--max-position-embeddings",
            a.seq_length, "--micro-batch-size", 1,
            "--global-batch-size", 2, "--train-iters", a.iters, "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", 1024, "--lr", 1e-3, "--log-interval", 1, "--eval-iters", 0, "--no-progress-bar",
            "--hidden-dropout", 0, "--attention-dropout", 0, "--swiglu", "--disable-bias-linear"]
    base = [str(f) for f in base]
    import torch
    out = {"machine": f"{os.cpu_count()} CPU cores, fp32, torch {torch.__version__.split('+')[0]} (torch.optim.Muon's "
                      f"Newton-Schulz in bf16 on the CPU)",
           "command": "python benchmarks/bench_muon.py", "hidden_size": a.hidden_size, "num_layers": a.num_layers,
           "seq_length": a.seq_length}
    with tempfile.TemporaryDirectory() as work:
        for nproc, zero in ((1, 0), (2, 0), (2, 1)):
            key = f"dp{nproc}" + (f"_zero{zero}" if zero else "")
            for name, extra in (("adamw", []), ("muon", ["--optimizer", "muon"])):
                records = train(base + extra + ["--zero-stage", str(zero)], nproc,
                                os.path.join(work, f"{name}{key}.jsonl"))
                out[f"{name}_{key}_s_per_iter"] = statistics.median(r["elapsed_ms_per_iter"] / 1000
                                                                   for r in records[2:])
            out[f"muon_over_adamw_{key}"] = out[f"muon_{key}_s_per_iter"] / out[f"adamw_{key}_s_per_iter"]
        out["muon_zero1_over_zero0_dp2"] = out["muon_dp2_zero1_s_per_iter"] / out["muon_dp2_s_per_iter"]
    out["newton_schulz_step_s"] = newton_schulz_seconds(a.hidden_size, 4 * a.hidden_size, a.num_layers)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
