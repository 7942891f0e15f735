"""Where each token of a micro-batch sits: its document and its position (Megatron-LM's
--reset-attention-mask / --reset-position-ids for packed documents).

megatron-core's GPTDataset builds an s x s mask and position ids per sample on the host; here both
follow from the token ids on the device, once per forward, as two small integer tensors:
- documents [b, s]: how many EOD tokens come strictly before each token (an EOD ends its document;
  the token after it starts the next one), so a query attends a key iff both carry the same number;
- positions [s, b]: the distance from the first token of the token's document.
Attention then masks by document block by block (hybrid.model.attention.blocked_attention): memory
grows with the sequence, not with its square.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SequenceLayout:
    """The facts attention and the position embeddings need beyond the tokens themselves."""

    positions: Optional[torch.Tensor] = None  # [s, b] int64 position of each token; None: 0 .. s-1
    documents: Optional[torch.Tensor] = None  # [b, s] document index of each token; None: one document


def documents_of(ids: torch.Tensor, eod_token: int) -> torch.Tensor:
    """ids [b, s] -> [b, s]: the number of EOD tokens before each position (an exclusive cumsum)."""
    eod = (ids == eod_token).to(torch.int32)
    return torch.cumsum(eod, dim=1) - eod


def positions_of(ids: torch.Tensor, eod_token: int) -> torch.Tensor:
    """ids [b, s] -> [b, s]: each token's position within its document (Megatron's reset_position_ids)."""
    s = ids.size(1)
    index = torch.arange(s, device=ids.device).expand_as(ids)
    starts = torch.zeros_like(index)
    starts[:, 1:] = torch.where(ids[:, :-1] == eod_token, index[:, 1:], 0)  # a document starts after an EOD
    return index - torch.cummax(starts, dim=1).values


def sequence_layout(ids: torch.Tensor, config) -> Optional[SequenceLayout]:
    """The layout of a micro-batch of ids [b, s]; None when every sequence is one causal document with
    positions 0 .. s-1 (the default, whose attention needs no mask)."""
    if not config.splits_documents:
        return None
    return SequenceLayout(
        positions=positions_of(ids, config.eod_token).t() if config.reset_position_ids else None,
        documents=documents_of(ids, config.eod_token) if config.reset_attention_mask else None)
