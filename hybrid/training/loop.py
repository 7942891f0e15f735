"""The training loop: iterations on a DeepSpeed engine, with evaluation, saves, the health checks and
Megatron-style log lines (hybrid.training.run builds what it runs on)."""

from __future__ import annotations

import math
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.config import RunConfig, config_summary
from hybrid.data.batches import Collator, micro_batches
from hybrid.errors import ConfigError
from hybrid.model.objectives import objective_for
from hybrid.training.features import loop_features
from hybrid.training.engine import units_per_step
from hybrid.training.health import HealthCheck
from hybrid.training.logging import MetricsLogger, Timer, log
from hybrid.training.metrics import device_peak_tflops, iteration_record
from hybrid.training.plots import reward_plot
from hybrid.training.reduction import reduce_interval
from hybrid.training.saving import CheckpointSaver
from hybrid.training.runtime import build_runtime


class Trainer:
    """Runs iterations on a DeepSpeed engine (plain or pipeline) and reports Megatron-style metrics.

    Per-iteration losses stay on the device; the host waits for them only at --log-interval
    (and at evaluation/save), so the accelerator is never idle between iterations.
    """

    def __init__(self, run: RunConfig, groups, engine, datasets, eod_token: Optional[int] = None, reference=None,
                 prompts=None):
        self.run, self.groups, self.engine = run, groups, engine
        self.prompts, self.reference = prompts, reference  # --grpo: (prompts, tokenizer); the KL's frozen model
        self.train_ds, self.valid_ds, _ = datasets
        self.collator = Collator(eod_token, run.data.eod_mask_loss)
        self.device = torch.device(engine.device)
        # what the run trains for (LM, SFT, DPO), handed to the one runtime of every layout and schedule
        self.objective = objective_for(run.training, run.model, groups, None if run.training.grpo else reference)
        self.step = build_runtime(run, groups, engine, self.objective)
        self.features = loop_features(run, groups, engine.module, self.device)  # MoE, FP8, profiling
        self.peak_tflops = run.logging.peak_tflops or device_peak_tflops(
            self.device, run.training.precision, run.model.fp8_recipe is not None)
        self.saver = CheckpointSaver(engine, run, groups, self.device)
        self.health = HealthCheck(run, engine, self.step, self.saver)
        self.skipped = 0
        self.rewards: list = []  # --grpo: (iteration, mean, std, {column: mean}) at each log line
        self.consumed_valid = 0
        self.current_batch = None if run.training.rampup else run.training.global_batch_size
        self.start_time = time.time()

    def _rollout(self, consumed: int):
        """--grpo: micro-batches of the engine's own completions (hybrid.training.rollout)."""
        from hybrid.training.rollout import Rollout  # not at the top: it imports transformers' sampling warpers
        prompts, tokenizer = self.prompts
        tied = getattr(self.step, "tied", None)
        return Rollout(self.run, self.groups, self.engine, prompts, tokenizer, consumed, self.objective.stats,
                       before_generate=tied.sync_once if tied is not None else None, reference=self.reference)

    def _batches(self, dataset, consumed, wrap=False):
        # CP ranks read the same samples (each takes its chunks of them): the sampler's ranks are DP's
        return micro_batches(dataset, consumed, self.run.training.micro_batch_size, self.groups.dp.rank,
                             self.groups.dp.size, self.run.data.num_workers, self.device, wrap, self.collator)

    @torch.no_grad()
    def evaluate(self, iteration: int, logger: MetricsLogger) -> Optional[float]:
        t = self.run.training
        if self.valid_ds is None or t.eval_iters <= 0:
            return None
        self.engine.eval()
        batches = self._batches(self.valid_ds, self.consumed_valid, wrap=True)
        pending = self.objective.discard_pending()  # the log line's statistics are the training interval's
        losses = [self.step.evaluate(batches) for _ in range(t.eval_iters)]
        self.objective.discard_pending()
        self.objective.restore_pending(pending)
        self.consumed_valid += t.eval_iters * t.global_batch_size
        self.engine.train()
        values = reduce_interval(self.step, losses)
        loss = sum(values) / len(values)
        logger.evaluation({"iteration": iteration, "lm_loss": loss, "ppl": math.exp(min(20.0, loss))})
        return loss

    def _batch_size_for(self, consumed: int) -> int:
        """This iteration's global batch (--rampup-batch-size), applied to the engine and schedule."""
        t = self.run.training
        size = t.rampup.batch_size(consumed, t.global_batch_size) if t.rampup else t.global_batch_size
        if size != self.current_batch:
            # more or fewer micro-batches, same micro-batch size (DeepSpeed's batch counts CP ranks)
            self.engine.set_train_batch_size(size * self.run.parallel.sequence_split)
            self.step.micro_batches = self.engine.gradient_accumulation_steps()
            self.engine.lr_scheduler.units_per_step = units_per_step(size, t.seq_length, self.run.optimizer.lr_unit)
            if self.current_batch is not None:
                log(f"global batch size {self.current_batch} -> {size} after {consumed} samples")
            self.current_batch = size
        return size

    def _log(self, logger, pending, iteration, consumed, seconds) -> None:
        """Reduce the interval's losses (the one host sync) and write the log record; `seconds` (the
        interval's time) is read by the caller after the sync, so it holds all the interval's device work."""
        values = self.health.checked_losses(pending)
        self.health.check_loss_scale(self.skipped)
        per_iteration = seconds() / len(pending)
        extra = {}  # the features' (this rank's MoE layers, per micro-batch)
        for feature in self.features:
            extra.update(feature.metrics())
        # the objective's own (--dpo: rewards, margin and accuracy over the interval's pairs, every DP rank's)
        extra.update(self.objective.metrics(self.groups, self.device))
        stall = self.saver.take_stall()
        if stall:  # the time the training thread spent saving since the last record (not in the iteration time)
            extra["checkpoint_stall_s"] = stall
        batch = self.current_batch or self.run.training.global_batch_size
        counters = {"skipped": self.skipped, "nan": self.health.nan_iterations}
        record = iteration_record(self.run, self.engine, self.device, iteration, consumed, sum(values) / len(values),
                                  pending[-1][1], per_iteration, batch, counters, extra, self.peak_tflops)
        logger.iteration(record, write_line=True)
        if "reward_mean" in record:  # --grpo: the reward's curve (hybrid.training.plots)
            columns = {key[len("rewards/"):-len("/mean")]: value for key, value in record.items()
                       if key.startswith("rewards/") and key.endswith("/mean")}
            self.rewards.append((iteration, record["reward_mean"], record.get("reward_std", 0.0), columns))
        self.saver.finish(blocking=False)  # --async-save: a checkpoint whose writes are done is completed here

    def _save(self, pending, iteration: int, consumed: int) -> None:
        """A checkpoint, never of weights reached through a non-finite loss or gradient: the iterations not
        yet logged are checked first (every rank saves at the same iteration, so all take part)."""
        if pending and self.run.training.check_nan:
            self.health.checked_losses(pending)
        self.saver.save(iteration, consumed)

    def _iteration(self, batches, iteration: int) -> tuple:
        """One training iteration; its (loss, lr, gradient norm finite, iteration number), on the device."""
        lr = self.engine.get_lr()[0]
        skipped_before = getattr(self.engine, "skipped_steps", 0)
        for feature in self.features:
            feature.before_iteration(iteration, self.step.micro_batches)
        record = (self.step.train(batches), lr, self.health.norm_finite(), iteration + 1)
        skipped = getattr(self.engine, "skipped_steps", 0) - skipped_before  # a host int DeepSpeed keeps
        for feature in reversed(self.features):
            feature.after_iteration(iteration, stepped=not skipped)
        self.skipped += skipped
        return record

    def train(self, iteration: int, consumed: int) -> int:
        t, c, run = self.run.training, self.run.checkpoint, self.run
        logger = MetricsLogger(t.train_iters, run.logging.log_json, run.logging.tensorboard_dir,
                               run.logging.wandb_project, run.logging.wandb_exp_name, config_summary(run),
                               run.logging.progress_bar, iteration, run.logging.wandb_save_dir)
        self.consumed_valid = (iteration // t.eval_interval) * t.eval_iters * t.global_batch_size \
            if t.eval_interval else 0
        if iteration >= t.train_iters and c.load:  # a restart after the last checkpoint: nothing to redo
            log(f"nothing to train: the checkpoint loaded from {c.load} is at iteration {iteration}, the end of the "
                f"run (--train-iters {t.train_iters}); no evaluation, no save")
            logger.close()
            return iteration
        if not self.prompts:
            check_enough_samples(run, iteration, consumed, len(self.train_ds))
        batches = self._rollout(consumed) if self.prompts else self._batches(self.train_ds, consumed)
        timer, last_saved, pending, interval = Timer(), None, [], [0.0]
        log(f"training from iteration {iteration} to {t.train_iters} ({describe_layout(run)})")

        def log_pending():
            self._log(logger, pending, iteration, consumed, lambda: interval[0] + timer.lap())
            pending.clear()
            interval[0] = 0.0
        try:
            while iteration < t.train_iters:
                batch_size = self._batch_size_for(consumed)
                pending.append(self._iteration(batches, iteration))
                iteration, consumed = iteration + 1, consumed + batch_size
                logger.advance()
                if iteration % run.logging.log_interval == 0 or iteration == t.train_iters:
                    log_pending()
                else:
                    interval[0] += timer.lap()
                if t.eval_interval and iteration % t.eval_interval == 0:
                    self.evaluate(iteration, logger)
                if c.save and c.save_interval and iteration % c.save_interval == 0:
                    self._save(pending, iteration, consumed)
                    last_saved = iteration
                out_of_time = out_of_time_everywhere(self.start_time, t.exit_duration_in_mins, self.device)
                if out_of_time or (t.exit_interval and iteration % t.exit_interval == 0):
                    if pending:
                        log_pending()
                    if c.save and last_saved != iteration:
                        self._save(pending, iteration, consumed)
                    self.saver.finish()
                    log(f"exiting at iteration {iteration} (" + (f"--exit-duration-in-mins {t.exit_duration_in_mins}"
                        if out_of_time else f"--exit-interval {t.exit_interval}") + ")")
                    return iteration
                timer.lap()  # evaluation and saving are not iteration time
            if not (t.eval_interval and iteration % t.eval_interval == 0):
                self.evaluate(iteration, logger)
            if c.save and last_saved != iteration:
                self._save(pending, iteration, consumed)
            self.saver.finish()
        finally:
            if self.rewards and logger.active and c.save:  # beside the checkpoints, however the loop ends
                reward_plot(self.rewards, os.path.join(c.save, "reward.png"))
            logger.close()
        return iteration


def out_of_time_everywhere(start_time: float, minutes: Optional[float], device) -> bool:
    """--exit-duration-in-mins: every rank stops at the same iteration (MAX over ranks)."""
    if not minutes:
        return False
    done = torch.tensor([float(time.time() - start_time > minutes * 60.0)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
    return bool(done.item())


def describe_layout(run: RunConfig) -> str:
    """The log's summary of the layout: TP, PP (and its schedule), DP, ZeRO stage, precision."""
    p, schedule = run.parallel, ""
    if p.pipeline_parallel > 1:
        virtual = run.pipeline.virtual_stages
        schedule = f" {run.pipeline.schedule}" + (f", {virtual} virtual stages per rank" if virtual > 1 else "")
    return (f"TP={p.tensor_parallel}, PP={p.pipeline_parallel}{schedule}, DP={p.data_parallel}, "
            f"ZeRO-{run.zero_stage}, {run.training.precision}")


def check_enough_samples(run: RunConfig, iteration: int, consumed: int, available: int) -> None:
    """A resumed run whose training data ends before --train-iters (the checkpoint consumed more samples than this
    run's plan has room for, e.g. saved with a larger --global-batch-size) stops with one message before its first
    iteration, as Megatron-LM's sampler refuses it, not midway in an exhausted iterator (a StopIteration)."""
    t = run.training
    needed = consumed
    if t.rampup:
        for _ in range(iteration, t.train_iters):
            needed += t.rampup.batch_size(needed, t.global_batch_size)
    else:
        needed += max(t.train_iters - iteration, 0) * t.global_batch_size
    if needed > available:
        where = f"--load {run.checkpoint.load}: the checkpoint" if run.checkpoint.load else "the run"
        raise ConfigError(f"{where} has consumed {consumed} samples at iteration {iteration}; reaching --train-iters "
                          f"{t.train_iters} from there needs {needed} samples, and this run's training data holds "
                          f"{available} (--train-iters x --global-batch-size {t.global_batch_size}, or "
                          f"--train-samples). Give a longer run (--train-iters or --train-samples), or add --finetune "
                          f"to start the data from its first sample.")
