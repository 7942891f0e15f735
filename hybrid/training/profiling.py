"""What a run measures of itself beyond the log line: torch.profiler traces of chosen iterations (--profile,
Megatron-LM's flags) and a CUDA memory snapshot (--record-memory-history). The peak FLOP/s of the logged MFU
sit beside it in hybrid.training.metrics."""

from __future__ import annotations

import importlib
import json
import os

import torch

from hybrid.training.logging import log


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
IMPORTED_DURING_A_RUN = ("torch._inductor.compile_fx", "torch.distributed.pipelining",
                         "deepspeed.module_inject.auto_ep_layer",
                         "deepspeed.runtime.superoffload.superoffload_stage3",
                         "deepspeed.runtime.zero.muon.muon_optimizer",
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
