"""The code paths that run only on CUDA, each checked once against a reference: one JSON line per check
({"check", "ok", figures...}, or "skipped" with the reason), to stdout and --out. benchmarks/gpu_check.sh
runs it first; on a machine without a GPU every check says, in one line, that it needs one.

    python checks/gpu_paths.py [--out gpu_paths.jsonl] [--only ring_flash_vs_full,...]

Checks (single GPU unless said): nccl (process group, timeout, a collective), flash_attn_vs_sdpa (causal,
window, dropout statistics; packed documents fall back to SDPA), precision (bf16 and fp16 forward/backward
against fp32), fp16_loss_scale_stop (launch/train.py stops on a collapsed loss scale), ring_flash_vs_full (the
ring's CUDA flash-attention blocks, merged, against full-sequence attention, GQA), grouped_gemm_bf16
(torch._grouped_mm against the per-expert loop), async_save (--async-save's files equal synchronous ones),
pinned_batches (the loader's pinned, non-blocking copies), compile_vs_eager (--torch-compile's layers),
fp8_gemm (against torchao's Float8Linear on torch._scaled_mm), activation_offload (--cpu-offloading equals
the run without it), moe_host_syncs (host synchronisations per MoE layer), gated_delta_net_fla (flash-linear-
attention's kernel against the PyTorch chunked form); with 2+ GPUs: tp_overlap_nccl,
ulysses_all_to_all_nccl, moe_all_to_all_nccl (launched layouts against one GPU). Tokens/s and MFU against
transformers are benchmarks/bench_vs_transformers.py's (gpu_check.sh runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda") if CUDA else torch.device("cpu")
TINY = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "1000", "--log-interval", "1", "--eval-iters", "0", "--no-progress-bar"]


def _close(a, b, rel: float) -> float:
    """The largest difference relative to the reference's largest magnitude."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _launch(args: list, nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)] if nproc > 1
           else [sys.executable]) + [os.path.join(ROOT, "launch", "train.py"), *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1"))


def _losses(path: str) -> list:
    with open(path) as f:
        return [json.loads(line)["lm_loss"] for line in f if "consumed_samples" in line]


# --- the checks: each returns a dict of figures with "ok", or raises ----------------------------------------

def nccl():
    import datetime

    import torch.distributed as dist

    from hybrid.distributed import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(minutes=1))
    x = torch.ones(4, device=DEVICE)
    dist.all_reduce(x)
    dist.barrier()
    ok = dist.get_backend() == "nccl" and x.sum().item() == 4
    dist.destroy_process_group()
    return {"ok": ok, "note": "a dead peer's 'exit status 4' needs 2+ ranks: NCCL puts one rank per GPU"}


