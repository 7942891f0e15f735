"""The training stall per checkpoint with and without --async-save, printed as JSON.

    python benchmarks/bench_async_save.py [--hidden-size 768] [--num-layers 8] [--saves 3]

Runs launch/train.py on one rank (mock data, Adam, fp32) three times: without saving (the baseline),
saving every --save-interval iterations synchronously, and with --async-save. The stall per save is
the extra time of the training thread over the baseline (every iteration's time plus the log records'
checkpoint_stall_s: DeepSpeed's save call and any wait for background writes), divided by the saves:
it counts both the blocking and the slowdown of iterations that run beside the background writer.
`thread_s_per_save` is the blocking alone. Ratios async / sync are of runs in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(flags: list[str], log: str) -> list[dict]:
    cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), *flags, "--log-json", log]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"train.py failed:\n{proc.stderr[-3000:]}")
    with open(log) as f:
        return [json.loads(line) for line in f if '"lm_loss"' in line]


def busy_seconds(records: list[dict]) -> float:
    """The training thread's time: every iteration plus what it spent saving."""
    return sum(r["elapsed_ms_per_iter"] / 1000 + r.get("checkpoint_stall_s", 0.0) for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--save-interval", type=int, default=6)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("extra", nargs="*", help="more launch/train.py flags (after --)")
    args = parser.parse_args()
    iters = args.save_interval * args.saves
    base = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--num-layers",
            str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads", "8",
            "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
            "--micro-batch-size", str(args.micro_batch_size), "--train-iters", str(iters), "--log-interval", "1",
            "--save-interval", str(args.save_interval), "--eval-iters", "0", "--no-progress-bar", "--lr", "1e-4",
            *args.extra]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        baseline = busy_seconds(run(base + ["--save-interval", str(10 * iters)], os.path.join(tmp, "none.jsonl")))
        for name, flags in {"sync": [], "async": ["--async-save"]}.items():
            records = run(base + flags + ["--save", os.path.join(tmp, name)], os.path.join(tmp, f"{name}.jsonl"))
            thread = sum(r.get("checkpoint_stall_s", 0.0) for r in records)
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(tmp, name))
                       for f in fs) / args.saves
            results[name] = {"stall_s_per_save": (busy_seconds(records) - baseline) / args.saves,
                             "thread_s_per_save": thread / args.saves, "checkpoint_bytes": int(size),
                             "median_iteration_s": statistics.median(r["elapsed_ms_per_iter"] / 1000 for r in records)}
    print(json.dumps({"stall": results, "baseline_run_s": baseline,
                      "async_over_sync": results["async"]["stall_s_per_save"] / results["sync"]["stall_s_per_save"],
                      "thread_async_over_sync":
                          results["async"]["thread_s_per_save"] / results["sync"]["thread_s_per_save"],
                      "config": {k: v for k, v in vars(args).items() if k != "extra"}}))


if __name__ == "__main__":
    main()
