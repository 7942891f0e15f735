"""Where hybrid changes a default of torch itself for the whole process, each with the torch version it
was written against (2.13) and the reason, each covered by tests/test_deepspeed_fixes.py (which checks
`RELIED_ON` still holds). The ground floor: it imports nothing of hybrid's, so the lowest modules
(hybrid.distributed) can use it; DeepSpeed's own internals are hybrid.training.deepspeed_fixes'.
"""

from __future__ import annotations

import torch.distributed.distributed_c10d as c10d

# (module, attribute path, a text its source must contain): what the fixes below rely on
RELIED_ON = [
    ("torch.distributed.distributed_c10d", "_new_group_with_tag", "timeout = _get_default_timeout(backend)"),
    ("torch.distributed.distributed_c10d", "_get_default_timeout", "return default_pg_timeout"),
    # the groups DeepSpeed's grid makes pass no timeout, hence the default matters
    ("deepspeed.comm.torch", "TorchBackend.new_group", "return torch.distributed.new_group(ranks)"),
]


def groups_time_out_after(timeout) -> None:
    """Make `timeout` the default of every process group created from now on in this process.
    DeepSpeed 0.19's grid (TP, DP, PP, slice groups) and engine call `torch.distributed.new_group(ranks)`
    with no timeout (deepspeed.comm.torch.TorchBackend.new_group), and torch 2.13 then uses its own default
    (30 minutes for gloo, 10 for NCCL), not the world group's: a dead peer in a TP or pipeline
    collective would hang for that long whatever --distributed-timeout-minutes says. torch reads the
    default from these module constants when a group is made."""
    c10d.default_pg_timeout = timeout
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timeout