def flash_attn_vs_sdpa():
    from hybrid.model.attention import CoreAttention
    from hybrid.model.config import ModelConfig
    from hybrid.model.flash import flash_attn_func
    if flash_attn_func is None:
        return {"ok": None, "skipped": "flash-attn is not installed"}
    out = {}
    for name, window in (("causal", None), ("window", 64)):
        config = ModelConfig(num_attention_heads=8, hidden_size=512, attention_dropout=0.0, sliding_window=window)
        q, k, v = (torch.randn(256, 2, 8, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
        flash = CoreAttention(dict_to(config, use_flash_attn=True), 0)
        sdpa = CoreAttention(config, 0)
        out[name] = _close(flash(q, k, v), sdpa(q, k, v), 0)
    config = ModelConfig(num_attention_heads=8, hidden_size=512, attention_dropout=0.3, use_flash_attn=True)
    core = CoreAttention(config, 0).train()
    q = torch.zeros(512, 2, 8, 64, device=DEVICE, dtype=torch.bfloat16)
    v = torch.ones(512, 2, 8, 64, device=DEVICE, dtype=torch.bfloat16)
    kept = core(q, q, v).float().mean().item()  # uniform attention over ones: the kept share x 1/(1-p)
    out["dropout_mean"] = kept
    return {"ok": out["causal"] < 2e-2 and out["window"] < 2e-2 and abs(kept - 1.0) < 0.05, **out}


def dict_to(config, **fields):
    import dataclasses
    return dataclasses.replace(config, **fields)


def precision():
    from hybrid.model.config import ModelConfig
    from hybrid.model.gpt import GPTModel
    config = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=1000,
                         max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0)
    ids = torch.randint(0, 1000, (4, 129), device=DEVICE)
    results = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = GPTModel(config).to(DEVICE, dtype)
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        results[str(dtype)] = (loss.item(), model.layers[0].attention.qkv.weight.grad.float())
    fp32_loss, fp32_grad = results["torch.float32"]
    figures = {f"{k}_loss_rel": abs(v[0] - fp32_loss) / fp32_loss for k, v in results.items()}
    figures.update({f"{k}_grad_rel": _close(v[1], fp32_grad, 0) for k, v in results.items()})
    return {"ok": all(v < 5e-2 for v in figures.values()), **figures}


def fp16_loss_scale_stop():
    proc = _launch(TINY + ["--fp16", "--train-iters", 5, "--initial-loss-scale", 2**32, "--min-loss-scale", 2**32])
    said = "loss scale has collapsed" in proc.stdout + proc.stderr
    return {"ok": proc.returncode != 0 and said, "exit_code": proc.returncode}


def ring_flash_vs_full():
    """Two CP ranks' ring steps in one process (the blocks each computes, merged as the ring merges them),
    on aten's CUDA flash kernel, against full-sequence SDPA: output and q/k/v gradients, bf16, GQA."""
    from hybrid.parallel.ring_attention import (_step_plan, block_backward, block_forward, block_kernel, local_index,
                                                merge)
    b, heads, groups, s, d, size = 2, 8, 2, 1024, 64, 2
    q = torch.randn(b, heads, s, d, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(b, groups, s, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    grad = torch.randn_like(q)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True, scale=d ** -0.5, enable_gqa=True)
    want.backward(grad)
    kernel = block_kernel(q, None, None)
    outs, grads = torch.empty_like(q), [torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v)]
    for rank in range(size):
        idx = local_index(s, size, rank, DEVICE)
        ql = q[:, :, idx]
        out = torch.zeros(ql.shape, dtype=torch.float32, device=DEVICE)
        lse = torch.full(ql.shape[:-1], float("-inf"), device=DEVICE)
        blocks = []
        for step in range(size):
            source, rows, cols, causal = _step_plan(step, rank, size, s // size // 2)
            src = local_index(s, size, source, DEVICE)
            kl, vl = k[:, :, src][:, :, cols], v[:, :, src][:, :, cols]
            o, l_, state = block_forward(ql[:, :, rows], kl, vl, None, causal, d ** -0.5)
            out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, l_)
            blocks.append((rows, cols, src, kl, vl, causal, state))
        out = out.to(q.dtype)
        outs[:, :, idx] = out
        for rows, cols, src, kl, vl, causal, state in blocks:
            dq, dk, dv = block_backward(grad[:, :, idx][:, :, rows], ql[:, :, rows], kl, vl, out[:, :, rows],
                                        lse[:, :, rows], None, causal, d ** -0.5, state=state)
            grads[0][:, :, idx[rows]] += dq.float()
            grads[1][:, :, src[cols]] += dk.float()
            grads[2][:, :, src[cols]] += dv.float()
    figures = {"kernel": kernel, "output": _close(outs, want.detach(), 0)}
    figures.update({f"grad_{n}": _close(g, t.grad, 0) for n, g, t in zip("qkv", grads, full)})
    return {"ok": kernel == "flash" and all(v < 3e-2 for k_, v in figures.items() if k_ != "kernel"), **figures}


def grouped_gemm_bf16():
    from hybrid.model.moe.experts import GroupedLinear
    counts = torch.tensor([96, 0, 160, 256], device=DEVICE)
    rows = torch.randn(int(counts.sum()), 512, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    weights = [torch.randn(1024, 512, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(4)]
    out = GroupedLinear.apply(rows, counts.cumsum(0).to(torch.int32), *weights)
    out.float().square().mean().backward()
    got = [rows.grad.clone()] + [w.grad.clone() for w in weights]
    for t in [rows, *weights]:
        t.grad = None
    loop = torch.cat([F.linear(part, w) for part, w in zip(rows.split(counts.tolist()), weights)])
    loop.float().square().mean().backward()
    want = [rows.grad] + [w.grad for w in weights]
    figures = {"output": _close(out, loop, 0),
               "grads": max(_close(a, b, 0) for a, b in zip(got, want) if b.abs().max() > 0)}
    return {"ok": all(v < 2e-2 for v in figures.values()), **figures}


def async_save():
    work = tempfile.mkdtemp(prefix="gpu-async-")
    states = {}
    for name, extra in (("sync", []), ("async", ["--async-save"])):
        proc = _launch(TINY + ["--bf16", "--zero-stage", 1, "--train-iters", 2, "--save", f"{work}/{name}",
                               "--save-interval", 2, "--seed", 7] + extra)
        if proc.returncode:
            return {"ok": False, "tail": proc.stderr[-800:]}
        from hybrid.checkpoint.files import load_file
        tag = open(f"{work}/{name}/latest").read().strip()
        states[name] = load_file(f"{work}/{name}/{tag}/mp_rank_00_model_states.pt")["module"]
    equal = all(torch.equal(states["sync"][k], states["async"][k]) for k in states["sync"])
    return {"ok": equal and set(states["sync"]) == set(states["async"]), "tensors": len(states["sync"])}


def pinned_batches():
    from hybrid.data.batches import to_device
    host = torch.randint(0, 100, (4, 128)).pin_memory()
    moved = to_device((host, host), DEVICE)
    return {"ok": all(t.is_cuda for t in moved) and host.is_pinned()}


def compile_vs_eager():
    from hybrid.model.config import ModelConfig
    from hybrid.model.gpt import GPTModel
    config = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=1000,
                         max_position_embeddings=256, hidden_dropout=0.0, attention_dropout=0.0)
    ids = torch.randint(0, 1000, (4, 257), device=DEVICE)
    eager = GPTModel(config).to(DEVICE, torch.bfloat16)
    compiled = GPTModel(config).to(DEVICE, torch.bfloat16)
    compiled.load_state_dict(eager.state_dict())
    for layer in compiled.layers:
        layer.compile()
    losses = []
    for model in (eager, compiled):
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        losses.append(loss.item())
    grad = _close(compiled.layers[0].mlp.fc1.weight.grad, eager.layers[0].mlp.fc1.weight.grad, 0)
    return {"ok": abs(losses[0] - losses[1]) / losses[0] < 1e-2 and grad < 5e-2,
            "loss_rel": abs(losses[0] - losses[1]) / losses[0],
            "grad_rel": grad}


def fp8_gemm():
    import copy
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return {"ok": None, "skipped": "torchao is not installed"}
    from hybrid.parallel.fp8 import Fp8Gemm, Fp8Settings, check_device, fp8_linear
    from hybrid.parallel.groups import ParallelGroups
    check_device(DEVICE)
    figures = {}
    for recipe in ("tensorwise", "rowwise"):
        linear = torch.nn.Linear(1024, 2048, bias=False).to(DEVICE, torch.bfloat16)
        reference = torch.nn.Sequential(copy.deepcopy(linear))
        convert_to_float8_training(reference, config=Float8LinearConfig.from_recipe_name(recipe))
        x = torch.randn(512, 1024, device=DEVICE, dtype=torch.bfloat16)
        want = reference(x)
        got = fp8_linear(x, linear.weight, None, Fp8Gemm(Fp8Settings(recipe), ParallelGroups.single(), "column"))
        figures[recipe] = _close(got, want, 0)
    return {"ok": all(v < 1e-2 for v in figures.values()), **figures}


def activation_offload():
    """--cpu-offloading against the same run without it (full recompute, bf16): the losses equal, the peak
    allocated memory lower by about what the dry run says moves to the host."""
    work = tempfile.mkdtemp(prefix="gpu-offload-")
    model = ["--num-layers", 8, "--hidden-size", 1024, "--num-attention-heads", 16, "--seq-length", 2048,
             "--micro-batch-size", 4, "--global-batch-size", 8, "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", 32000, "--log-interval", 1, "--eval-iters", 0, "--no-progress-bar", "--bf16",
             "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 1,
             "--train-iters", 4, "--seed", 7, "--log-memory-to-tensorboard"]
    runs = {}
    for name, extra in (("plain", []), ("offloaded", ["--cpu-offloading"])):
        proc = _launch(model + extra + ["--log-json", f"{work}/{name}.jsonl"])
        if proc.returncode:
            return {"ok": False, "tail": proc.stderr[-800:]}
        with open(f"{work}/{name}.jsonl") as f:
            runs[name] = [json.loads(line) for line in f if "consumed_samples" in line]
    plain, off = runs["plain"], runs["offloaded"]
    peak = {k: max(r.get("memory_max_allocated_gib", 0.0) for r in v) for k, v in runs.items()}
    speed = {k: v[-1]["tokens_per_s"] for k, v in runs.items()}
    return {"ok": [r["lm_loss"] for r in plain] == [r["lm_loss"] for r in off] and peak["offloaded"] < peak["plain"],
            "peak_gib": peak, "tokens_per_s": speed, "offloaded_over_plain_speed": speed["offloaded"] / speed["plain"]}


def moe_host_syncs():
    """torch's own count of synchronisations in one MoE layer's forward + backward (grouped GEMM, bf16):
    none dropless or padded to capacity, one with an unpadded capacity (as Megatron's); the CPU stand-in
    (checks/host_reads.py's HostReads, tests/test_moe.py) must agree."""
    from checks.moe_dispatch import dispatch_benchmark
    result = dispatch_benchmark(4096, 3, DEVICE, torch.bfloat16)
    expected = {"dropless": 0, "capacity": 1, "capacity_padded": 0}
    reads = {k: v["host_reads"] for k, v in result.items() if isinstance(v, dict)}
    syncs = {k: v["cuda_synchronisations"] for k, v in result.items() if isinstance(v, dict)} if CUDA else expected
    return {"ok": syncs == reads == expected,
            "cuda_synchronisations": syncs, "cpu_stand_in_reads": reads,
            "tokens_per_s": {k: v["tokens_per_s"] for k, v in result.items() if isinstance(v, dict)}}


def gated_delta_net_fla():
    """A Gated DeltaNet layer (Qwen3.5's shapes scaled down, bf16) through flash-linear-attention's chunked kernel
    against its own PyTorch chunked form (the CPU path and reference): output and input gradient, and each one's
    forward + backward time."""
    from hybrid.model import gated_delta_net as gdn
    from hybrid.model.config import ModelConfig
    from hybrid.parallel.groups import ParallelGroups
    if gdn.FLA_CHUNK is None:
        return {"ok": None, "skipped": "flash-linear-attention (fla) is not installed"}
    config = ModelConfig(num_layers=1, hidden_size=1024, num_attention_heads=8, position_embedding_type="rope",
                         normalization="RMSNorm", linear_attention_freq=[1], linear_num_key_heads=8,
                         linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128)
    layer = gdn.GatedDeltaNet(config, ParallelGroups.single(), 0, "layers.0.attention").to(DEVICE, torch.bfloat16)
    x = torch.randn(4096, 2, 1024, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    results, kernel = {}, gdn.FLA_CHUNK
    for name in ("fla", "pytorch"):
        gdn.FLA_CHUNK = kernel if name == "fla" else None
        try:
            x.grad = None
            out = layer(x)
            out.float().square().mean().backward()
            torch.cuda.synchronize()
            start = time.time()
            for _ in range(3):
                layer(x).float().square().mean().backward()
            torch.cuda.synchronize()
            results[name] = (out.detach(), x.grad.detach().clone(), (time.time() - start) / 3)
        finally:
            gdn.FLA_CHUNK = kernel
    out_diff = _close(results["fla"][0], results["pytorch"][0], 0)
    grad_diff = _close(results["fla"][1], results["pytorch"][1], 0)
    return {"ok": out_diff < 2e-2 and grad_diff < 5e-2, "output_difference": out_diff, "grad_difference": grad_diff,
            "fla_s": results["fla"][2], "pytorch_s": results["pytorch"][2],
            "speedup": results["pytorch"][2] / results["fla"][2]}


SINGLE_GPU = [nccl, flash_attn_vs_sdpa, precision, fp16_loss_scale_stop, ring_flash_vs_full, grouped_gemm_bf16,
              async_save, pinned_batches, compile_vs_eager, fp8_gemm, activation_offload, moe_host_syncs,
              gated_delta_net_fla]
# launched layouts on 2 GPUs (NCCL puts one rank per GPU), each against one GPU's losses
MULTI_GPU = {"tp_overlap_nccl": ["--tensor-model-parallel-size", 2, "--sequence-parallel"],
             "ulysses_all_to_all_nccl": ["--ds-sequence-parallel-size", 2],
             "moe_all_to_all_nccl": ["--num-experts", 4, "--disable-bias-linear", "--expert-model-parallel-size", 2]}


def multi_gpu(name: str, flags: list) -> dict:
    work = tempfile.mkdtemp(prefix="gpu-multi-")
    common = TINY + ["--bf16", "--train-iters", 4, "--seed", 7, "--hidden-dropout", 0, "--attention-dropout", 0]
    model = flags[:4] if name == "moe_all_to_all_nccl" else []
    one = _launch(common + model + ["--global-batch-size", 4, "--log-json", f"{work}/one.jsonl"])
    two = _launch(common + flags + ["--log-json", f"{work}/two.jsonl"], nproc=2)
    if one.returncode or two.returncode:
        return {"ok": False, "tail": (one.stderr + two.stderr)[-800:]}
    a, b = _losses(f"{work}/one.jsonl"), _losses(f"{work}/two.jsonl")
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    return {"ok": len(a) == len(b) == 4 and worst < 2e-2, "max_relative_loss_difference": worst}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--only", default=None, help="comma-separated check names")
    a = p.parse_args()
    wanted = set(a.only.split(",")) if a.only else None
    lines = []
    checks = [(fn.__name__, fn) for fn in SINGLE_GPU] + [(name, lambda name=name, f=f: multi_gpu(name, f))
                                                         for name, f in MULTI_GPU.items()]
    for name, fn in checks:
        if wanted and name not in wanted:
            continue
        start = time.time()
        if not CUDA:
            record = {"check": name, "ok": None, "skipped": "needs a CUDA GPU"}
        elif name in MULTI_GPU and torch.cuda.device_count() < 2:
            record = {"check": name, "ok": None, "skipped": "needs 2 or more GPUs (NCCL puts one rank per GPU)"}
        else:
            try:
                record = {"check": name, **fn()}
            except Exception as error:  # a failing path is a line of the report, not the end of it
                record = {"check": name, "ok": False, "error": f"{type(error).__name__}: {str(error)[-600:]}"}
        record["seconds"] = round(time.time() - start, 1)
        lines.append(record)
        print(json.dumps(record), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in lines))
    return 0 if all(r["ok"] in (True, None) for r in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
