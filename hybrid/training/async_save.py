"""--async-save: a checkpoint's state is copied to host memory when DeepSpeed hands it over, and written
to disk by a background thread while training goes on.

DeepSpeed passes every file's state dict (model states, ZeRO partitions, pipeline layer files) to its
checkpoint engine's `save`; hybrid.training.deepspeed_fixes.AsyncCheckpointEngine gives them to the
`BackgroundWriter` here. The copy is taken before `save` returns, so the optimizer may change the live
tensors at once; the files are complete only when `wait()` returns, and only then does
hybrid.training.saving move the manifest and `latest` (a crash before that leaves the previous
checkpoint the newest complete one).
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

import torch


def to_host(obj: Any) -> Any:
    """A copy of `obj` with every tensor copied to (pinned, on CUDA) host memory; containers rebuilt."""
    if torch.is_tensor(obj):
        if obj.device.type == "cpu":
            return obj.detach().clone()
        host = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
        return host.copy_(obj.detach(), non_blocking=True)
    if isinstance(obj, dict):
        return type(obj)((k, to_host(v)) for k, v in obj.items()) if type(obj) is not dict else \
            {k: to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [to_host(v) for v in obj]
        return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
    return obj


class BackgroundWriter:
    """One thread writing (state, path) pairs with torch.save in submission order."""

    def __init__(self, save_fn):
        self._save, self._queue = save_fn, queue.Queue()
        self._errors: list = []
        self._thread = threading.Thread(target=self._run, name="hybrid-async-save", daemon=True)
        self._thread.start()

    def submit(self, state: Any, path: str) -> None:
        """Copy `state` to host memory now (one device sync on CUDA), write it later."""
        host = to_host(state)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        self._queue.put((host, path))

    def done(self) -> bool:
        """Every submitted file is written (no waiting)."""
        return self._queue.unfinished_tasks == 0

    def wait(self) -> None:
        """Block until every submitted file is written; raise the first write error."""
        self._queue.join()
        if self._errors:
            error, self._errors = self._errors[0], []
            raise error

    def _run(self) -> None:
        try:  # Linux schedules threads apart: let the training threads have the cores first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            state, path = self._queue.get()
            try:
                self._save(state, path)
            except BaseException as error:  # reported by wait(), on the training thread
                self._errors.append(error)
            finally:
                del state
                self._queue.task_done()
