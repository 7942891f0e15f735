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

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from hybrid.parallel import ring_attention


@dataclass
class SequenceLayout:
    """The facts attention and the position embeddings need beyond this rank's tokens themselves."""

    positions: Optional[torch.Tensor] = None  # [s_local, b] position of each local token; None: 0 .. s-1
    documents: Optional[torch.Tensor] = None  # [b, s] document of every token of the full sequence; None: one
    cp: Optional[object] = None  # the context-parallel Axis (size > 1), None without context parallelism
    ulysses: Optional[object] = None  # the Ulysses Axis (size > 1), None without it
    index: Optional[torch.Tensor] = None  # [s_local] positions of the full sequence this rank holds
    # --grpo's recorded routing [b, s, slots, k]: the experts the generator chose for each token in each of this
    # rank's MoE layers (MoELayer.replay_slot), -1 where it chose none (hybrid.model.moe.router.replayed)
    routes: Optional[torch.Tensor] = None
    recording: bool = False  # the forward writes its own routing into `routes` (--moe-routing-replay R2), replays none

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This CP rank's part of a [b, s] tensor (ids, labels)."""
        return tensor if self.index is None else tensor.index_select(1, self.index)

    def routes_of(self, slot: int, groups, sequence_parallel: bool) -> Optional[torch.Tensor]:
        """The recorded experts of MoE layer `slot` for the tokens this rank routes, [s_local(/tp) x b, k] in the
        router's sequence-major order (under SP this TP rank's part of the sequence), or None."""
        if self.routes is None or self.recording:
            return None
        routes = self.local(self.routes[:, :, slot])  # [b, s_local, k]
        if sequence_parallel and groups.tp_size > 1:
            routes = routes.chunk(groups.tp_size, dim=1)[groups.tp_rank]
        return routes.transpose(0, 1).reshape(-1, routes.size(-1))

    def record_routes(self, slot: int, indices: torch.Tensor, groups=None, sequence_parallel: bool = False) -> None:
        """With `recording`: MoE layer `slot`'s experts [T, k] of the tokens this rank routes, written at their
        positions of `routes` (the inverse of routes_of: this rank reads back only what it wrote)."""
        if not self.recording:
            return
        b, s = self.routes.size(0), self.routes.size(1)
        positions = self.index if self.index is not None else torch.arange(s, device=self.routes.device)
        if sequence_parallel and groups.tp_size > 1:
            positions = positions.chunk(groups.tp_size)[groups.tp_rank]
        chosen = indices.view(-1, b, indices.size(-1)).transpose(0, 1).to(self.routes.dtype)  # [b, s_part, k]
        self.routes[:, positions, slot] = chosen


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


def local_index(seq_len: int, groups, device=None) -> Optional[torch.Tensor]:
    """Positions of a full sequence of `seq_len` this rank holds: CP's chunks
    (hybrid.parallel.ring_attention.local_index), Ulysses' contiguous 1/N; None when it holds all."""
    if groups is None or groups.sequence_split == 1:
        return None
    if groups.cp.size > 1:
        return ring_attention.local_index(seq_len, groups.cp.size, groups.cp.rank, device)
    part = seq_len // groups.ulysses.size
    return torch.arange(groups.ulysses.rank * part, (groups.ulysses.rank + 1) * part, device=device)


def sequence_order(seq_len: int, groups, device=None) -> torch.Tensor:
    """The positions of a full sequence of `seq_len` in the order the sequence ranks' parts concatenate (rank 0's
    part, then rank 1's, ...; local_index of each): where each column of the parts gathered in rank order belongs."""
    if groups.cp.size > 1:
        size = groups.cp.size
        return torch.cat([ring_attention.local_index(seq_len, size, r, device) for r in range(size)])
    return torch.arange(seq_len, device=device)


def stage_layout(local_len: int, groups, device) -> Optional[SequenceLayout]:
    """The layout a pipeline stage without the ids derives (no documents: refused with PP): its part of
    the sequence, from the local length, and the positions of that part."""
    if groups is None or groups.sequence_split == 1:
        return None
    index = local_index(local_len * groups.sequence_split, groups, device)
    return SequenceLayout(positions=index[:, None], cp=groups.cp if groups.cp.size > 1 else None,
                          ulysses=groups.ulysses if groups.ulysses.size > 1 else None, index=index)


def with_routes(layout: Optional[SequenceLayout], routes: Optional[torch.Tensor],
                record: bool = False) -> Optional[SequenceLayout]:
    """`layout` carrying --grpo's routing record (SequenceLayout.routes), to replay or (`record`) to write; unchanged
    without it."""
    if routes is None:
        return layout
    return dataclasses.replace(layout or SequenceLayout(), routes=routes, recording=record)


def sequence_layout(ids: torch.Tensor, config, groups=None) -> Optional[SequenceLayout]:
    """The layout of a micro-batch of full-sequence ids [b, s] on this rank; None when every sequence is
    one causal document with positions 0 .. s-1 held whole (the default, whose attention needs no mask).
    With context parallelism (`groups.cp` of size > 1) the rank holds chunks of the sequence
    (hybrid.parallel.ring_attention.local_index), with Ulysses (`groups.ulysses`) its contiguous
    1/N; their positions are theirs in the full sequence."""
    cp = groups.cp if groups is not None and groups.cp.size > 1 else None
    ulysses = groups.ulysses if groups is not None and groups.ulysses.size > 1 else None
    if not (config.splits_documents or cp or ulysses):
        return None
    documents = documents_of(ids, config.eod_token) if config.reset_attention_mask else None
    positions = positions_of(ids, config.eod_token) if config.reset_position_ids else None
    index = local_index(ids.size(1), groups, ids.device)
    if index is not None:
        positions = index[None, :] if positions is None else positions.index_select(1, index)
    return SequenceLayout(positions=None if positions is None else positions.t(), documents=documents,
                          cp=cp, ulysses=ulysses, index=index)


def stage_layout_of(hidden: torch.Tensor, ids: Optional[torch.Tensor], config, groups) -> Optional[SequenceLayout]:
    """The layout a pipeline stage's layers use: from the micro-batch's whole-sequence ids where they
    travel with it (packed documents), else, with a sequence split, this rank's part derived from the
    hidden states' length [s(/tp), b, h]; None for whole sequences of one document each."""
    if ids is not None:
        return sequence_layout(ids, config, groups)
    if groups is None or groups.sequence_split == 1:
        return None
    local = hidden.size(0) * (groups.tp_size if config.sequence_parallel else 1)
    return stage_layout(local, groups, hidden.device)
