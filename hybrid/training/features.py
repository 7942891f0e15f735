"""The features that act on a run beside the model's forward, as one list: mixture of experts (the routers' fp32
buffers, the auxiliary losses' backward factor, the score-bias update, the logged balance), FP8 (the GPU's FP8 units,
fp32 amax histories, delayed scaling's histories after each step) and profiling (--profile,
--record-memory-history). Each is a set of moments (before the model is built, after the engine, before and after
each iteration), not a model rewrite as torchtitan's ModelConverter: the FP8 linears are built by the model itself
(hybrid.parallel.fp8). The engine and the training loop call every enabled feature at its moments and name none of
them."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from hybrid.config import RunConfig
from hybrid.parallel import fp8
from hybrid.training.moe_hooks import MoEStepHooks, keep_fp32_buffers, routing_shares
from hybrid.training.profiling import StepProfiler


class Feature:
    """A feature's moments in a run; each does nothing unless the feature says otherwise. The class methods run
    while the engine is built, an instance for the training loop (one per run)."""

    @classmethod
    def enabled(cls, run: RunConfig) -> bool:
        return False

    @classmethod
    def before_build(cls, run: RunConfig, device: torch.device) -> None:
        """Before the model is built: whether this accelerator can run the feature."""

    @classmethod
    def after_engine(cls, run: RunConfig, module: nn.Module) -> None:
        """After deepspeed.initialize, which casts every floating buffer to the training precision."""

    def before_iteration(self, done: int, micro_batches: int) -> None:
        """Before the iteration after `done` iterations, of `micro_batches` micro-batches."""

    def after_iteration(self, done: int, stepped: bool) -> None:
        """After that iteration's optimizer step (`stepped` False: DeepSpeed skipped it)."""

    def metrics(self) -> dict:
        """Values for the log line (since the last call)."""
        return {}


class MoEFeature(Feature):
    """The routers' auxiliary losses (and DSA's indexer loss) scaled as the LM loss is, the score biases updated after
    each step, the losses and balance logged (hybrid.training.moe_hooks)."""

    def __init__(self, run: RunConfig, groups, module: nn.Module, device: torch.device):
        self.hooks = MoEStepHooks.of(module, run.parallel.sequence_split)
        # --grpo on an MoE model: every rank joins the routing shares' all-reduce, also one without MoE layers
        self.routing = device if run.training.grpo is not None and run.model.num_experts else None

    @classmethod
    def enabled(cls, run: RunConfig) -> bool:
        return bool(run.model.num_experts or run.model.dsa_indexer_loss_coeff)

    @classmethod
    def after_engine(cls, run: RunConfig, module: nn.Module) -> None:
        keep_fp32_buffers(module)  # DeepSpeed's bf16/fp16 cast took the score bias and counts along

    def before_iteration(self, done: int, micro_batches: int) -> None:
        if self.hooks:
            self.hooks.before(micro_batches)

    def after_iteration(self, done: int, stepped: bool) -> None:
        if self.hooks:
            self.hooks.after()

    def metrics(self) -> dict:
        if self.hooks:
            return self.hooks.metrics(self.routing)
        return routing_shares({}, self.routing) if self.routing is not None else {}


class Fp8Feature(Feature):
    """FP8 GEMMs (hybrid.parallel.fp8): a GPU with FP8 units, amax histories kept in fp32, and with delayed scaling
    each iteration's amaxes entered after its step."""

    def __init__(self, run: RunConfig, groups, module: nn.Module, device: torch.device):
        self.module, self.data_group, self.delayed = module, groups.dp.group, fp8.has_delayed(module)

    @classmethod
    def enabled(cls, run: RunConfig) -> bool:
        return run.model.fp8_recipe is not None

    @classmethod
    def before_build(cls, run: RunConfig, device: torch.device) -> None:
        fp8.check_device(device)

    @classmethod
    def after_engine(cls, run: RunConfig, module: nn.Module) -> None:
        fp8.keep_fp32_histories(module)

    def after_iteration(self, done: int, stepped: bool) -> None:
        if self.delayed:  # the iteration's amaxes into the histories (not a skipped step's)
            fp8.end_iteration(self.module, self.data_group, stepped=stepped)


class ProfilerFeature(Feature):
    """--profile's torch.profiler trace of the chosen iterations, --record-memory-history's CUDA snapshot
    (hybrid.training.profiling)."""

    def __init__(self, run: RunConfig, groups, module: nn.Module, device: torch.device):
        self.profiler = StepProfiler(run.logging.profile, dist.get_rank() if dist.is_initialized() else 0, device)

    @classmethod
    def enabled(cls, run: RunConfig) -> bool:
        return run.logging.profile is not None

    def before_iteration(self, done: int, micro_batches: int) -> None:
        self.profiler.before(done)

    def after_iteration(self, done: int, stepped: bool) -> None:
        self.profiler.after(done + 1)


# the loop calls them in this order before an iteration and in reverse after it: the profiler innermost, the
# score-bias update before delayed scaling's histories
FEATURES = (Fp8Feature, MoEFeature, ProfilerFeature)


def before_build(run: RunConfig, device: torch.device) -> None:
    for feature in FEATURES:
        if feature.enabled(run):
            feature.before_build(run, device)


def after_engine(run: RunConfig, module: nn.Module) -> None:
    for feature in FEATURES:
        if feature.enabled(run):
            feature.after_engine(run, module)


def loop_features(run: RunConfig, groups, module: nn.Module, device: torch.device) -> list:
    """The training loop's features of this run, in FEATURES' order."""
    return [feature(run, groups, module, device) for feature in FEATURES if feature.enabled(run)]
