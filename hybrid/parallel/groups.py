"""The parallel axes a layer communicates over, as one object: sizes, this rank's index, process groups.

Layers take a `ParallelGroups` (as megatron-core's modules take a process-group collection) instead
of a bare TP group, so a model can be built and sized for a degree without that many ranks
(`ParallelGroups.shapes_only(tp=4, tp_rank=1)` builds rank 1's shards of a TP-4 model in one
process; its collectives raise), and new axes reach every layer without new arguments.

Rank order (Megatron-LM's): TP varies fastest, then CP, then DP, then PP; expert parallelism (EP)
splits the DP ranks (an EP group lies inside a DP group).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.parallel import collectives as C


@dataclass(frozen=True)
class Axis:
    """One parallel axis: its size, this rank's index in it and the process group (SINGLE_RANK at size 1)."""

    size: int = 1
    rank: int = 0
    group: object = C.SINGLE_RANK

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside an axis of size {self.size}")

    @classmethod
    def of(cls, group) -> "Axis":
        """The axis a process group spans, from torch.distributed (one-rank groups become SINGLE_RANK)."""
        size = C.group_size(group)
        return cls(size, C.group_rank(group), group if size > 1 else C.SINGLE_RANK)


@dataclass(frozen=True)
class ParallelGroups:
    """Every axis a layer may communicate over (TP, CP, EP) and the ones gradients are reduced over (DP, PP)."""

    tp: Axis = Axis()  # tensor parallel: weights split by rows/columns, activations all-reduced or SP-scattered
    cp: Axis = Axis()  # context parallel: the sequence split over ranks, attention a ring (ring_attention)
    ulysses: Axis = Axis()  # DeepSpeed-Ulysses: the sequence split over ranks, all-to-all around attention
    ep: Axis = Axis()  # expert parallel: experts split over ranks inside DP, tokens sent by all-to-all
    dp: Axis = Axis()  # data parallel: ZeRO partitions and gradient reduction
    pp: Axis = Axis()  # pipeline parallel: this rank's stage

    @classmethod
    def single(cls) -> "ParallelGroups":
        """One rank: no communication, even inside a distributed job."""
        return cls()

    @classmethod
    def shapes_only(cls, tp: int = 1, tp_rank: int = 0) -> "ParallelGroups":
        """TP rank `tp_rank` of a TP-`tp` model, built in one process for its shapes and names."""
        return cls(tp=Axis(tp, tp_rank, C.SHAPES_ONLY if tp > 1 else C.SINGLE_RANK))

    @property
    def sequence_split(self) -> int:
        """Ranks holding parts of one sequence (CP or Ulysses; at most one of them is > 1)."""
        return self.cp.size * self.ulysses.size

    @property
    def sequence(self) -> "Axis":
        """The axis the sequence is split over (CP's or Ulysses'; a one-rank axis without a split)."""
        return self.cp if self.cp.size > 1 else self.ulysses

    # the TP accessors every layer uses
    @property
    def tp_group(self):
        return self.tp.group

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank


def as_groups(groups) -> ParallelGroups:
    """`groups` itself, or one rank for None."""
    if groups is None:
        return ParallelGroups.single()
    if not isinstance(groups, ParallelGroups):
        raise TypeError(f"expected ParallelGroups (hybrid.parallel.groups), got {type(groups).__name__}; "
                        f"pass topology.groups or ParallelGroups.single()")
    return groups
