"""A CPU run's count of what a CUDA run would wait on: the torch calls that read a tensor's values on the host."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class HostReads(TorchFunctionMode):
    """Records the torch calls that read a tensor's values on the host (on CUDA each waits for the device):
    item / tolist / bool / int / float / index conversions, .cpu() / .numpy(), the ops whose output shape
    depends on values (nonzero, masked_select, unique, boolean-mask indexing, repeat_interleave without
    output_size) and bincount (which reads its largest index). A CPU run counts what a CUDA run would wait on."""

    ALWAYS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
              "masked_select", "unique", "unique_consecutive", "argwhere", "bincount"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in self.ALWAYS:
            self.reads.append(name)
        elif name == "__getitem__" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                           for i in (args[1] if isinstance(args[1], tuple) else (args[1],))):
            self.reads.append("boolean mask")
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) > 1 \
                and isinstance(args[1], torch.Tensor):
            self.reads.append("repeat_interleave")
        return func(*args, **kwargs)
