"""The parallel layout as one object: every axis a rank communicates over, named by use, with its size,
this rank's index and its process group; and the one place those groups are made (`build_groups`).

Layers take a `ParallelGroups` (as megatron-core's modules take a ProcessGroupCollection) instead of a
bare TP group, so a model can be built and sized for a degree without that many ranks
(`ParallelGroups.shapes_only(tp=4, tp_rank=1)` builds rank 1's shards of a TP-4 model in one process;
its collectives raise), and new axes reach every layer without new arguments.

Rank order (Megatron-LM's): TP varies fastest, then the sequence split (CP or Ulysses), then DP, then
PP (hybrid.parallel.dims names the sizes). The groups come from DeepSpeed's own topology
(`PipeModelDataParallelTopology`, axes pipe, data, model) and its `PipelineParallelGrid`, whose data axis
is DP x CP: the grid is the `mpu` handed to `deepspeed.initialize` and `deepspeed.checkpointing`, so
ZeRO partitions within DP x CP and activation checkpointing partitions over TP. Nothing is stored in
module globals: two layouts can coexist in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

from hybrid.distributed import init_distributed
from hybrid.parallel import collectives as C
from hybrid.parallel.dims import ParallelDims


@dataclass(frozen=True)
class Axis:
    """One parallel axis: its size, this rank's index in it, the process group (SINGLE_RANK at size 1)
    and the global ranks along it, in order (empty where no job stands behind it)."""

    size: int = 1
    rank: int = 0
    group: object = C.SINGLE_RANK
    ranks: tuple = ()

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside an axis of size {self.size}")

    @classmethod
    def of(cls, group, ranks=()) -> "Axis":
        """The axis a process group spans, from torch.distributed (one-rank groups become SINGLE_RANK)."""
        size = C.group_size(group)
        return cls(size, C.group_rank(group), group if size > 1 else C.SINGLE_RANK, tuple(ranks))

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1


@dataclass(frozen=True)
class ParallelGroups:
    """Every axis of the layout, named by use (megatron-core's dp vs dp_cp vs expt_dp)."""

    tp: Axis = Axis()  # tensor parallel: weights split by rows/columns, activations all-reduced or SP-scattered
    cp: Axis = Axis()  # context parallel: the sequence split over ranks, attention a ring (ring_attention)
    ulysses: Axis = Axis()  # DeepSpeed-Ulysses: the sequence split over ranks, all-to-all around attention
    dp: Axis = Axis()  # data parallel: the ranks reading different samples
    dp_cp: Axis = Axis()  # DP x the sequence split: gradient average and ZeRO partitions (DeepSpeed's data axis)
    ep: Axis = Axis()  # expert parallel: experts split over EP consecutive DP x CP ranks, tokens sent by all-to-all
    edp: Axis = Axis()  # expert data parallel: the DP x CP ranks holding the same experts (their gradient average)
    pp: Axis = Axis()  # pipeline parallel: this rank's stage
    embedding: Axis = Axis()  # the first and last pipeline stage's ranks (a tied table's two copies), PP > 1
    dims: Optional[ParallelDims] = None  # the sizes these groups were built for (None: one rank, shapes)
    mpu: object = field(default=None, compare=False)  # DeepSpeed's grid: deepspeed.initialize(mpu=...)
    ds_topology: object = field(default=None, compare=False)  # DeepSpeed's topology (PipelineModule's)

    @classmethod
    def single(cls) -> "ParallelGroups":
        """One rank: no communication, even inside a distributed job."""
        return cls()

    @classmethod
    def shapes_only(cls, tp: int = 1, tp_rank: int = 0) -> "ParallelGroups":
        """TP rank `tp_rank` of a TP-`tp` model, built in one process for its shapes and names."""
        return cls(tp=Axis(tp, tp_rank, C.SHAPES_ONLY if tp > 1 else C.SINGLE_RANK))

    @property
    def sequence(self) -> Axis:
        """The axis the sequence is split over (CP's or Ulysses'; a one-rank axis without a split)."""
        return self.cp if self.cp.size > 1 else self.ulysses

    @property
    def sequence_split(self) -> int:
        """Ranks holding parts of one sequence: the size of the sequence axis."""
        return self.sequence.size

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

    def __repr__(self) -> str:
        sizes = ", ".join(f"{name}={getattr(self, name).size}" for name in ("tp", "cp", "ulysses", "dp", "ep", "pp")
                          if getattr(self, name).size > 1)
        ranks = ", ".join(f"{name}={getattr(self, name).rank}" for name in ("tp", "cp", "ulysses", "dp", "ep", "pp")
                          if getattr(self, name).size > 1)
        return f"ParallelGroups({sizes or 'one rank'}{'; rank ' + ranks if ranks else ''})"


def as_groups(groups) -> ParallelGroups:
    """`groups` itself, or one rank for None."""
    if groups is None:
        return ParallelGroups.single()
    if not isinstance(groups, ParallelGroups):
        raise TypeError(f"expected ParallelGroups (hybrid.parallel.groups), got {type(groups).__name__}; "
                        f"pass the run's groups (build_groups) or ParallelGroups.single()")
    return groups


# --- building them: every process group of hybrid is made here --------------------------------------

class HybridGrid(PipelineParallelGrid):
    """DeepSpeed's grid plus the Megatron-style TP accessors that `deepspeed.checkpointing` calls
    (`PipelineParallelGrid` names the TP group the "slice" group and lacks `get_tensor_model_parallel_group`)."""

    def get_tensor_model_parallel_group(self):
        return self.get_slice_parallel_group()

    def get_tensor_model_parallel_src_rank(self):
        """Global rank of TP rank 0 in this rank's TP group (Megatron's mpu API)."""
        return self.global_rank - self.get_tensor_model_parallel_rank()


def _axis_from_lists(rank_lists: list, me: int) -> Axis:
    """A group per list of global ranks (every rank creates every group, as torch.distributed requires,
    in the same order); this rank's axis."""
    mine = Axis()
    for ranks in rank_lists:
        group = dist.new_group(list(ranks)) if len(ranks) > 1 else C.SINGLE_RANK
        if me in ranks:
            mine = Axis(len(ranks), list(ranks).index(me), group, tuple(ranks))
    return mine


def build_groups(dims: Optional[ParallelDims] = None, *, experts: bool = False, **sizes) -> ParallelGroups:
    """Every process group of a layout (collective: every rank calls it with the same arguments).
    `dims`, or the sizes (ParallelDims' fields but the world size, which comes from torch.distributed,
    initialised from the environment if needed); `experts`: the model has MoE layers, so the expert
    groups are built as real groups at every EP size (DeepSpeed's MoE machinery reduces and
    checkpoints over them)."""
    init_distributed()  # no-op when already initialised; DeepSpeed's grid needs deepspeed.comm
    if dims is None:
        dims = ParallelDims(dist.get_world_size(), **sizes)
    elif sizes:
        raise TypeError("build_groups takes dims or sizes, not both")
    split = dims.sequence_split
    # DeepSpeed's data axis is DP x CP (CP varying faster): CP ranks hold different tokens of the same
    # samples, so gradients are averaged and ZeRO partitions over both
    topology = PipeModelDataParallelTopology(num_pp=dims.pipeline_parallel, num_mp=dims.tensor_parallel,
                                             num_dp=dims.dp_cp)
    grid = HybridGrid(topology=topology)
    me = dist.get_rank()
    data_axis = [[topology.get_rank(pipe=p, data=d, model=m) for d in range(dims.dp_cp)]
                 for p in range(dims.pipeline_parallel) for m in range(dims.tensor_parallel)]
    # the sequence split: consecutive runs of `split` ranks on the data axis; DP: every split-th of them
    sequence = _axis_from_lists([data[i:i + split] for data in data_axis for i in range(0, dims.dp_cp, split)], me) \
        if split > 1 else Axis(ranks=(me,))
    dp_cp = Axis.of(grid.get_data_parallel_group(), grid.get_data_parallel_group_ranks())
    dp = _axis_from_lists([data[c::split] for data in data_axis for c in range(split)], me) if split > 1 else dp_cp
    ep = edp = Axis()
    if experts or dims.expert_parallel > 1:
        ep, edp = _expert_axes(data_axis, dims.expert_parallel, me)
    pipe_lists = topology.get_axis_comm_lists("pipe")
    embedding = _axis_from_lists([sorted({ranks[0], ranks[-1]}) for ranks in pipe_lists], me) \
        if dims.pipeline_parallel > 1 else Axis()
    return ParallelGroups(
        tp=Axis.of(grid.get_tensor_model_parallel_group()),
        cp=sequence if dims.context_parallel > 1 else Axis(),
        ulysses=sequence if dims.ulysses > 1 else Axis(),
        dp=dp, dp_cp=dp_cp, ep=ep, edp=edp,
        pp=Axis.of(grid.get_pipe_parallel_group(), next(r for r in pipe_lists if me in r)),
        embedding=embedding, dims=dims, mpu=grid, ds_topology=topology)


def _expert_axes(data_axis: list, ep: int, me: int) -> tuple:
    """Expert-parallel groups (EP consecutive ranks of the DP x CP axis of one pipeline stage and TP rank)
    and expert-data-parallel groups (the ranks of that axis holding the same experts: every EP-th). Both
    are real process groups at every size, one-rank ones included: DeepSpeed's MoE machinery registers,
    reduces and checkpoints over them by name."""
    found = {}
    for data in data_axis:
        for ranks, kind in [*[(data[i:i + ep], "ep") for i in range(0, len(data), ep)],
                            *[(data[j::ep], "edp") for j in range(ep)]]:
            group = dist.new_group(ranks)
            if me in ranks:
                found[kind] = Axis(len(ranks), ranks.index(me), group, tuple(ranks))
    return found["ep"], found["edp"]
