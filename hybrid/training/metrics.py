"""One logged iteration's record (Megatron-LM's log line, --log-json, TensorBoard, wandb): throughput,
model TFLOP/s, the optimizer's state, the run's counters, and the MoE layers' losses where there are any."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from hybrid.training.flops import flops_per_iteration


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
