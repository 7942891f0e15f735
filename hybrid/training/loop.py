"""The training run: flags -> configs -> topology -> model -> DeepSpeed engine -> iterations."""

from __future__ import annotations

import logging
import math
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.config import RunConfig, build_parser, build_run_config, config_summary, tokenizer_kwargs
from hybrid.errors import ConfigError
from hybrid.training.logging import MetricsLogger, Timer, log


def _dp_mean(value: torch.Tensor, topology) -> float:
    """Mean of a per-DP-rank scalar over the DP group."""
    value = value.detach().float().reshape(1).clone()
    if topology.dp_world_size > 1:
        dist.all_reduce(value, group=topology.dp_group)
        value /= topology.dp_world_size
    return value.item()


def _pipeline_batches(batches):
    """(ids, labels, mask) -> DeepSpeed pipeline items (inputs, labels)."""
    for ids, labels, mask in batches:
        yield ids, (labels, mask)


class Trainer:
    """Runs iterations on a DeepSpeed engine (plain or pipeline) and reports Megatron-style metrics."""

    def __init__(self, run: RunConfig, topology, engine, datasets):
        self.run, self.topology, self.engine = run, topology, engine
        self.train_ds, self.valid_ds, _ = datasets
        self.pipeline = run.pipeline_parallel > 1
        self.skipped = 0
        self.nan_iterations = 0
        self.consumed_valid = 0

    def _batches(self, dataset, consumed, wrap=False):
        from hybrid.training.batches import micro_batches
        t = self.run.train
        it = micro_batches(dataset, consumed, t.micro_batch_size, self.topology.dp_rank,
                           self.topology.dp_world_size, t.num_workers, wrap)
        return _pipeline_batches(it) if self.pipeline else it

    def train_step(self, batches) -> float:
        """One iteration (grad-accumulation micro-batches and one optimizer step); mean loss over DP."""
        if self.pipeline:
            return float(self.engine.train_batch(data_iter=batches).item())
        losses = []
        for _ in range(self.run.train.grad_acc_steps):
            ids, labels, mask = next(batches)
            loss = self.engine(ids, labels, mask)
            self.engine.backward(loss)
            self.engine.step()
            losses.append(loss.detach())
        return _dp_mean(torch.stack(losses).mean(), self.topology)

    @torch.no_grad()
    def evaluate(self, iteration: int, logger: MetricsLogger) -> Optional[float]:
        t = self.run.train
        if self.valid_ds is None or t.eval_iters <= 0:
            return None
        self.engine.eval()
        batches = self._batches(self.valid_ds, self.consumed_valid, wrap=True)
        losses = []
        for _ in range(t.eval_iters):
            if self.pipeline:
                losses.append(float(self.engine.eval_batch(data_iter=batches).item()))
            else:
                step = [self.engine(*next(batches)) for _ in range(t.grad_acc_steps)]
                losses.append(_dp_mean(torch.stack(step).mean(), self.topology))
        self.consumed_valid += t.eval_iters * t.global_batch_size
        self.engine.train()
        loss = sum(losses) / len(losses)
        logger.evaluation({"iteration": iteration, "lm_loss": loss, "ppl": math.exp(min(20.0, loss))})
        return loss

    def _metrics(self, iteration, consumed, loss, lr, seconds) -> dict:
        from hybrid.training.flops import flops_per_iteration
        t, e = self.run.train, self.engine
        grad_norm = e.get_global_grad_norm() if hasattr(e, "get_global_grad_norm") else None
        scale = getattr(e.optimizer, "cur_scale", None) or getattr(e.optimizer, "loss_scale", None) or 1.0
        tokens = t.global_batch_size * t.seq_length
        padded = self.run.model.padded_vocab_size(self.run.tensor_parallel)
        world = dist.get_world_size() if dist.is_initialized() else 1
        flops = flops_per_iteration(self.run.model, t.global_batch_size, t.seq_length, padded)
        return {
            "iteration": iteration, "consumed_samples": consumed, "lm_loss": loss, "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "loss_scale": float(scale), "skipped_iterations": self.skipped, "nan_iterations": self.nan_iterations,
            "tokens_per_s": tokens / seconds, "tflops_per_gpu": flops / seconds / world / 1e12,
            "elapsed_ms_per_iter": seconds * 1000.0, "global_batch_size": t.global_batch_size,
        }

    def train(self, iteration: int, consumed: int) -> int:
        from hybrid.training import checkpoint
        t = self.run.train
        logger = MetricsLogger(t.train_iters, t.log_json, t.tensorboard_dir, t.wandb_project, t.wandb_exp_name,
                               config_summary(self.run), t.progress_bar, iteration)
        self.consumed_valid = (iteration // t.eval_interval) * t.eval_iters * t.global_batch_size \
            if t.eval_interval else 0
        batches = self._batches(self.train_ds, consumed)
        timer, last_saved = Timer(), None
        log(f"training from iteration {iteration} to {t.train_iters} "
            f"(TP={self.run.tensor_parallel}, PP={self.run.pipeline_parallel}, DP={self.run.data_parallel}, "
            f"ZeRO-{self.run.zero_stage}, {t.precision})")
        try:
            while iteration < t.train_iters:
                lr = self.engine.get_lr()[0]
                skipped_before = getattr(self.engine, "skipped_steps", 0)
                loss = self.train_step(batches)
                iteration += 1
                consumed += t.global_batch_size
                self.skipped += getattr(self.engine, "skipped_steps", 0) - skipped_before
                if not math.isfinite(loss):
                    self.nan_iterations += 1
                metrics = self._metrics(iteration, consumed, loss, lr, timer.lap())
                logger.iteration(metrics, write_line=iteration % t.log_interval == 0 or iteration == t.train_iters)
                if t.eval_interval and iteration % t.eval_interval == 0:
                    self.evaluate(iteration, logger)
                if t.save and t.save_interval and iteration % t.save_interval == 0:
                    checkpoint.save(self.engine, self.run, t.save, iteration, consumed)
                    last_saved = iteration
                if t.exit_interval and iteration % t.exit_interval == 0:
                    if t.save and last_saved != iteration:
                        checkpoint.save(self.engine, self.run, t.save, iteration, consumed)
                    log(f"exiting at iteration {iteration} (--exit-interval {t.exit_interval})")
                    return iteration
                timer.lap()  # evaluation and saving are not iteration time
            if not (t.eval_interval and iteration % t.eval_interval == 0):
                self.evaluate(iteration, logger)
            if t.save and last_saved != iteration:
                checkpoint.save(self.engine, self.run, t.save, iteration, consumed)
        finally:
            logger.close()
        return iteration


def _quiet_deepspeed() -> None:
    from deepspeed.utils import logger as ds_logger
    if not os.environ.get("HYBRID_VERBOSE"):
        ds_logger.setLevel(logging.WARNING)


def run_training(argv: Optional[list[str]] = None) -> int:
    """Parse flags, build everything, train. Returns the process exit code."""
    args = build_parser().parse_args(argv)
    from hybrid.data.tokenizer import build_tokenizer
    tokenizer = build_tokenizer(**tokenizer_kwargs(args))
    # Every flag is checked before DeepSpeed is imported or a process group exists.
    run = build_run_config(args, int(os.environ.get("WORLD_SIZE", "1")), tokenizer.vocab_size)
    from hybrid.distributed import init_distributed
    init_distributed(args.distributed_timeout_minutes)
    _quiet_deepspeed()
    from hybrid.parallel.random import model_parallel_seed
    from hybrid.topology import Topology
    from hybrid.training import checkpoint
    from hybrid.training.batches import build_datasets
    from hybrid.training.engine import build_engine
    topology = Topology(run.tensor_parallel, run.pipeline_parallel)
    model_parallel_seed(run.train.seed, topology.tp_rank)
    datasets = build_datasets(run.train, tokenizer.vocab_size)
    engine, _ = build_engine(run, topology)
    iteration, consumed = checkpoint.load(engine, run) if run.train.load else (0, 0)
    Trainer(run, topology, engine, datasets).train(iteration, consumed)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: a user's mistake ends in one message and exit code 2, not a traceback."""
    try:
        code = run_training(argv)
    except ConfigError as e:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    if dist.is_initialized():
        dist.destroy_process_group()
    return code
