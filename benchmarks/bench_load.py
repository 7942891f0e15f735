"""Peak resident memory (and time) that loading adds to a training rank: `--load-hf` of a synthetic Llama
saved as bf16 safetensors, against the same architecture from random init, at TP 1/2/4 and under ZeRO-3 at
DP 2, each launched with torchrun for one iteration; JSON on stdout and in benchmarks/results/load_cpu.json.

    python benchmarks/bench_load.py                      # ~250M parameters (0.5 GB of bf16 weights)
    python benchmarks/bench_load.py --layers 4 --hidden 512 --quick

Each rank reports its own VmHWM (the kernel's peak resident set) when it exits; a layout's figure is the
largest rank's. "added" = peak with --load-hf minus peak from random init at the same layout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def child(argv: list) -> int:
    """Run launch/train.py's main in this process, then print this rank's peak resident memory."""
    from hybrid.training.run import main
    code = main(argv)
    with open(os.path.join(os.environ["BENCH_LOAD_PEAKS"], f"rank{os.environ.get('RANK', '0')}"), "w") as f:
        f.write(str(_peak_bytes()))
    return code


def make_model(path: str, layers: int, hidden: int, vocab: int) -> int:
    """A random Llama (GQA, SwiGLU, untied) saved as bf16 safetensors; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                         max_position_embeddings=256, tie_word_embeddings=False, dtype="bfloat16")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer_dir = os.path.join(ROOT, "hybrid", "data", "default")
    return sum(p.numel() for p in model.parameters()), config, tokenizer_dir


def _flags(config) -> list:
    """The same architecture as flags (the random-init baseline)."""
    return ["--num-layers", config.num_hidden_layers, "--hidden-size", config.hidden_size,
            "--num-attention-heads", config.num_attention_heads, "--group-query-attention", "--num-query-groups",
            config.num_key_value_heads, "--ffn-hidden-size", config.intermediate_size, "--position-embedding-type",
            "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--norm-epsilon", config.rms_norm_eps,
            "--padded-vocab-size", config.vocab_size]


def launch(nproc: int, flags: list) -> tuple[int, float]:
    """(largest rank's peak bytes, seconds) of one torchrun launch of `child`."""
    peaks_dir = tempfile.mkdtemp(prefix="peaks-")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline",
               HF_HUB_OFFLINE="1", BENCH_LOAD_PEAKS=peaks_dir)
    from hybrid.distributed import free_port
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), os.path.abspath(__file__), "--child", *map(str, flags)]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.time() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    peaks = [int(open(os.path.join(peaks_dir, name)).read()) for name in os.listdir(peaks_dir)]
    return max(peaks), seconds


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--layouts", default="tp1,tp2,tp4,zero3_dp2")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "load_cpu.json"))
    p.add_argument("--quick", action="store_true", help="do not write --out")
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="bench-load-")
    hf_dir = os.path.join(work, "hf")
    params, config, assets = make_model(hf_dir, a.layers, a.hidden, a.vocab)
    vocab_file, merge_file = os.path.join(assets, "vocab.json"), os.path.join(assets, "merges.txt")
    common = ["--seq-length", 64, "--micro-batch-size", 1, "--train-iters", 1, "--eval-iters", 0, "--mock-data",
              "--lr", 1e-5, "--no-progress-bar", "--log-interval", 1, "--vocab-file", vocab_file,
              "--merge-file", merge_file]
    layouts = {"tp1": (1, []), "tp2": (2, ["--tensor-model-parallel-size", 2]),
               "tp4": (4, ["--tensor-model-parallel-size", 4]),
               "zero3_dp2": (2, ["--deepspeed", os.path.join(ROOT, "ds_configs", "zero3.json")])}
    results = {"parameters": params, "hf_bytes": params * 2, "layouts": {}}
    for name in a.layouts.split(","):
        nproc, extra = layouts[name]
        random_peak, random_s = launch(nproc, common + extra + _flags(config))
        hf_peak, hf_s = launch(nproc, common + extra + ["--load-hf", hf_dir])
        results["layouts"][name] = {"ranks": nproc, "peak_random_init_gb": random_peak / 1e9,
                                    "peak_load_hf_gb": hf_peak / 1e9, "added_gb": (hf_peak - random_peak) / 1e9,
                                    "seconds_random_init": random_s, "seconds_load_hf": hf_s}
        print(json.dumps({name: results["layouts"][name]}), flush=True)
    print(json.dumps(results, indent=1))
    if not a.quick:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
