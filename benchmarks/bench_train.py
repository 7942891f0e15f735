"""Training throughput and the cost of activation recompute, printed as JSON.

    python benchmarks/bench_train.py [--iters 20] [--hidden-size 256] [--num-layers 4] [--seq-length 256]

Runs launch/train.py on one rank with --mock-data for each variant (no recompute, selective,
full) and reports tokens/s (median of the iterations after warm-up) and each variant's ratio to
the no-recompute baseline measured in the same run. On a GPU, add --bf16 --use-flash-attn.
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
VARIANTS = {"none": [], "selective": ["--recompute-granularity", "selective"],
            "full": ["--recompute-granularity", "full", "--recompute-num-layers", "1"]}


def measure(flags: list[str], log: str) -> float:
    cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), *flags, "--log-json", log]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"train.py failed:\n{proc.stderr[-3000:]}")
    with open(log) as f:
        rates = [json.loads(line)["tokens_per_s"] for line in f if '"tokens_per_s"' in line]
    return statistics.median(rates[2:] or rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("extra", nargs="*", help="more launch/train.py flags (after --)")
    args = parser.parse_args()
    base = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "8000", "--num-layers",
            str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads", "4",
            "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
            "--train-iters", str(args.iters), "--log-interval", "1", "--eval-iters", "0", "--no-progress-bar",
            *args.extra]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in VARIANTS.items():
            results[name] = measure(base + flags, os.path.join(tmp, f"{name}.jsonl"))
    print(json.dumps({"tokens_per_s": results,
                      "ratio_to_no_recompute": {k: v / results["none"] for k, v in results.items()},
                      "config": {k: v for k, v in vars(args).items() if k != "extra"}}))


if __name__ == "__main__":
    main()
