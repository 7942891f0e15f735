"""Decoding speed of the engine's own generation (hybrid.model.generate) against transformers' `generate` with its
static cache on the same model in the same process, at TP 2, and inside --grpo at ZeRO-1 and ZeRO-3, as JSON.

    python benchmarks/bench_generate.py [--hidden-size 512] [--num-layers 4] [--batch 8] [--new 64]

- one rank: greedy completions of `--batch` prompts of different lengths (left-padded); tokens/s of the whole
  generate call (prefill included) for both, their ratio, and whether the tokens agree;
- TP 2: the same completions on 2 ranks (torchrun, one thread per rank; the one-rank run also at one thread, in
  the same worker script), tokens/s and the ratio to one rank;
- groups: --grpo's batches, `--batch` / 8 prompts of 64 to 128 tokens x 8 sampled completions that end at an end
  token (about one in 64 draws): the shared prefill (a group's prompt once) with ended rows leaving the batch
  against every row prefilled and kept to the end (generate's compact=False), interleaved, and whether each row's
  tokens agree;
- --grpo: the generation tokens/s each iteration logs (generate_tokens_per_s) at DP 2 ZeRO-1 and ZeRO-3: ZeRO-3
  decodes with the parameters fetched by its hooks layer by layer, every step (the switch costs no copy of
  the weights; this is its price).
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
sys.path.insert(0, ROOT)


def make_model(path: str, hidden: int, layers: int):
    import torch
    import transformers
    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=4 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                      num_key_value_heads=max(1, hidden // 128), max_position_embeddings=512,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def prompts(batch: int):
    import torch
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 48, (batch,), generator=g)
    return [torch.randint(1, 8192, (int(n),), generator=g).tolist() for n in lengths]


def ours(path: str, batch: list, new: int, groups=None, repeats: int = 3, device=None):
    from hybrid.conversion.hf import hf_parts, read_hf_config
    from hybrid.evaluation import loaded_model
    from hybrid.model.generate import SamplingOptions, decoding, generate
    from hybrid.parallel.groups import ParallelGroups
    config = read_hf_config(path, "--load-hf")
    groups = groups or ParallelGroups.single()
    from hybrid.evaluation import rank_device
    model = loaded_model(config, groups, lambda wanted: hf_parts(path, config, wanted), device or rank_device())
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = generate(model, groups, batch, SamplingOptions(max_new_tokens=new))
        times.append(time.perf_counter() - start)
    switch = time.perf_counter()
    for _ in range(100):  # train -> generate -> train: the mode switch alone (no copy of the weights is made)
        with decoding(model):
            pass
    out.stats["switch_s"] = (time.perf_counter() - switch) / 100
    return out.tokens, statistics.median(times), out.stats


def groups_case(path: str, batch_size: int, new: int) -> dict:
    """The groups case (module docstring): tokens/s with and without compaction, the ratio, rows equal."""
    import torch
    from hybrid.conversion.hf import hf_parts, read_hf_config
    from hybrid.evaluation import loaded_model, rank_device
    from hybrid.model.generate import SamplingOptions, generate
    from hybrid.parallel.groups import ParallelGroups
    config = read_hf_config(path, "--load-hf")
    model = loaded_model(config, ParallelGroups.single(), lambda wanted: hf_parts(path, config, wanted), rank_device())
    g = torch.Generator().manual_seed(2)
    distinct = [torch.randint(1, 8192, (int(n),), generator=g).tolist()
                for n in torch.randint(64, 129, (max(1, batch_size // 8),), generator=g)]
    batch = [p for p in distinct for _ in range(8)]
    options = SamplingOptions(max_new_tokens=new, temperature=1.0, seed=1, eos=tuple(range(1, 8192, 64)))
    keys = list(range(len(batch)))
    times = {True: [], False: []}
    outs = {}
    for _ in range(5):
        for compact in (True, False):
            start = time.perf_counter()
            outs[compact] = generate(model, None, batch, options, keys=keys, compact=compact)
            times[compact].append(time.perf_counter() - start)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    tokens = outs[True].stats["new_tokens"]
    return {"prompts": len(distinct), "completions": len(batch), "new_tokens": tokens,
            "mean_completion_length": tokens / len(batch), "compact_tokens_per_s": tokens / on,
            "baseline_tokens_per_s": tokens / off, "ratio": off / on,
            "rows_equal": f"{sum(x == y for x, y in zip(outs[True].tokens, outs[False].tokens))}/{len(batch)}",
            "rows_at_end": outs[True].stats["rows_at_end"]}


def transformers_generate(model, batch: list, new: int, repeats: int = 3):
    import torch
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                                 pad_token_id=0, cache_implementation="static")
        times.append(time.perf_counter() - start)
    return out[:, width:].tolist(), statistics.median(times)


def tp_worker(path: str, batch_size: int, new: int, out: str) -> None:
    """On each torchrun rank (one thread): the completions at TP = WORLD_SIZE; rank 0 writes the time."""
    import torch
    from hybrid.parallel.dims import ParallelDims
    from hybrid.parallel.groups import build_groups
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    groups = build_groups(ParallelDims(world, world, 1))
    tokens, seconds, _ = ours(path, prompts(batch_size), new, groups)
    if int(os.environ["RANK"]) == 0:
        with open(out, "w") as f:
            json.dump({"seconds": seconds, "tokens": tokens}, f)


def torchrun(nproc: int, args: list) -> None:
    launcher = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([launcher, "--nproc_per_node", str(nproc), os.path.abspath(__file__), *args],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun failed:\n{proc.stderr[-3000:]}")


def grpo_tokens_per_s(zero: int, tmp: str) -> float:
    log = os.path.join(tmp, f"grpo_zero{zero}.jsonl")
    flags = ["--grpo", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length",
             "96", "--global-batch-size", "32", "--micro-batch-size", "8", "--max-new-tokens", "32", "--train-iters",
             "4", "--log-interval", "1", "--no-demo", "--zero-stage", str(zero), "--log-json", log]
    launcher = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([launcher, "--nproc_per_node", "2", os.path.join(ROOT, "launch", "train.py"), *flags],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"train.py failed:\n{proc.stderr[-3000:]}")
    with open(log) as f:
        records = [json.loads(line) for line in f if "generate_tokens_per_s" in line]
    return {key: statistics.median(r[key] for r in records[1:])
            for key in ("generate_tokens_per_s", "generate_s", "kv_cache_mib", "elapsed_ms_per_iter")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--tp-worker", nargs=2, default=None, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.tp_worker:
        return tp_worker(a.tp_worker[0], a.batch, a.new, a.tp_worker[1])
    import torch
    tmp = tempfile.mkdtemp(prefix="bench-generate-")
    path = os.path.join(tmp, "model")
    from hybrid.evaluation import rank_device
    hf = make_model(path, a.hidden_size, a.num_layers).to(rank_device())  # the accelerator where there is one
    batch = prompts(a.batch)
    total = a.batch * a.new
    ours_times, hf_times = [], []
    for _ in range(5):  # interleaved: the machine's load changes alike for both
        mine, seconds, stats = ours(path, batch, a.new, repeats=1)
        theirs, hf_seconds = transformers_generate(hf, batch, a.new, repeats=1)
        ours_times.append(seconds)
        hf_times.append(hf_seconds)
    seconds, hf_seconds = statistics.median(ours_times), statistics.median(hf_times)
    same = sum(x == y for x, y in zip(mine, theirs))
    result = {"model": {"hidden_size": a.hidden_size, "num_layers": a.num_layers, "vocab": 8192},
              "batch": a.batch, "new_tokens_per_row": a.new, "threads": torch.get_num_threads(),
              "one_rank": {"ours_tokens_per_s": total / seconds, "transformers_static_cache_tokens_per_s":
                           total / hf_seconds, "ratio": hf_seconds / seconds, "rows_equal": f"{same}/{a.batch}",
                           "prefill_s": stats["prefill_s"], "kv_cache_mib": stats["cache_bytes"] / 2 ** 20,
                           "train_to_generate_switch_s": stats["switch_s"], "switch_bytes_copied": 0}}
    result["groups"] = groups_case(path, max(a.batch, 32), a.new)
    one_thread, two = os.path.join(tmp, "tp1.json"), os.path.join(tmp, "tp2.json")
    torchrun(1, ["--batch", str(a.batch), "--new", str(a.new), "--tp-worker", path, one_thread])
    torchrun(2, ["--batch", str(a.batch), "--new", str(a.new), "--tp-worker", path, two])
    t1, t2 = (json.load(open(f)) for f in (one_thread, two))
    result["tp2"] = {"one_rank_one_thread_tokens_per_s": total / t1["seconds"],
                     "tp2_one_thread_each_tokens_per_s": total / t2["seconds"],
                     "speedup": t1["seconds"] / t2["seconds"], "tokens_equal_one_rank": t1["tokens"] == t2["tokens"]}
    result["grpo_dp2"] = {f"zero{z}": grpo_tokens_per_s(z, tmp) for z in (1, 3)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
