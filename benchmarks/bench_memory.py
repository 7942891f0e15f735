"""The largest rank's peak memory at PP 2 x DP 2 under ZeRO-1, -2 and -3 (the one runtime), measured and as
`--dry-run` estimates it, stage by stage, in bf16 and fp32, at three shapes with an untied head (SHAPES:
vocab_heavy, Pythia-160M's shape with half of each stage's parameters in its vocabulary table; layer_heavy, most
in the layers; moe, 8 experts), as JSON.

    python benchmarks/bench_memory.py --shipped-configs --precision fp32   (benchmarks/results/memory_cpu.json)
    python benchmarks/bench_memory.py --shape layer_heavy [--num-layers 12 --hidden-size 768 ...]

Each ZeRO stage is one launch/train.py run on 4 CPU ranks (--mock-data, 2 iterations): each rank resets its
peak resident set (Linux's /proc/self/clear_refs) after the imports and process groups and reads it after
training (hybrid.training.run's --memory-report hook, HYBRID_MEMORY_REPORT), so the figure is what the model,
its gradients, ZeRO's buffers, the optimizer and the activations took; the estimate is hybrid.memory's for the
same flags. With --shipped-configs the runs take ds_configs/zero{1,2,3}.json as users get them; otherwise ZeRO's
buckets and ZeRO-3's optimizer sub-group (`sub_group_size`: the step's fp32 copy of the gradient partitions is
made one sub-group at a time) are --bucket elements. Under ZeRO-3 the untied vocabulary tables are row blocks
(hybrid.model.config.ModelConfig.zero3_vocab_block_rows). Writes benchmarks/results/memory_cpu.json (--out).

    python benchmarks/bench_memory.py --lora-rank 16

LoRA against full fine-tuning on the same model and layout (fp32, ZeRO-1 and ZeRO-3): adapters of rank 16 on every
projection (`all-linear`), the base frozen; measured and estimated as above. Writes
benchmarks/results/memory_lora_cpu.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GiB = 1024 ** 3


OLD_ZERO3_BUCKETS = 50_000_000  # ds_configs/zero3*.json's reduce and prefetch buckets before "auto"
# the three shapes: half the parameters in vocabulary tables (Pythia-160M's), most in the layers, an MoE model
SHAPES = {
    "vocab_heavy": dict(num_layers=12, hidden_size=768, ffn_hidden_size=None, vocab_size=50256, seq_length=128),
    "layer_heavy": dict(num_layers=8, hidden_size=1024, ffn_hidden_size=4096, vocab_size=32000, seq_length=64),
    "moe": dict(num_layers=8, hidden_size=512, ffn_hidden_size=1024, vocab_size=32000, seq_length=64, num_experts=8),
}


def _flags(a, zero: int, bucket: int, config_dir: str, bf16: bool, lora: int = 0, shipped_buckets: int = 0) -> list:
    """launch/train.py's flags for one measured run: the shipped ds_configs/zero{1,2,3}.json with --shipped-configs,
    else a config with every bucket --bucket elements."""
    adapters = ["--lora-rank", lora, "--lora-alpha", 2 * lora, "--lora-target-modules", "all-linear"] if lora else []
    if a.shipped_configs:  # as shipped; `shipped_buckets`: with those reduce and prefetch buckets instead
        with open(os.path.join(ROOT, "ds_configs", f"zero{zero}.json")) as f:
            ds = json.load(f)
        if shipped_buckets:
            ds["zero_optimization"].update(reduce_bucket_size=shipped_buckets,
                                           stage3_prefetch_bucket_size=shipped_buckets)
    else:
        ds = {"zero_optimization": {"stage": zero, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                                    "stage3_prefetch_bucket_size": bucket, "sub_group_size": bucket,
                                    "overlap_comm": False, "contiguous_gradients": True},
              "gradient_clipping": 1.0, "steps_per_print": 10**9}
    config = os.path.join(config_dir, f"zero{zero}_{shipped_buckets}.json")
    with open(config, "w") as f:
        json.dump(ds, f)
    ffn = ["--ffn-hidden-size", a.ffn_hidden_size] if a.ffn_hidden_size else []
    experts = ["--num-experts", a.num_experts, "--moe-router-topk", 2] if a.num_experts else []
    return [str(x) for x in [
        "--num-layers", a.num_layers, "--hidden-size", a.hidden_size, "--num-attention-heads", a.hidden_size // 64,
        *ffn, *experts,
        "--seq-length", a.seq_length, "--max-position-embeddings", a.seq_length, "--micro-batch-size", 1,
        "--global-batch-size", 4, "--train-iters", 2, "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", a.vocab_size, "--untie-embeddings-and-output-weights", "--lr", 1e-4, "--log-interval", 1,
        "--eval-iters", 0, "--no-progress-bar",
        "--num-workers", 0, "--pipeline-model-parallel-size", 2, "--deepspeed", config,
        *(["--bf16"] if bf16 else []), *adapters]]


def estimated(flags: list) -> list:
    """The dry run's bytes of each stage (a rank of each stage holds the same)."""
    from hybrid.config import build_run_config
    from hybrid.dry_run import plan_from_run
    from hybrid.flags import build_parser
    from hybrid.memory import estimate
    run = build_run_config(build_parser().parse_args(flags), 4, int(flags[flags.index("--vocab-size") + 1]) + 1)
    plan = dataclasses.replace(plan_from_run(run), device_type="cpu")  # measured on CPU ranks (gloo)
    return [row["total"] for row in estimate(plan)]


