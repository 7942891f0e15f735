"""Layout-independent weight initialisation.

Every parameter is drawn full-size from its own generator, seeded by the run's seed and the
parameter's canonical name (e.g. "layers.3.attention.qkv.weight"), then sharded. Neither the TP
degree nor the pipeline partition nor the construction order changes the full weights.
"""

from __future__ import annotations

import math
import zlib

import torch

from hybrid.parallel.layers import InitMethod


def seeded_init(seed: int, name: str, fill) -> InitMethod:
    """An init calling `fill(tensor, generator)` with a generator seeded by the run's seed and the parameter's name."""
    param_seed = (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)

    def init(tensor: torch.Tensor) -> None:
        with torch.no_grad():
            fill(tensor, torch.Generator().manual_seed(param_seed))

    return init


def normal_init(seed: int, name: str, std: float) -> InitMethod:
    """N(0, std) for the parameter called `name`."""
    return seeded_init(seed, name, lambda tensor, generator: tensor.normal_(0.0, std, generator=generator))


def output_layer_std(std: float, num_layers: int) -> float:
    """Megatron-LM's scaled init for layers that write into the residual stream."""
    return std / math.sqrt(2.0 * num_layers)


def vocab_rows_init(init: InitMethod, vocab_size: int) -> InitMethod:
    """Initialise the first `vocab_size` rows with `init` and zero the padding rows.

    The padded vocabulary depends on TP (a multiple of make-vocab-size-divisible-by x TP), so
    drawing the whole padded table would change the real rows with the layout. Padding rows
    never take part in the loss and stay zero.
    """

    def fill(tensor: torch.Tensor) -> None:
        real = torch.empty((vocab_size,) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
        init(real)
        with torch.no_grad():
            tensor.zero_()
            tensor[:vocab_size].copy_(real)

    return fill
