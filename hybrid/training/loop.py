"""The training run: flags -> configs -> topology -> model -> DeepSpeed engine -> iterations."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.config import RunConfig, build_run_config, config_summary, tokenizer_kwargs
from hybrid.flags import build_parser
from hybrid.errors import ConfigError
from hybrid.training.logging import MetricsLogger, Timer, log


class Trainer:
    """Runs iterations on a DeepSpeed engine (plain or pipeline) and reports Megatron-style metrics.

    Per-iteration losses stay on the device; the host waits for them only at --log-interval
    (and at evaluation/save), so the accelerator is never idle between iterations.
    """

    def __init__(self, run: RunConfig, topology, engine, datasets, eod_token: Optional[int] = None):
        from hybrid.training.batches import Collator
        from hybrid.training.steps import build_step
        self.run, self.topology, self.engine = run, topology, engine
        self.train_ds, self.valid_ds, _ = datasets
        self.collator = Collator(eod_token, run.train.eod_mask_loss)
        self.device = torch.device(engine.device)
        # chosen once: DeepSpeed's pipeline schedule, a torch.distributed.pipelining schedule, or
        # micro-steps on the plain engine; all take the same (ids, labels) micro-batches
        self.step = build_step(run, topology, engine)
        from hybrid.model.moe import MoEStepHooks
        self.moe = MoEStepHooks.of(engine.module, run.sequence_split) if run.model.num_experts else None
        self.skipped = 0
        self.nan_iterations = 0
        self.consumed_valid = 0
        self.current_batch = None if run.train.rampup else run.train.global_batch_size
        self.start_time = time.time()
        self.last_saved_tag = None  # the newest checkpoint this run saved (named when it stops on a NaN)
        self.unfinished_save = None  # --async-save: the tag whose files are being written
        self.save_stall_seconds = 0.0  # training-thread time spent saving, logged with the next record
        self._skipped_at_last_log = 0

    def _schedule_note(self) -> str:
        run = self.run
        if run.pipeline_parallel == 1:
            return ""
        virtual = f", {run.virtual_stages} virtual stages per rank" if run.virtual_stages > 1 else ""
        return f" {run.pipeline_schedule}{virtual}"

    def _batches(self, dataset, consumed, wrap=False):
        from hybrid.training.batches import micro_batches
        t = self.run.train
        # CP ranks read the same samples (each takes its chunks of them): the sampler's ranks are DP's
        return micro_batches(dataset, consumed, t.micro_batch_size, self.topology.data_rank,
                             self.topology.data_world_size, t.num_workers, self.device, wrap, self.collator)

    def _interval_losses(self, losses: list, norm_flags: Optional[list] = None) -> list[float]:
        """The pending per-iteration losses as DP means (and, given, their gradient norms' finiteness):
        one collective and one host sync."""
        stacked = self.step.reduce(torch.stack([loss.float().reshape(()) for loss in losses]))
        if norm_flags is not None:  # global norms: the same on every rank, no reduction
            flags = torch.stack([torch.as_tensor(f, device=stacked.device).float().reshape(()) for f in norm_flags])
            stacked = torch.cat([stacked, flags])
        return stacked.tolist()

    def _norm_finite(self):
        """Whether this iteration's gradient norm is finite, on the device (True where DeepSpeed keeps no
        norm, and under fp16, whose overflow steps DeepSpeed's loss scaling skips)."""
        if not self.run.train.check_nan or self.run.train.precision == "fp16":
            return True
        norm = self.engine.get_global_grad_norm() if hasattr(self.engine, "get_global_grad_norm") else None
        if norm is None:
            return True
        return torch.isfinite(norm) if torch.is_tensor(norm) else math.isfinite(float(norm))

    def _check_finite(self, pending) -> list[float]:
        """--check-for-nan-in-loss-and-grad, at a log or before a save: the first iteration whose loss or
        gradient norm is not finite stops the run (every rank reads the same reduced values). Returns the
        losses."""
        values = self._interval_losses([p[0] for p in pending], [p[2] for p in pending])
        losses, norms_ok = values[:len(pending)], values[len(pending):]
        if not self.run.train.check_nan:
            return losses
        for (_, _, _, iteration), loss, norm_ok in zip(pending, losses, norms_ok):
            if not math.isfinite(loss) or not norm_ok:
                self._stop_non_finite(iteration, loss if not math.isfinite(loss) else None)
        return losses

    def _writes_done_everywhere(self) -> bool:
        writer = getattr(self.engine, "checkpoint_engine", None)
        pending = torch.tensor([0.0 if not hasattr(writer, "done") or writer.done() else 1.0], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(pending, op=dist.ReduceOp.MAX)
        return pending.item() == 0.0

    def _stop_non_finite(self, iteration: int, loss: Optional[float]) -> None:
        from hybrid.errors import NonFiniteError
        self._finish_save()  # a checkpoint being written was checked finite when it was taken
        t = self.run.train
        what = f"the loss is {loss}" if loss is not None else "the gradient norm is not finite"
        last = (f"the last good checkpoint is {t.save}/{self.last_saved_tag}" if self.last_saved_tag
                else "no checkpoint was saved by this run" + (f" (it started from --load {t.load})" if t.load else ""))
        raise NonFiniteError(
            f"iteration {iteration}: {what}; stopping (--check-for-nan-in-loss-and-grad) with nothing saved after it. "
            f"{last[0].upper() + last[1:]}. Try a lower --lr (now {t.lr:g}), a longer warmup (--lr-warmup-iters)"
            f"{'' if t.clip_grad else ', --clip-grad 1.0'}{', --bf16 instead of --fp16' if t.precision == 'fp16' else ''}"
            f", or look at the data of that iteration; resume from that checkpoint with --load. To train on "
            f"regardless, add --no-check-for-nan-in-loss-and-grad.")

    def _check_loss_scale(self) -> None:
        """fp16: DeepSpeed skips overflowing steps and lowers the scale; once the scale sits at its minimum
        and steps are still skipped, the run has collapsed: stop."""
        t = self.run.train
        if not t.check_nan or t.precision != "fp16":
            return
        scale = getattr(self.engine.optimizer, "cur_scale", None)
        minimum = float((self.run.ds_config.get("fp16") or {}).get("min_loss_scale", 1.0))
        if scale is not None and float(scale) <= minimum and self.skipped > self._skipped_at_last_log:
            from hybrid.errors import NonFiniteError
            raise NonFiniteError(f"the fp16 loss scale has collapsed to its minimum ({float(scale):g}, min_loss_scale) "
                                 f"and steps are still skipped for overflow; stopping. Try --bf16, a lower --lr, "
                                 f"or --clip-grad 1.0.")
        self._skipped_at_last_log = self.skipped

    @torch.no_grad()
    def evaluate(self, iteration: int, logger: MetricsLogger) -> Optional[float]:
        t = self.run.train
        if self.valid_ds is None or t.eval_iters <= 0:
            return None
        self.engine.eval()
        batches = self._batches(self.valid_ds, self.consumed_valid, wrap=True)
        losses = [self.step.evaluate(batches) for _ in range(t.eval_iters)]
        self.consumed_valid += t.eval_iters * t.global_batch_size
        self.engine.train()
        values = self._interval_losses(losses)
        loss = sum(values) / len(values)
        logger.evaluation({"iteration": iteration, "lm_loss": loss, "ppl": math.exp(min(20.0, loss))})
        return loss

    def _batch_size_for(self, consumed: int) -> int:
        """This iteration's global batch (--rampup-batch-size), applied to the engine and schedule."""
        t = self.run.train
        size = t.rampup.batch_size(consumed, t.global_batch_size) if t.rampup else t.global_batch_size
        if size != self.current_batch:
            from hybrid.training.engine import units_per_step
            # more or fewer micro-batches, same micro-batch size (DeepSpeed's batch counts CP ranks)
            self.engine.set_train_batch_size(size * self.run.sequence_split)
            self.engine.lr_scheduler.units_per_step = units_per_step(size, t.seq_length, t.lr_unit)
            if self.current_batch is not None:
                log(f"global batch size {self.current_batch} -> {size} after {consumed} samples")
            self.current_batch = size
        return size

    def _out_of_time(self) -> bool:
        """--exit-duration-in-mins: every rank stops at the same iteration (MAX over ranks)."""
        minutes = self.run.train.exit_duration_in_mins
        if not minutes:
            return False
        done = torch.tensor([float(time.time() - self.start_time > minutes * 60.0)], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(done, op=dist.ReduceOp.MAX)
        return bool(done.item())

    def _metrics(self, iteration, consumed, loss, lr, seconds) -> dict:
        from hybrid.training.flops import flops_per_iteration
        t, e = self.run.train, self.engine
        grad_norm = e.get_global_grad_norm() if hasattr(e, "get_global_grad_norm") else None
        if isinstance(grad_norm, torch.Tensor):
            grad_norm = grad_norm.item()  # logging only
        scale = getattr(e.optimizer, "cur_scale", None) or getattr(e.optimizer, "loss_scale", None) or 1.0
        batch = self.current_batch or t.global_batch_size
        tokens = batch * t.seq_length
        padded = self.run.model.padded_vocab_size(self.run.tensor_parallel)
        world = dist.get_world_size() if dist.is_initialized() else 1
        flops = flops_per_iteration(self.run.model, batch, t.seq_length, padded)
        memory = {}
        if t.log_memory and self.device.type == "cuda":
            memory = {"memory_allocated_gib": torch.cuda.memory_allocated(self.device) / 2**30,
                      "memory_max_allocated_gib": torch.cuda.max_memory_allocated(self.device) / 2**30}
        if self.moe:  # this rank's MoE layers: auxiliary losses per micro-batch, the worst expert imbalance
            memory.update(self.moe.metrics())
        stall, self.save_stall_seconds = self.save_stall_seconds, 0.0
        if stall:  # the time the training thread spent saving since the last record (not in the iteration time)
            memory["checkpoint_stall_s"] = stall
        return {**memory,
            "iteration": iteration, "consumed_samples": consumed, "lm_loss": loss, "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "loss_scale": float(scale), "skipped_iterations": self.skipped, "nan_iterations": self.nan_iterations,
            "tokens_per_s": tokens / seconds, "tflops_per_gpu": flops / seconds / world / 1e12,
            "elapsed_ms_per_iter": seconds * 1000.0, "global_batch_size": batch,
        }

    def _log(self, logger, pending, iteration, consumed, timer, earlier_seconds) -> None:
        """Reduce the interval's losses (the one host sync) and write the log record; the interval's
        time is read after the sync, so it holds all the device work of the interval."""
        values = self._check_finite(pending)
        self._check_loss_scale()
        seconds = earlier_seconds + timer.lap()
        self.nan_iterations += sum(1 for v in values if not math.isfinite(v))
        loss = sum(values) / len(values)
        lr = pending[-1][1]
        logger.iteration(self._metrics(iteration, consumed, loss, lr, seconds / len(pending)), write_line=True)
        self._finish_save(blocking=False)  # --async-save: a checkpoint whose writes are done is completed here

    def _save(self, pending, iteration: int, consumed: int) -> None:
        """A checkpoint, never of weights reached through a non-finite loss or gradient: the iterations not
        yet logged are checked first (every rank saves at the same iteration, so all take part). With
        --async-save the files are written in the background and completed at the next log line, the
        next save or the end of the run, whichever comes first."""
        from hybrid.training import checkpoint
        if pending and self.run.train.check_nan:
            self._check_finite(pending)
        self._finish_save()
        start = time.perf_counter()
        tag = checkpoint.write_files(self.engine, self.run, self.run.train.save, iteration, consumed,
                                     self.topology.groups.sequence)
        self.save_stall_seconds += time.perf_counter() - start
        self.unfinished_save = tag
        if not self.run.train.async_save:
            self._finish_save()

    def _finish_save(self, blocking: bool = True) -> None:
        """Complete the checkpoint being written (manifest, `latest`), if one is. Not `blocking` (at log
        lines): only once every rank's background writes are done (one all-reduce of a flag)."""
        if self.unfinished_save is None:
            return
        if not blocking and not self._writes_done_everywhere():
            return
        from hybrid.training import checkpoint
        start = time.perf_counter()
        checkpoint.finalize(self.engine, self.run.train.save, self.unfinished_save)
        self.save_stall_seconds += time.perf_counter() - start
        self.last_saved_tag, self.unfinished_save = self.unfinished_save, None

    def train(self, iteration: int, consumed: int) -> int:
        t = self.run.train
        logger = MetricsLogger(t.train_iters, t.log_json, t.tensorboard_dir, t.wandb_project, t.wandb_exp_name,
                               config_summary(self.run), t.progress_bar, iteration, t.wandb_save_dir)
        self.consumed_valid = (iteration // t.eval_interval) * t.eval_iters * t.global_batch_size \
            if t.eval_interval else 0
        if iteration >= t.train_iters and t.load:  # a restart after the last checkpoint: nothing to redo
            log(f"nothing to train: the checkpoint loaded from {t.load} is at iteration {iteration}, the end of the "
                f"run (--train-iters {t.train_iters}); no evaluation, no save")
            logger.close()
            return iteration
        batches = self._batches(self.train_ds, consumed)
        timer, last_saved, pending, interval_seconds = Timer(), None, [], 0.0
        log(f"training from iteration {iteration} to {t.train_iters} "
            f"(TP={self.run.tensor_parallel}, PP={self.run.pipeline_parallel}{self._schedule_note()}, "
            f"DP={self.run.data_parallel}, "
            f"ZeRO-{self.run.zero_stage}, {t.precision})")
        try:
            while iteration < t.train_iters:
                lr = self.engine.get_lr()[0]
                skipped_before = getattr(self.engine, "skipped_steps", 0)
                batch_size = self._batch_size_for(consumed)
                if self.moe:
                    self.moe.before(self.engine.gradient_accumulation_steps())
                pending.append((self.step.train(batches), lr, self._norm_finite(), iteration + 1))
                if self.moe:
                    self.moe.after()
                iteration += 1
                consumed += batch_size
                self.skipped += getattr(self.engine, "skipped_steps", 0) - skipped_before
                logger.advance()
                if iteration % t.log_interval == 0 or iteration == t.train_iters:
                    self._log(logger, pending, iteration, consumed, timer, interval_seconds)
                    pending, interval_seconds = [], 0.0
                else:
                    interval_seconds += timer.lap()
                if t.eval_interval and iteration % t.eval_interval == 0:
                    self.evaluate(iteration, logger)
                if t.save and t.save_interval and iteration % t.save_interval == 0:
                    self._save(pending, iteration, consumed)
                    last_saved = iteration
                out_of_time = self._out_of_time()
                if out_of_time or (t.exit_interval and iteration % t.exit_interval == 0):
                    if pending:
                        self._log(logger, pending, iteration, consumed, timer, interval_seconds)
                    if t.save and last_saved != iteration:
                        self._save(pending, iteration, consumed)
                    self._finish_save()
                    reason = (f"--exit-duration-in-mins {t.exit_duration_in_mins}" if out_of_time
                              else f"--exit-interval {t.exit_interval}")
                    log(f"exiting at iteration {iteration} ({reason})")
                    return iteration
                timer.lap()  # evaluation and saving are not iteration time
            if not (t.eval_interval and iteration % t.eval_interval == 0):
                self.evaluate(iteration, logger)
            if t.save and last_saved != iteration:
                self._save(pending, iteration, consumed)
            self._finish_save()
        finally:
            logger.close()
        return iteration


def _timeout_of(argv) -> float:
    try:
        return build_parser().parse_args(argv).distributed_timeout_minutes
    except ConfigError:
        return float("nan")


def _already_finished(run: RunConfig) -> bool:
    """A restart (--load = --save) whose newest complete checkpoint is the run's last iteration has
    nothing to do: it says so and exits before building anything (no process group, no save)."""
    t = run.train
    if not t.load or t.finetune or t.universal_checkpoint or not os.path.isdir(t.load):
        return False
    from hybrid.checkpoint_format import iteration_of, read_tag, verify_manifest
    tag = read_tag(t.load)
    iteration = iteration_of(tag)
    if iteration is None or iteration < t.train_iters or verify_manifest(os.path.join(t.load, tag)) is not None:
        return False
    log(f"nothing to train: the newest checkpoint in {t.load} ({tag}) is at iteration {iteration}, the end of "
        f"the run (--train-iters {t.train_iters}); exiting")
    return True


def _quiet_deepspeed() -> None:
    from deepspeed.utils import logger as ds_logger
    if not os.environ.get("HYBRID_VERBOSE"):
        ds_logger.setLevel(logging.WARNING)


def run_training(argv: Optional[list[str]] = None) -> int:
    """Parse flags, build everything, train. Returns the process exit code."""
    args = build_parser().parse_args(argv)
    from hybrid.training.deepspeed_fixes import install_safe_torch_load
    install_safe_torch_load(args.allow_unsafe_checkpoint_load)  # before anything reads a file
    base_model = None
    if args.load_hf:  # the architecture and tokenizer of a HuggingFace model
        from hybrid.conversion.hf import read_hf_config
        base_model = read_hf_config(args.load_hf, "--load-hf")
        if args.tokenizer_type is None and not args.vocab_file:
            args.tokenizer_type, args.tokenizer_model = "HFTokenizer", args.load_hf
    from hybrid.data.tokenizer import build_tokenizer
    tokenizer = build_tokenizer(**tokenizer_kwargs(args))
    # Every flag is checked before DeepSpeed is imported or a process group exists.
    world_size = args.dry_run_world_size or int(os.environ.get("WORLD_SIZE", "1"))
    run = build_run_config(args, world_size, tokenizer.vocab_size, base_model, getattr(tokenizer, "eod", None))
    if args.dry_run:  # the memory estimate: nothing built, no process group
        from hybrid.dry_run import report
        if int(os.environ.get("RANK", "0")) == 0:
            print(report(run, args.gpu_memory_gb), flush=True)
        return 0
    if _already_finished(run):
        from hybrid.training.demo import finish
        return finish(run)
    from hybrid.distributed import init_distributed
    init_distributed(args.distributed_timeout_minutes, args.distributed_backend)
    _quiet_deepspeed()
    from hybrid.parallel.random import model_parallel_seed
    from hybrid.topology import Topology
    from hybrid.training import checkpoint
    from hybrid.training.batches import build_datasets
    from hybrid.training.engine import build_engine
    topology = Topology(run.tensor_parallel, run.pipeline_parallel, run.context_parallel, run.ulysses,
                        run.expert_parallel, experts=bool(run.model.num_experts))
    model_parallel_seed(run.train.seed, topology.tp_rank, topology.groups.sequence.rank)
    datasets = build_datasets(run.train, tokenizer.vocab_size)
    engine, _ = build_engine(run, topology)
    iteration, consumed = checkpoint.start(engine, run, topology)
    Trainer(run, topology, engine, datasets, getattr(tokenizer, "eod", None)).train(iteration, consumed)
    from hybrid.training.demo import finish
    return finish(run)


ERROR_GRACE_SECONDS = 3.0
PEER_FAILED = 4  # the exit status when a collective failed: a peer died or did not answer in time

# what torch.distributed's backends say when a peer is gone or silent (gloo: RuntimeError texts; NCCL:
# DistBackendError / its watchdog)
_PEER_FAILURE_TEXTS = ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer",
                       "Connection refused", "NCCL", "Broken pipe")


def _peer_failure(error: BaseException) -> bool:
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _PEER_FAILURE_TEXTS)


def _report_peer_failure(error: BaseException, timeout_minutes: float) -> None:
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    print(f"error: rank {rank}: a collective with another rank failed ({first}). A rank died or did not answer "
          f"within --distributed-timeout-minutes {timeout_minutes:g}; the newest complete checkpoint in --save is "
          f"intact: restart the job with --load pointing at it (torchrun --max-restarts does this by itself).",
          file=sys.stderr, flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: a user's mistake ends in one message and exit code 2, not a traceback; a dead or
    silent peer in one message and PEER_FAILED."""
    try:
        code = run_training(argv)
    except RuntimeError as e:
        if not _peer_failure(e):
            raise
        _report_peer_failure(e, _timeout_of(argv))
        return PEER_FAILED  # no barrier or teardown: the groups are broken
    except ConfigError as e:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:  # every rank meets the same error; launchers kill the others when one exits: let rank 0 print
            time.sleep(ERROR_GRACE_SECONDS)
        code = 2
    if dist.is_initialized():
        if code != 2:  # 0, or the export failure of rank 0 alone (hybrid.training.demo.EXPORT_FAILED)
            # every rank has finished its last collective and send before any rank tears its groups
            # down (a rank destroying its gloo groups while a peer still talks to it can abort)
            dist.barrier()
        dist.destroy_process_group()
    return code
