"""Rank-aware output: Megatron-style log lines, JSON lines, TensorBoard, wandb, a progress bar."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

from tqdm import tqdm

from hybrid.distributed import is_rank_zero, log  # noqa: F401  (one definition; this module's users import them here)


def format_iteration(m: dict, train_iters: int) -> str:
    """Megatron-LM's training log line."""
    return (f" iteration {m['iteration']:8d}/{train_iters:8d} | consumed samples: {m['consumed_samples']:12d} | "
            f"elapsed time per iteration (ms): {m['elapsed_ms_per_iter']:.1f} | learning rate: {m['lr']:.6E} | "
            f"global batch size: {m['global_batch_size']:5d} | lm loss: {m['lm_loss']:.6E} | "
            f"loss scale: {m['loss_scale']:.1f} | grad norm: {m['grad_norm']:.3f} | "
            f"number of skipped iterations: {m['skipped_iterations']:3d} | "
            f"number of nan iterations: {m['nan_iterations']:3d} | tokens per second: {m['tokens_per_s']:.1f} | "
            f"TFLOPs per GPU: {m['tflops_per_gpu']:.3f} |{_mfu_part(m)}{_extra_part(m)} ETA: {_eta(m, train_iters)}")


def _mfu_part(m: dict) -> str:
    """The model FLOPs utilisation, where the accelerator's peak is known (not on a CPU)."""
    return f" MFU: {100.0 * m['mfu']:.1f}% |" if "mfu" in m else ""


# Metrics some runs add to the line (MoE layers; --dpo's rewards, as TRL names them): key -> (label, format)
_EXTRA_PARTS = {"load_balancing_loss": ("load balancing loss", ".6E"), "z_loss": ("z loss", ".6E"),
                "expert_imbalance": ("expert imbalance", ".3f"), "rewards_chosen": ("rewards chosen", ".4f"),
                "rewards_rejected": ("rewards rejected", ".4f"), "rewards_margin": ("rewards margin", ".4f"),
                "rewards_accuracy": ("rewards accuracy", ".3f"),
                # --grpo: the rollouts' rewards and lengths, the policy loss's clipping, KL and train-inference gap
                "reward_mean": ("reward", ".4f"), "reward_std": ("reward std", ".4f"),
                "completion_length": ("completion length", ".1f"), "clip_fraction": ("clip fraction", ".4f"),
                "kl": ("kl", ".3E"), "logprob_mismatch": ("logprob mismatch", ".2E"),
                "routing_mismatch": ("routing mismatch", ".4f"), "routing_replayed": ("routing replayed", ".4f"),
                "is_ratio_mean": ("IS ratio mean", ".4f"),
                "is_ratio_min": ("IS ratio min", ".4f"), "is_ratio_max": ("IS ratio max", ".4f"),
                "generate_tokens_per_s": ("generated tokens/s", ".1f"), "generate_s": ("generation s", ".2f"),
                "kv_cache_mib": ("KV cache MiB", ".1f"), "turns_per_episode": ("turns", ".2f"),
                "replies_per_episode": ("environment replies", ".2f"),
                "frac_reward_zero_std": ("groups without signal", ".3f"), "sampling_rounds": ("sampling rounds", ".2f"),
                "groups_dropped": ("groups dropped", ".3f"),
                "generate_peak_gib": ("generation peak GiB", ".2f")}


def _extra_part(m: dict) -> str:
    """The MoE layers' auxiliary losses and balance (max / mean tokens per expert), --dpo's rewards: those
    the record has."""
    return "".join(f" {label}: {m[key]:{spec}} |" for key, (label, spec) in _EXTRA_PARTS.items() if key in m)


def _eta(m: dict, train_iters: int) -> str:
    seconds = int(m["elapsed_ms_per_iter"] / 1000.0 * max(0, train_iters - m["iteration"]))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class MetricsLogger:
    """Where metrics go on rank 0: stdout lines, --log-json, --tensorboard-dir, --wandb-project."""

    def __init__(self, train_iters: int, log_json: Optional[str] = None, tensorboard_dir: Optional[str] = None,
                 wandb_project: Optional[str] = None, wandb_exp_name: Optional[str] = None,
                 run_config: Optional[dict] = None, progress_bar: bool = True, start_iteration: int = 0,
                 wandb_save_dir: Optional[str] = None):
        self.active = is_rank_zero()
        self.train_iters = train_iters
        self.json_file = self.tensorboard = self.wandb_run = self.bar = None
        if not self.active:
            return
        if log_json:
            os.makedirs(os.path.dirname(os.path.abspath(log_json)), exist_ok=True)
            self.json_file = open(log_json, "a", buffering=1)
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # optional: --tensorboard-dir only
            self.tensorboard = SummaryWriter(log_dir=tensorboard_dir)
        if wandb_project:
            import wandb  # optional: --wandb-project only (its import takes seconds)
            os.environ.setdefault("WANDB_MODE", "offline")  # no network unless the user says so
            if wandb_save_dir:
                os.makedirs(wandb_save_dir, exist_ok=True)
            self.wandb_run = wandb.init(project=wandb_project, name=wandb_exp_name, config=run_config,
                                        dir=wandb_save_dir or tensorboard_dir or os.getcwd())
        if progress_bar and sys.stdout.isatty():
            self.bar = tqdm(total=train_iters, initial=start_iteration, unit="it", dynamic_ncols=True)

    def advance(self) -> None:
        """One more iteration done (the progress bar; no metric is read, so no host sync)."""
        if self.active and self.bar is not None:
            self.bar.update(1)

    def iteration(self, metrics: dict, write_line: bool = True) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{metrics['lm_loss']:.4f}")
        if not write_line:
            return
        line = format_iteration(metrics, self.train_iters)
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)
        self._record(metrics, metrics["iteration"], prefix="train")

    def evaluation(self, metrics: dict) -> None:
        if not self.active:
            return
        line = (f" validation loss at iteration {metrics['iteration']} | lm loss value: {metrics['lm_loss']:.6E} | "
                f"lm loss PPL: {metrics['ppl']:.6E}")
        (self.bar.write if self.bar is not None else print)(line)
        self._record(dict(metrics, split="valid"), metrics["iteration"], prefix="valid")

    def _record(self, metrics: dict, step: int, prefix: str) -> None:
        if self.json_file is not None:
            self.json_file.write(json.dumps(metrics) + "\n")
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "iteration"}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(f"{prefix}/{key}", value, step)
            self.tensorboard.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({f"{prefix}/{k}": v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.json_file is not None:
            self.json_file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


class Timer:
    """Wall-clock between calls to `lap()`."""

    def __init__(self):
        self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed
