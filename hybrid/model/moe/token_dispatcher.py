"""Tokens to their experts and back (megatron-core's token dispatcher): the kept (token, expert) pairs
sorted by expert, sent to the EP ranks holding those experts by all-to-all (Megatron's alltoall
dispatcher), through the experts, back by all-to-all, weighted by their router probabilities and
summed per token. Padded to capacity (--moe-pad-expert-input-to-capacity), every expert's group has
exactly its capacity of rows, so every size is known on the host: no device read at any EP."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from hybrid.model.moe.router import kept_choices, routing_counts
from hybrid.parallel import collectives as C
from hybrid.parallel.mappings import all_to_all_rows


class TokenDispatcher:
    """Dispatch and combine for one MoE layer: `num_experts` global experts over the EP axis `ep`
    (global expert e lives on EP rank e // (E / EP) as its local expert e % (E / EP))."""

    def __init__(self, num_experts: int, ep):
        self.num_experts, self.ep = num_experts, ep
        self.num_local_experts = num_experts // ep.size

    def __call__(self, x: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor, keep: Optional[torch.Tensor],
                 experts: Callable, padded_to: Optional[int] = None) -> torch.Tensor:
        """x [T, h], probs / indices [T, k], keep [T, k] or None -> [T, h]: each token's weighted sum of its
        kept experts' outputs. `experts(rows, counts[, sizes])`: the local experts on rows grouped by expert;
        `padded_to`: each expert's capacity, its group padded to it."""
        k, E = indices.size(1), self.num_experts
        chosen = kept_choices(indices, keep, E)  # dropped pairs sort last and are cut off
        order = torch.argsort(chosen, stable=True)
        counts = routing_counts(chosen, E)
        if padded_to is not None:
            return self._padded(x, probs, chosen, order, counts, k, padded_to, experts)
        if keep is not None:
            order = order[: int(counts.sum())]  # a host sync (as Megatron's capacity path without padding)
        tokens = order // k
        routed = x.index_select(0, tokens)  # [N, h], grouped by expert
        y = experts(routed, counts) if self.ep.size == 1 else self._across_ranks(routed, counts, experts)
        weights = probs.flatten().index_select(0, order).unsqueeze(1)
        return torch.zeros_like(x).index_add(0, tokens, y * weights)

    def _padded(self, x, probs, chosen, order, counts, k: int, capacity: int, experts) -> torch.Tensor:
        """Expert e's kept pairs fill slots e C .. e C + count_e - 1 (in the unpadded order), the rest of its
        C slots read token 0 and are weighted 0; the weights' zeros are selected, not multiplied, so
        nothing a padding row computes reaches the output or a gradient."""
        E, n = self.num_experts, order.numel()
        placed = chosen.index_select(0, order)  # each sorted pair's expert (E: dropped)
        first = torch.cat([counts.cumsum(0) - counts, counts.new_zeros(1)])  # each expert's first sorted pair
        rank = torch.arange(n, device=order.device) - first.index_select(0, placed)
        slot = torch.where(placed < E, placed * capacity + rank, E * capacity)  # E C: where dropped pairs go
        pair = torch.full((E * capacity + 1,), -1, dtype=order.dtype, device=order.device).scatter(0, slot, order)
        pair = pair[:-1]
        valid = (pair >= 0).unsqueeze(1)
        pair = pair.clamp_min(0)
        tokens = pair // k
        routed = x.index_select(0, tokens)  # [E C, h]: expert by expert, C rows each
        if self.ep.size == 1:
            y = experts(routed, torch.full((E,), capacity, device=x.device), [capacity] * E)
        else:
            y = self._padded_across_ranks(routed, capacity, experts)
        weights = probs.flatten().index_select(0, pair).unsqueeze(1)
        return torch.zeros_like(x).index_add(0, tokens, torch.where(valid, y * weights, 0.0))

    def _padded_across_ranks(self, routed, capacity: int, experts):
        """Fixed-size all-to-all: local experts x C rows to and from every EP rank."""
        group, ep, local = self.ep.group, self.ep.size, self.num_local_experts
        block = local * capacity
        arrived = all_to_all_rows(routed, [block] * ep, [block] * ep, group)  # [source, local expert, C]
        h = routed.size(1)
        by_expert = arrived.view(ep, local, capacity, h).transpose(0, 1).reshape(ep * block, h)
        y = experts(by_expert, torch.full((local,), ep * capacity, device=routed.device), [ep * capacity] * local)
        back = y.view(local, ep, capacity, h).transpose(0, 1).reshape(ep * block, h)
        return all_to_all_rows(back, [block] * ep, [block] * ep, group)

    def _across_ranks(self, routed, counts, experts):
        """All-to-all to the experts' EP ranks, the local experts, all-to-all back; the split sizes are
        read on the host (one sync per layer, as Megatron's)."""
        group, ep, local = self.ep.group, self.ep.size, self.num_local_experts
        send_counts = counts.view(ep, local)  # rows for each rank's local experts
        recv_counts = C.all_to_all_variable(send_counts.contiguous(), [1] * ep, [1] * ep, group)  # [source, local]
        sizes = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        send, recv = sizes[:ep], sizes[ep:]
        arrived = all_to_all_rows(routed, send, recv, group)  # [sources x local experts] blocks
        expert_of = torch.repeat_interleave(torch.arange(local, device=routed.device).repeat(ep),
                                            recv_counts.flatten(), output_size=sum(recv))
        regroup = torch.argsort(expert_of, stable=True)  # by local expert, each source's rows in order
        y = experts(arrived.index_select(0, regroup), recv_counts.sum(0))
        back = torch.empty_like(y).index_copy(0, regroup, y) if y.numel() else y  # to arrival order
        return all_to_all_rows(back, recv, send, group)
