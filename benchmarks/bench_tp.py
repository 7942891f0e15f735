"""Tensor parallelism side by side: hybrid at TP 2 (with and without SP, overlapped or synchronous TP
backward) against DeepSpeed's own AutoTP on transformers' LlamaForCausalLM of the same dims and optimizer,
and both against one rank; JSON (and a PNG with --chart).

    python benchmarks/bench_tp.py [--rounds 2] [--iters 6] [--chart out.png]

Every run is its own launch (torchrun; one rank runs with as many threads as the TP 2 runs have ranks),
the configurations alternate round by round, and a run's figure is the median tokens/s of its
iterations after the first (warm-up). Same model everywhere: Llama shape (RMSNorm, SwiGLU, RoPE, no
biases, untied), fp32, dropout off, AdamW (torch's), clipping 1.0, ZeRO-1, mock tokens. Ratios are
against runs measured in the same invocation.
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


def _hybrid_flags(a) -> list[str]:
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(a.vocab), "--num-layers",
            str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads), "--ffn-hidden-size",
            str(a.ffn), "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq), "--micro-batch-size",
            str(a.micro), "--global-batch-size", str(a.micro), "--train-iters", str(a.iters), "--log-interval", "1",
            "--eval-iters", "0", "--no-progress-bar", "--position-embedding-type", "rope", "--normalization",
            "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--clip-grad", "1.0", "--lr", "1e-4",
            "--make-vocab-size-divisible-by", "128", "--deepspeed", "ds_configs/zero1.json"]


def _launch(nproc: int, script: str, flags: list[str], threads: int) -> subprocess.CompletedProcess:
    cmd = ([sys.executable, script] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(_free_port()), script])
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=ROOT)
    if nproc == 1:  # a one-process job as the launchers describe it (DeepSpeed would try MPI otherwise)
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    proc = subprocess.run(cmd + flags, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{script} failed:\n{proc.stderr[-4000:]}")
    return proc


def _free_port() -> int:
    sys.path.insert(0, ROOT)
    from hybrid.distributed import free_port
    return free_port()


def hybrid_tokens_per_s(a, nproc: int, extra: list[str], log: str) -> float:
    _launch(nproc, "launch/train.py", _hybrid_flags(a) + extra + ["--log-json", log], threads=2 // nproc or 1)
    with open(log) as f:
        rates = [json.loads(line)["tokens_per_s"] for line in f if '"tokens_per_s"' in line]
    return statistics.median(rates[1:] or rates)


def transformers_tokens_per_s(a, nproc: int, out: str) -> float:
    """LlamaForCausalLM under deepspeed.initialize: AutoTP at nproc 2 ("tensor_parallel": {"autotp_size"}),
    plain at nproc 1."""
    _launch(nproc, os.path.join("benchmarks", "bench_tp.py"),
            ["--worker", out, *[f"--{k}={v}" for k, v in _dims(a).items()]], threads=2 // nproc or 1)
    with open(out) as f:
        return json.load(f)["tokens_per_s"]


def _dims(a) -> dict:
    return dict(layers=a.layers, hidden=a.hidden, heads=a.heads, ffn=a.ffn, vocab=a.vocab, seq=a.seq,
                micro=a.micro, iters=a.iters)


def worker(a) -> None:
    """One transformers run (inside torchrun for AutoTP): tokens/s of the iterations after the first."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                         num_attention_heads=a.heads, num_key_value_heads=a.heads, max_position_embeddings=a.seq,
                         tie_word_embeddings=False, attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    ds_config = {"train_micro_batch_size_per_gpu": a.micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                 "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
    if world > 1:
        ds_config["tensor_parallel"] = {"autotp_size": world}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    g = torch.Generator().manual_seed(1)
    times = []
    for _ in range(a.iters):
        ids = torch.randint(0, a.vocab, (a.micro, a.seq), generator=g).to(engine.device)
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    rate = a.micro * a.seq / statistics.median(times[1:] or times)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(a.worker, "w") as f:
            json.dump({"tokens_per_s": rate}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1376)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chart", default=None)
    parser.add_argument("--output", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        return worker(a)
    runs = {
        "hybrid one rank": lambda log: hybrid_tokens_per_s(a, 1, [], log),
        "hybrid TP 2": lambda log: hybrid_tokens_per_s(a, 2, ["--tensor-model-parallel-size", "2"], log),
        "hybrid TP 2 + SP": lambda log: hybrid_tokens_per_s(a, 2, ["--tensor-model-parallel-size", "2",
                                                                  "--sequence-parallel"], log),
        "hybrid TP 2, synchronous TP backward": lambda log: hybrid_tokens_per_s(
            a, 2, ["--tensor-model-parallel-size", "2", "--no-async-tensor-model-parallel-allreduce"], log),
        "transformers one rank": lambda log: transformers_tokens_per_s(a, 1, log),
        "DeepSpeed AutoTP 2 (transformers)": lambda log: transformers_tokens_per_s(a, 2, log),
    }
    measured = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for i, (name, fn) in enumerate(runs.items()):
                measured[name].append(fn(os.path.join(tmp, f"{r}_{i}.json")))
                print(json.dumps({"round": r, "run": name, "tokens_per_s": measured[name][-1]}), file=sys.stderr,
                      flush=True)
    median = {name: statistics.median(v) for name, v in measured.items()}
    result = dict(
        machine=f"{os.cpu_count()} CPU cores, gloo, fp32", dims=_dims(a), tokens_per_s=median, per_round=measured,
        ratios={"hybrid TP 2 / AutoTP 2": median["hybrid TP 2"] / median["DeepSpeed AutoTP 2 (transformers)"],
                "hybrid TP 2 + SP / AutoTP 2": median["hybrid TP 2 + SP"] / median["DeepSpeed AutoTP 2 (transformers)"],
                "hybrid TP efficiency (TP 2 / one rank)": median["hybrid TP 2"] / median["hybrid one rank"],
                "AutoTP efficiency (AutoTP 2 / transformers one rank)":
                    median["DeepSpeed AutoTP 2 (transformers)"] / median["transformers one rank"],
                "overlapped / synchronous TP backward":
                    median["hybrid TP 2"] / median["hybrid TP 2, synchronous TP backward"],
                "hybrid one rank / transformers one rank": median["hybrid one rank"] / median["transformers one rank"]})
    text = json.dumps(result, indent=2)
    print(text)
    if a.output:
        with open(a.output, "w") as f:
            f.write(text + "\n")
    if a.chart:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4))
        names = list(median)
        ax.barh(names, [median[n] for n in names])
        ax.set_xlabel("tokens/s (median)")
        ax.set_title(f"TP on {os.cpu_count()} CPU cores: Llama {a.layers} x {a.hidden}, seq {a.seq}, batch {a.micro}")
        fig.tight_layout()
        fig.savefig(a.chart, dpi=120)


if __name__ == "__main__":
    main()
