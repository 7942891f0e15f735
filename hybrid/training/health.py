"""The run's health policy: a diverging run stops (--check-for-nan-in-loss-and-grad, on by default as in
Megatron-LM) at the first iteration whose loss or gradient norm is not finite, with nothing saved after
it, and an fp16 run stops when its loss scale has collapsed. Both are read at a log line or before a
save, from values kept on the device: no host sync per iteration."""

from __future__ import annotations

import math
from typing import Optional

import torch

from hybrid.errors import NonFiniteError
from hybrid.training.reduction import reduce_interval


class HealthCheck:
    """Per-iteration device flags, checked in one host sync for a whole log interval."""

    def __init__(self, run, engine, step, saver):
        self.run, self.engine, self.step, self.saver = run, engine, step, saver
        self.nan_iterations = 0  # iterations whose reduced loss was not finite (--no-check-for-nan-...)
        self._skipped_at_last_log = 0

    def norm_finite(self):
        """Whether this iteration's gradient norm is finite, on the device (True where DeepSpeed keeps no
        norm, and under fp16, whose overflow steps DeepSpeed's loss scaling skips)."""
        training = self.run.training
        if not training.check_nan or training.precision == "fp16":
            return True
        norm = self.engine.get_global_grad_norm() if hasattr(self.engine, "get_global_grad_norm") else None
        if norm is None:
            return True
        return torch.isfinite(norm) if torch.is_tensor(norm) else math.isfinite(float(norm))

    def checked_losses(self, pending) -> list[float]:
        """The interval's losses (each iteration's DP mean) from `pending` records (loss, lr, norm finite,
        iteration); with --check-for-nan-in-loss-and-grad the first non-finite loss or gradient norm stops
        the run (every rank reads the same reduced values)."""
        values = reduce_interval(self.step, [p[0] for p in pending], [p[2] for p in pending])
        losses, norms_ok = values[:len(pending)], values[len(pending):]
        self.nan_iterations += sum(1 for v in losses if not math.isfinite(v))
        if self.run.training.check_nan:
            for (_, _, _, iteration), loss, norm_ok in zip(pending, losses, norms_ok):
                if not math.isfinite(loss) or not norm_ok:
                    self._stop(iteration, loss if not math.isfinite(loss) else None)
        return losses

    def _stop(self, iteration: int, loss: Optional[float]) -> None:
        self.saver.finish()  # a checkpoint being written was checked finite when it was taken
        run, c = self.run, self.run.checkpoint
        what = f"the loss is {loss}" if loss is not None else "the gradient norm is not finite"
        last = (f"the last good checkpoint is {c.save}/{self.saver.last_saved_tag}" if self.saver.last_saved_tag
                else "no checkpoint was saved by this run" + (f" (it started from --load {c.load})" if c.load else ""))
        fp16 = run.training.precision == "fp16"
        raise NonFiniteError(
            f"iteration {iteration}: {what}; stopping (--check-for-nan-in-loss-and-grad) with nothing saved after it. "
            f"{last[0].upper() + last[1:]}. Try a lower --lr (now {run.optimizer.lr:g}), a longer warmup "
            f"(--lr-warmup-iters){'' if run.optimizer.clip_grad else ', --clip-grad 1.0'}"
            f"{', --bf16 instead of --fp16' if fp16 else ''}, or look at the data of that iteration; resume from that "
            f"checkpoint with --load. To train on regardless, add --no-check-for-nan-in-loss-and-grad.")

    def check_loss_scale(self, skipped: int) -> None:
        """fp16: DeepSpeed skips overflowing steps and lowers the scale; once the scale sits at its minimum
        and steps are still skipped (`skipped`: the run's count so far), the run has collapsed: stop."""
        training = self.run.training
        if not training.check_nan or training.precision != "fp16":
            return
        scale = getattr(self.engine.optimizer, "cur_scale", None)
        minimum = float((self.run.ds_config.get("fp16") or {}).get("min_loss_scale", 1.0))
        if scale is not None and float(scale) <= minimum and skipped > self._skipped_at_last_log:
            raise NonFiniteError(f"the fp16 loss scale has collapsed to its minimum ({float(scale):g}, min_loss_scale) "
                                 f"and steps are still skipped for overflow; stopping. Try --bf16, a lower --lr, "
                                 f"or --clip-grad 1.0.")
        self._skipped_at_last_log = skipped
