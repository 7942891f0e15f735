"""One logged iteration's record (Megatron-LM's log line, --log-json, TensorBoard, wandb): throughput, model
TFLOP/s and the model FLOPs utilisation against the accelerator's peak (its table is here), the optimizer's
state, the run's counters, and the MoE layers' losses where there are any."""

from __future__ import annotations

import re
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.training.flops import flops_per_iteration

# dense (no sparsity) tensor-core peak TFLOP/s by GPU name and GEMM precision, from NVIDIA's data sheets;
# the first entry whose words stand in the device name as whole words is taken (so "H100 PCIe" before "H100";
# "L4" is not "NVIDIA L40", "B200" not "NVIDIA GB200": GPUs the table lacks get no MFU unless --peak-tflops)
PEAK_TFLOPS = (
    ("GH200", {"bf16": 989.4, "fp8": 1978.9, "tf32": 494.7}),
    ("H200", {"bf16": 989.4, "fp8": 1978.9, "tf32": 494.7}),
    ("H100 PCIe", {"bf16": 756.0, "fp8": 1513.0, "tf32": 378.0}),
    ("H100 NVL", {"bf16": 835.0, "fp8": 1671.0, "tf32": 417.5}),
    ("H100", {"bf16": 989.4, "fp8": 1978.9, "tf32": 494.7}),
    ("B200", {"bf16": 2250.0, "fp8": 4500.0, "tf32": 1100.0}),
    ("A100", {"bf16": 312.0, "tf32": 156.0}),
    ("L40S", {"bf16": 362.1, "fp8": 733.0, "tf32": 183.0}),
    ("L4", {"bf16": 121.0, "fp8": 242.0, "tf32": 60.0}),
)


def device_peak_tflops(device: torch.device, precision: str, fp8: bool) -> Optional[float]:
    """The GPU's peak TFLOP/s for the run's GEMMs (fp8 when FP8 GEMMs run, bf16 for bf16/fp16, TF32 for
    fp32), or None (a CPU, or a GPU not in the table: --peak-tflops gives it)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    kind = "fp8" if fp8 else "tf32" if precision == "fp32" else "bf16"
    words = re.split(r"[\s_-]+", name.strip())  # "NVIDIA A100-SXM4-80GB" -> NVIDIA, A100, SXM4, 80GB
    for key, peaks in PEAK_TFLOPS:
        wanted = key.split()
        if any(words[i:i + len(wanted)] == wanted for i in range(len(words))):
            return peaks.get(kind)
    return None


def iteration_record(run, engine, device, iteration: int, consumed: int, loss: float, lr: float, seconds: float,
                     batch: int, counters: dict, extra: dict, peak_tflops: Optional[float] = None) -> dict:
    """The record of a log line: `seconds` per iteration, `batch` this iteration's global batch,
    `counters` the run's skipped / nan iteration counts, `extra` further values (MoE, checkpoint stall);
    with `peak_tflops` (the accelerator's), the model FLOPs utilisation `mfu`."""
    grad_norm = engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None
    if isinstance(grad_norm, torch.Tensor):
        grad_norm = grad_norm.item()  # logging only
    scale = getattr(engine.optimizer, "cur_scale", None) or getattr(engine.optimizer, "loss_scale", None) or 1.0
    seq_length = run.training.seq_length
    world = dist.get_world_size() if dist.is_initialized() else 1
    padded = run.model.padded_vocab_size(run.parallel.tensor_parallel)
    flops = flops_per_iteration(run.model, batch, seq_length, padded)
    memory = {}
    if run.logging.log_memory and device.type == "cuda":
        memory = {"memory_allocated_gib": torch.cuda.memory_allocated(device) / 2**30,
                  "memory_max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    tflops = flops / seconds / world / 1e12
    if peak_tflops:
        extra = dict(extra, mfu=tflops / peak_tflops)
    return {**memory, **extra,
            "iteration": iteration, "consumed_samples": consumed, "lm_loss": loss, "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "loss_scale": float(scale), "skipped_iterations": counters["skipped"],
            "nan_iterations": counters["nan"], "tokens_per_s": batch * seq_length / seconds,
            "tflops_per_gpu": tflops, "elapsed_ms_per_iter": seconds * 1000.0,
            "global_batch_size": batch}
