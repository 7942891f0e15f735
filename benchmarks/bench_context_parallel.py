"""Context parallelism measured: activation bytes per rank against sequence length at CP 1/2/4, the ring's
overlap, and the longest sequence that fits a memory budget; JSON (and a PNG with --chart).

    python benchmarks/bench_context_parallel.py [--seq 1024 2048 4096] [--chart out.png]

1. Activations: a Llama-style model (GQA, RoPE, SwiGLU, fp32) runs forward and backward on CP ranks
   (gloo, one process per rank), per rank, at each sequence length and CP size: every tensor autograd
   keeps for backward, counted once by storage (the activation memory a rank holds at the end of the
   forward), and the resident-memory peak of the step above what was resident before (activations,
   the ring's buffers, every temporary; CPU allocator noise included); the estimator's ring buffers
   (hybrid.memory.activations.sequence_split_buffer_bytes) beside. Ratios are against CP 1 at the same length.
2. Overlap: one attention layer's ring (forward + backward) at CP 2 against its compute alone (the same
   block kernels run back to back in one process, no communication): 1.0 means the K/V transfers
   are fully hidden behind compute.
3. Sliding windows: one attention layer's ring (forward + backward) at CP 2 with a window (--window; the blocks
   the window cuts run in bands against the keys each band reaches, those it hides are skipped) against the
   same ring without one (every pair causal): the windowed layer's share of a full layer's time.
4. Fits: the `--dry-run` estimator's longest sequence (a multiple of 1024) whose peak per rank fits
   --budget-gb for Llama 3 8B at TP 8, bf16, selective recompute, ZeRO-1, at CP 1/2/4.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = dict(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2, vocab_size=2048,
             max_position_embeddings=65536, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
             add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
             attention_dropout=0.0)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _saved_bytes(cp: int, seq: int, batch: int) -> tuple[int, int]:
    """(bytes autograd keeps for backward after one forward of the whole model on this rank, the
    resident-memory peak of that forward and backward above what was resident before: activations,
    the ring's buffers and temporaries; gradients exist already from a warm-up step)."""
    import ctypes
    import gc
    from hybrid.model.config import ModelConfig
    from hybrid.model.gpt import GPTModel
    from hybrid.parallel.groups import build_groups
    model = GPTModel(ModelConfig(**MODEL), build_groups(context_parallel=cp))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def record(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (batch, seq), generator=g)
    model(ids, ids).backward()  # warm-up: gradients allocated, kernels loaded
    loss = None
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the current resident size
    before = _status("VmRSS:")
    with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
        loss = model(ids, ids)
    loss.backward()
    return sum(kept.values()), _status("VmHWM:") - before


def _ring_seconds(seq: int, repeats: int) -> tuple[float, float]:
    """(ring forward + backward, the same block kernels alone) seconds at CP 2, this rank's."""
    import torch.distributed as dist
    from hybrid.parallel.groups import Axis
    from hybrid.parallel.ring_attention import _step_plan, block_backward, block_forward, ring_attention
    axis = Axis.of(dist.group.WORLD)
    g = torch.Generator().manual_seed(1)
    heads, groups, d, local = 8, 8, 64, seq // 2
    q, k, v = (torch.randn(1, n, local, d, generator=g) for n in (heads, groups, groups))
    grad = torch.randn(1, heads, local, d, generator=g)

    def ring():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        ring_attention(qq, kk, vv, axis, d ** -0.5).backward(grad)

    def compute_alone():
        for step in range(axis.size):
            _, rows, cols, causal = _step_plan(step, axis.rank, axis.size, local // 2)
            out, lse, state = block_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], None, causal, d ** -0.5)
            block_backward(grad[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols], out, lse, None, causal,
                           d ** -0.5, state=state)

    timings = []
    for fn in (ring, compute_alone) * (repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        fn()
        timings.append(time.perf_counter() - start)
    ring_times, alone_times = timings[2::2], timings[3::2]  # the first round warms up
    return min(ring_times), min(alone_times)


def _window_seconds(seq: int, window: int, repeats: int) -> tuple[float, float]:
    """(the ring with `window`, the ring without) forward + backward seconds at CP 2, this rank's."""
    import torch.distributed as dist
    from hybrid.parallel.groups import Axis
    from hybrid.parallel.ring_attention import ring_attention
    axis = Axis.of(dist.group.WORLD)
    g = torch.Generator().manual_seed(2)
    heads, d, local = 8, 64, seq // 2
    q, k, v = (torch.randn(1, heads, local, d, generator=g) for _ in range(3))
    grad = torch.randn(1, heads, local, d, generator=g)

    def run(w):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        ring_attention(qq, kk, vv, axis, d ** -0.5, window=w).backward(grad)

    timings = []
    for w in (window, None) * (repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        run(w)
        timings.append(time.perf_counter() - start)
    return min(timings[2::2]), min(timings[3::2])  # the first round warms up


def _worker(rank, world, port, task, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = task(*args)
    out.put((rank, result))
    dist.destroy_process_group()


def on_ranks(world: int, task, *args):
    from hybrid.distributed import free_port
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, task, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]


def longest_fitting_sequence(cp: int, budget_gb: float) -> int:
    """The estimator's longest multiple of 1024 that fits `budget_gb` per rank (Llama 3 8B, TP 8)."""
    from hybrid.memory import GiB, MemoryPlan, ZeroSettings, estimate
    from hybrid.model.config import ModelConfig
    config = ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                         ffn_hidden_size=14336, vocab_size=128256, max_position_embeddings=1 << 20,
                         position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                         untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
                         sequence_parallel=True, recompute_granularity="selective", rotary_base=500000.0)
    best, seq = 0, 1024
    while seq <= 1 << 20:
        plan = MemoryPlan(model=config, tp=8, dp=1, micro_batch=1, seq_length=seq, cp=cp, recompute="selective",
                          zero=ZeroSettings(stage=1, dp=cp, precision="bf16"))
        if max(r["total"] for r in estimate(plan)) / GiB > budget_gb * 0.9:
            break
        best, seq = seq, seq + 1024
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ring-seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-gb", type=float, default=80.0)
    parser.add_argument("--window", type=int, default=128, help="the sliding window of section 3 (GPT-OSS's 128)")
    parser.add_argument("--chart", default=None, help="write a PNG of activation bytes per rank (needs matplotlib)")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    args = parser.parse_args()

    from hybrid.memory.activations import ActivationSettings, sequence_split_buffer_bytes
    from hybrid.model.config import ModelConfig
    activations = []
    for seq in args.seq:
        base = None
        for cp in args.cp:
            ranks = on_ranks(cp, _saved_bytes, cp, seq, args.batch)
            saved, peak = max(r[0] for r in ranks), max(r[1] for r in ranks)
            base = base or (saved, peak)
            buffers = sequence_split_buffer_bytes(ModelConfig(**MODEL), ActivationSettings(
                args.batch, seq, precision="fp32", cp=cp), "cpu")
            activations.append(dict(seq=seq, cp=cp, saved_bytes_per_rank=saved, saved_ratio_to_cp1=saved / base[0],
                                    peak_resident_bytes_per_rank=peak, peak_ratio_to_cp1=peak / base[1],
                                    ring_buffer_bytes_estimated=buffers))
            print(json.dumps(activations[-1]), file=sys.stderr, flush=True)
    ring, alone = max(on_ranks(2, _ring_seconds, args.ring_seq, args.repeats), key=lambda t: t[0])
    windowed, full = max(on_ranks(2, _window_seconds, args.ring_seq, args.window, args.repeats), key=lambda t: t[0])
    result = dict(
        machine=f"{os.cpu_count()} CPU cores, gloo, fp32", model=MODEL, batch=args.batch, activations=activations,
        ring_overlap=dict(seq=args.ring_seq, cp=2, ring_seconds=ring, compute_alone_seconds=alone,
                          ratio=ring / alone),
        windowed_ring=dict(seq=args.ring_seq, cp=2, window=args.window, windowed_seconds=windowed,
                           causal_seconds=full, ratio=windowed / full),
        longest_sequence_fitting=dict(model="Llama 3 8B, TP 8 + SP, bf16, selective recompute, ZeRO-1",
                                      budget_gb=args.budget_gb,
                                      by_cp={cp: longest_fitting_sequence(cp, args.budget_gb) for cp in (1, 2, 4, 8)}))
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    if args.chart:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for cp in args.cp:
            rows = [a for a in activations if a["cp"] == cp]
            line, = ax.plot([a["seq"] for a in rows], [a["peak_resident_bytes_per_rank"] / 2**20 for a in rows],
                            marker="o", label=f"CP {cp} (peak)")
            ax.plot([a["seq"] for a in rows], [a["saved_bytes_per_rank"] / 2**20 for a in rows], marker=".",
                    linestyle="--", color=line.get_color(), label=f"CP {cp} (kept for backward)")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("MiB per rank")
        ax.set_title("hybrid context parallelism (ring attention), CPU fp32")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.chart, dpi=120)


if __name__ == "__main__":
    main()
