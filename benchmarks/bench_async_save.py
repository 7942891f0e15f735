"""The training stall per checkpoint with and without --async-save, printed as JSON.

    python benchmarks/bench_async_save.py [--hidden-size 768] [--num-layers 8] [--saves 3]

Runs launch/train.py on one rank (mock data, Adam, fp32) twice, saving every --save-interval iterations:
once writing each checkpoint synchronously, once with --async-save. The stall of a save is what the
training thread spends on it (the log records' checkpoint_stall_s: DeepSpeed's save call, and the wait
for the background writes where the next log line, save or the end of the run completes them) plus
the slowdown of the iterations run while the background writes go on (their time over the run's
median iteration time). Reported per save, with async / sync, measured in the same run of this script.
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


def stall(records: list[dict], interval: int) -> dict:
    """Per save: the training thread's save time plus the slowdown of the iterations that follow it."""
    times = [r["elapsed_ms_per_iter"] / 1000 for r in records]
    median = statistics.median(times)
    saves = [r["iteration"] for r in records if r["iteration"] % interval == 0]
    thread = sum(r.get("checkpoint_stall_s", 0.0) for r in records)
    after = [i for i in range(len(records)) if records[i]["iteration"] % interval != 0
             and (records[i]["iteration"] - 1) % interval < max(1, interval // 2)]  # the iterations after a save
    slowdown = sum(max(0.0, times[i] - median) for i in after)
    return {"saves": len(saves), "thread_s_per_save": thread / len(saves),
            "slowdown_s_per_save": slowdown / len(saves), "stall_s_per_save": (thread + slowdown) / len(saves),
            "median_iteration_s": median}


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
            str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads", "12",
            "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
            "--micro-batch-size", str(args.micro_batch_size), "--train-iters", str(iters), "--log-interval", "1",
            "--save-interval", str(args.save_interval), "--eval-iters", "0", "--no-progress-bar", "--lr", "1e-4",
            *args.extra]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in {"sync": [], "async": ["--async-save"]}.items():
            records = run(base + flags + ["--save", os.path.join(tmp, name)], os.path.join(tmp, f"{name}.jsonl"))
            results[name] = stall(records, args.save_interval)
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(tmp, name))
                       for f in fs) / args.saves
            results[name]["checkpoint_bytes"] = int(size)
    print(json.dumps({"stall": results,
                      "async_over_sync": results["async"]["stall_s_per_save"] / results["sync"]["stall_s_per_save"],
                      "config": {k: v for k, v in vars(args).items() if k != "extra"}}))


if __name__ == "__main__":
    main()