def measured(flags: list, report: str) -> list:
    """The largest peak among each stage's ranks."""
    # every allocation above 64 KiB its own mapping, given back to the system when freed (glibc keeps freed
    # heap memory otherwise), so the peak resident set is the peak of what was in use
    env = dict(os.environ, OMP_NUM_THREADS="1", HYBRID_MEMORY_REPORT=report, MALLOC_MMAP_THRESHOLD_="65536")
    from hybrid.distributed import free_port
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
                           str(free_port()), os.path.join(ROOT, "launch", "train.py"), *flags], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"train.py failed:\n{proc.stderr[-4000:]}")
    peaks = {}
    with open(report) as f:
        for line in f:
            row = json.loads(line)
            peaks[row["stage"]] = max(peaks.get(row["stage"], 0), row["peak_bytes"])
    return [peaks[stage] for stage in sorted(peaks)]


def _shape_rows(a, tmp: str) -> dict:
    """ZeRO-1, -2 and -3 of one shape in each precision asked: measured and estimated, stage by stage."""
    rows = {}
    for precision in (["bf16", "fp32"] if a.precision == "both" else [a.precision]):
        rows[precision] = {}
        for zero in (1, 2, 3):
            flags = _flags(a, zero, a.bucket, tmp, precision == "bf16")
            report = os.path.join(tmp, f"{a.shape}_{precision}_zero{zero}.jsonl")
            got, want = measured(flags, report), estimated(flags)
            row = {"stages": [{"measured_gib": m / GiB, "estimated_gib": w / GiB, "estimate_over_measured": w / m}
                              for m, w in zip(got, want)],
                   "largest_rank": {"measured_gib": max(got) / GiB, "estimated_gib": max(want) / GiB,
                                    "estimate_over_measured": max(want) / max(got)}}
            rows[precision][f"zero{zero}"] = row
            print(json.dumps({a.shape: {precision: {f"zero{zero}": row}}}), file=sys.stderr, flush=True)
        if a.shipped_configs and a.shape == "layer_heavy":  # ZeRO-3 with the 5e7-element buckets shipped before
            flags = _flags(a, 3, a.bucket, tmp, precision == "bf16", shipped_buckets=OLD_ZERO3_BUCKETS)
            got, want = measured(flags, os.path.join(tmp, f"{a.shape}_{precision}_zero3_old.jsonl")), estimated(flags)
            rows[precision]["zero3_buckets_5e7"] = {
                "measured_gib": max(got) / GiB, "estimated_gib": max(want) / GiB,
                "estimate_over_measured": max(want) / max(got), "stages_measured_gib": [m / GiB for m in got]}
            print(json.dumps({a.shape: {precision: {"zero3_buckets_5e7": rows[precision]["zero3_buckets_5e7"]}}}),
                  file=sys.stderr, flush=True)
        largest = {zero: rows[precision][zero]["largest_rank"]["measured_gib"] for zero in ("zero1", "zero2", "zero3")}
        rows[precision]["zero3_below_zero1_gib"] = largest["zero1"] - largest["zero3"]
        rows[precision]["zero3_below_zero1_gb"] = (largest["zero1"] - largest["zero3"]) * GiB / 1e9
    from hybrid.memory import parameter_inventory
    from hybrid.model.config import ModelConfig
    model = ModelConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.hidden_size // 64,
                        ffn_hidden_size=a.ffn_hidden_size, vocab_size=a.vocab_size + 1, num_experts=a.num_experts,
                        max_position_embeddings=a.seq_length, untie_embeddings_and_output_weights=True)
    return {"parameters": sum(n for n, _ in parameter_inventory(model, 1).values()), **rows,
            "shape": {k: getattr(a, k) for k in ("num_layers", "hidden_size", "ffn_hidden_size", "vocab_size",
                                                 "seq_length", "num_experts")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=[*SHAPES, "all"], default="all",
                   help="vocab_heavy (Pythia-160M's shape), layer_heavy, moe, or all three")
    for flag in ("num-layers", "hidden-size", "ffn-hidden-size", "vocab-size", "seq-length", "num-experts"):
        p.add_argument(f"--{flag}", type=int, default=None, help="instead of the shape's")
    p.add_argument("--bucket", type=int, default=5_000_000,
                   help="ZeRO's reduce / gather / prefetch buckets and ZeRO-3's optimizer sub-group (elements)")
    p.add_argument("--shipped-configs", action="store_true",
                   help="ds_configs/zero{1,2,3}.json as shipped instead of --bucket-sized buckets")
    p.add_argument("--precision", choices=["both", "bf16", "fp32"], default="both")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="compare LoRA of this rank (all-linear) with full fine-tuning instead (fp32, ZeRO-1 and -3)")
    p.add_argument("--out", default=None, help="default: benchmarks/results/memory_cpu.json (memory_lora_cpu.json)")
    a = p.parse_args()
    a.out = a.out or os.path.join(ROOT, "benchmarks", "results",
                                  "memory_lora_cpu.json" if a.lora_rank else "memory_cpu.json")
    given = {k: v for k, v in vars(a).items() if k in SHAPES["moe"] and v is not None}
    shapes = list(SHAPES) if a.shape == "all" else [a.shape]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in shapes:
            vars(a).update({"num_experts": None, **SHAPES[name], **given}, shape=name)
            if a.lora_rank:
                return _lora(a)
            results[name] = _shape_rows(a, tmp)
    config = {k: v for k, v in vars(a).items() if k not in SHAPES["moe"] and k not in ("shape", "out")}
    if os.path.isfile(a.out):  # the shapes measured now replace theirs; the others are kept
        with open(a.out) as f:
            earlier = json.load(f)
        if earlier.get("config") == config and "shapes" in earlier:
            results = {**earlier["shapes"], **results}
    result = {"benchmark": "memory_pp2_dp2_cpu", "shapes": results, "config": config}
    text = json.dumps(result, indent=2)
    print(text)
    with open(a.out, "w") as f:
        f.write(text + "\n")


def _lora(a) -> None:
    """LoRA (--lora-rank, all-linear) against full fine-tuning: each rank's peak, measured and estimated."""
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for zero in (1, 3):
            for name, rank in (("full", 0), ("lora", a.lora_rank)):
                flags = _flags(a, zero, a.bucket, tmp, False, rank)
                report = os.path.join(tmp, f"{name}_zero{zero}.jsonl")
                got, want = measured(flags, report), estimated(flags)
                rows[f"{name}_zero{zero}"] = {"measured_gib": max(got) / GiB, "estimated_gib": max(want) / GiB,
                                              "estimate_over_measured": max(want) / max(got)}
                print(json.dumps({f"{name}_zero{zero}": rows[f"{name}_zero{zero}"]}), file=sys.stderr, flush=True)
            rows[f"lora_over_full_zero{zero}"] = (rows[f"lora_zero{zero}"]["measured_gib"]
                                                  / rows[f"full_zero{zero}"]["measured_gib"])
    result = {"benchmark": "memory_lora_pp2_dp2_cpu", **rows, "config": vars(a)}
    text = json.dumps(result, indent=2)
    print(text)
    with open(a.out, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
