"""What a run measures of itself beyond the log line: the accelerator's peak FLOP/s (for the logged MFU),
torch.profiler traces of chosen iterations (--profile, Megatron-LM's flags) and a CUDA memory snapshot
(--record-memory-history)."""

from __future__ import annotations

import importlib
import json
import os
import re
from typing import Optional

import torch

from hybrid.training.logging import log

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


class StepProfiler:
    """--profile: torch.profiler over the iterations after `start` up to `end` done (Megatron-LM's
    numbering), its trace written as a Chrome / Perfetto JSON per profiled rank (and the CUDA profiler range
    opened, for nsys); --record-memory-history: CUDA allocations recorded from the start, the snapshot
    written once `end` iterations are done."""

    def __init__(self, config, rank: int, device: torch.device):
        self.config, self.rank, self.device = config, rank, device
        self.active = config is not None and rank in config.ranks
        self.profiler = None
        if self.active and config.memory_snapshot:
            if device.type == "cuda":
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            else:
                log("--record-memory-history: no CUDA device here, so no memory snapshot (it records CUDA "
                    "allocations)")

    def before(self, done: int) -> None:
        """Before the iteration after `done` iterations."""
        if not self.active or not self.config.trace or done != self.config.steps[0]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.profiler.start()
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self.profiler.start()

    def after(self, done: int) -> None:
        """After an iteration, `done` iterations done."""
        if not self.active or done != self.config.steps[1]:
            return
        os.makedirs(self.config.directory, exist_ok=True)
        if self.profiler is not None:
            self.profiler.stop()
            if self.device.type == "cuda":
                torch.cuda.profiler.stop()
            start, end = self.config.steps
            path = os.path.join(self.config.directory, f"trace_rank{self.rank}_iterations{start + 1}-{end}.json")
            self.profiler.export_chrome_trace(path)
            self.profiler = None
            log(f"--profile: wrote {path}", all_ranks=True)
        if self.config.memory_snapshot and self.device.type == "cuda":
            path = self.config.memory_snapshot + (f".rank{self.rank}" if self.rank else "")
            torch.cuda.memory._dump_snapshot(path)
            torch.cuda.memory._record_memory_history(enabled=None)
            log(f"--record-memory-history: wrote {path} (open it at pytorch.org/memory_viz)", all_ranks=True)


MEMORY_REPORT = "HYBRID_MEMORY_REPORT"  # a file: each rank appends its peak resident memory of the run (benchmarks)
# what a run imports after its process groups exist (deepspeed.initialize's compile, AutoEP and optimizer modules,
# the pipeline schedules): about 0.11 GiB of code on CPU, imported before the baseline so the report counts data
IMPORTED_DURING_A_RUN = ("torch._inductor.compile_fx", "torch.distributed.pipelining", "deepspeed.module_inject.auto_ep_layer",
                         "deepspeed.runtime.superoffload.superoffload_stage3", "deepspeed.runtime.zero.muon.muon_optimizer",
                         "deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.stage_1_and_2")


class PeakResidentMemory:
    """The peak resident memory a run adds to its process on a host (benchmarks/bench_memory.py): Linux's
    peak-RSS counter is reset once imports (those the run makes later too: IMPORTED_DURING_A_RUN) and process
    groups exist (`/proc/self/clear_refs`, "5"), and at the end
    the peak over that baseline is appended as JSON to the file named by $HYBRID_MEMORY_REPORT. Nothing happens
    without that variable."""

    def __init__(self):
        self.path = os.environ.get(MEMORY_REPORT)
        self.baseline = 0
        if self.path:
            for name in IMPORTED_DURING_A_RUN:
                try:
                    importlib.import_module(name)
                except ImportError:
                    pass
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.baseline = self._status("VmRSS")

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    def report(self, rank: int, stage: int = 0) -> None:
        if not self.path:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"rank": rank, "stage": stage, "peak_bytes": self._status("VmHWM") - self.baseline})
                    + "\n")
