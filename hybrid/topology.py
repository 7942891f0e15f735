"""Process groups for tensor x pipeline x data parallelism, built from DeepSpeed's own topology.

Rank order (Megatron-LM's): TP varies fastest, then context parallel (CP), then DP, then PP; expert
parallelism (EP) splits the DP ranks: an EP group is EP consecutive data ranks. DeepSpeed's data-parallel group (`dp_*`) is DP x CP. `Topology.groups` is what layers receive
(hybrid.parallel.groups.ParallelGroups: sizes, ranks and groups of every axis).

The `Topology` wraps DeepSpeed's `PipeModelDataParallelTopology` (axes pipe, data, model:
model/TP varies fastest, then DP, then PP, the rank order of Megatron-LM) and its
`PipelineParallelGrid`. The grid is the `mpu` handed to `deepspeed.initialize` and to
`deepspeed.checkpointing.configure`, so ZeRO partitions within the DP group only and
activation checkpointing partitions over the TP group.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.distributed as dist

from hybrid.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism, validated against the world size before any group is built."""

    world_size: int  # number of ranks in the job
    tensor_parallel: int = 1  # --tensor-model-parallel-size
    pipeline_parallel: int = 1  # --pipeline-model-parallel-size
    context_parallel: int = 1  # --context-parallel-size: the sequence split over CP ranks (ring attention)
    ulysses: int = 1  # --ds-sequence-parallel-size: the sequence split over ranks, all-to-all around attention
    expert_parallel: int = 1  # --expert-model-parallel-size: experts split over EP consecutive DP ranks

    def __post_init__(self):
        for name, value in (("--tensor-model-parallel-size", self.tensor_parallel),
                            ("--pipeline-model-parallel-size", self.pipeline_parallel),
                            ("--context-parallel-size", self.context_parallel),
                            ("--expert-model-parallel-size", self.expert_parallel)):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}.")
        if self.ulysses < 1:
            raise ConfigError(f"--ds-sequence-parallel-size must be >= 1, got {self.ulysses}.")
        if self.context_parallel > 1 and self.ulysses > 1:
            raise ConfigError(f"--context-parallel-size {self.context_parallel} with --ds-sequence-parallel-size "
                              f"{self.ulysses}: the sequence is split one way or the other; give one of them.")
        model_parallel = self.tensor_parallel * self.sequence_split * self.pipeline_parallel
        if self.world_size % model_parallel != 0:
            split = (f"--ds-sequence-parallel-size ({self.ulysses})" if self.ulysses > 1
                     else f"--context-parallel-size ({self.context_parallel})")
            raise ConfigError(
                f"world size {self.world_size} is not a multiple of --tensor-model-parallel-size "
                f"({self.tensor_parallel}) x {split} x "
                f"--pipeline-model-parallel-size ({self.pipeline_parallel}) = {model_parallel}; launch a "
                f"multiple of {model_parallel} ranks or change the sizes.")

        if self.data_parallel % self.expert_parallel != 0:
            raise ConfigError(f"--expert-model-parallel-size {self.expert_parallel} does not divide the "
                              f"data-parallel size {self.data_parallel} (experts are split inside DP).")

    @property
    def sequence_split(self) -> int:
        """Ranks that hold parts of one sequence (CP or Ulysses)."""
        return self.context_parallel * self.ulysses

    @property
    def data_parallel(self) -> int:
        """DP degree: what is left of the world after TP, the sequence split and PP."""
        return self.world_size // (self.tensor_parallel * self.sequence_split * self.pipeline_parallel)


@functools.cache
def _grid_class():
    """DeepSpeed's grid plus the Megatron-style TP accessors that `deepspeed.checkpointing` calls
    (`PipelineParallelGrid` names the TP group the "slice" group and lacks
    `get_tensor_model_parallel_group`). Made on first use, so that checking the parallel sizes
    (ParallelDims, at flag-parsing time) does not import DeepSpeed."""
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    class HybridGrid(PipelineParallelGrid):
        def get_tensor_model_parallel_group(self):
            return self.get_slice_parallel_group()

        def get_tensor_model_parallel_src_rank(self):
            """Global rank of TP rank 0 in this rank's TP group (Megatron's mpu API)."""
            return self.global_rank - self.get_tensor_model_parallel_rank()

    return HybridGrid


def _single_rank():
    from hybrid.parallel.collectives import SINGLE_RANK
    return SINGLE_RANK


class Topology:
    """This rank's place in the TP x PP x DP grid and the process groups for each axis.

    Initialises `torch.distributed` from the environment if needed. Every rank must construct it (group
    creation is collective). Nothing is stored in module globals: two topologies can
    coexist in one process.
    """

    def __init__(self, tensor_parallel: int = 1, pipeline_parallel: int = 1, context_parallel: int = 1,
                 ulysses: int = 1, expert_parallel: int = 1, experts: bool = False):
        """`experts`: the model has MoE layers, so the expert groups are built (at every EP size)."""
        from hybrid.distributed import init_distributed
        init_distributed()  # no-op when already initialised; DeepSpeed's grid needs deepspeed.comm
        self.dims = ParallelDims(dist.get_world_size(), tensor_parallel, pipeline_parallel, context_parallel,
                                 ulysses=ulysses, expert_parallel=expert_parallel)
        if expert_parallel > 1 and self.dims.sequence_split > 1:
            raise ConfigError("--expert-model-parallel-size > 1 with context parallelism or Ulysses is not built yet.")
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
        # DeepSpeed's data axis is DP x CP (CP varying faster): CP ranks hold different tokens of the
        # same samples, so gradients are averaged and ZeRO partitions over both (Megatron's
        # data-parallel group with CP; DeepSpeed's sequence-data-parallel group for Ulysses); the CP
        # (or Ulysses) groups are the data axis' consecutive runs of CP ranks.
        cp = self.dims.sequence_split
        self.ds_topology = PipeModelDataParallelTopology(
            num_pp=self.dims.pipeline_parallel, num_mp=self.dims.tensor_parallel,
            num_dp=self.dims.data_parallel * cp)
        self.grid = _grid_class()(topology=self.ds_topology)
        from hybrid.parallel.groups import Axis, ParallelGroups
        # what the layers communicate over
        sequence = Axis.of(self._context_parallel_group(cp))
        self.expert_group = self.expert_data_group = None
        self.expert_ranks, self.expert_data_ranks = [dist.get_rank()], None
        if experts or expert_parallel > 1:
            self.expert_group, self.expert_data_group, self.expert_ranks, self.expert_data_ranks = \
                self._expert_groups()
        self.groups = ParallelGroups(
            tp=Axis.of(self.grid.get_tensor_model_parallel_group()),
            cp=sequence if self.dims.ulysses == 1 else Axis(),
            ulysses=sequence if self.dims.ulysses > 1 else Axis(),
            ep=Axis(expert_parallel, self.expert_ranks.index(dist.get_rank()),
                    self.expert_group if expert_parallel > 1 else _single_rank()),
            dp=Axis.of(self.grid.get_data_parallel_group()),
            pp=Axis.of(self.grid.get_pipe_parallel_group()))

    def _expert_groups(self):
        """Expert-parallel groups (EP consecutive data ranks of one pipeline stage and TP rank) and
        expert-data-parallel groups (the data ranks holding the same experts: every EP-th), as real
        process groups at every size (DeepSpeed's MoE machinery reduces and checkpoints over them).
        Returns (EP group, EDP group, their global ranks) of this rank."""
        ep, dp, me, t = self.dims.expert_parallel, self.dims.data_parallel, dist.get_rank(), self.ds_topology
        found = [None, None, None, None]
        for pipe in range(self.dims.pipeline_parallel):
            for model in range(self.dims.tensor_parallel):
                data = [t.get_rank(pipe=pipe, data=d, model=model) for d in range(dp)]
                for ranks, slot in [*[(data[i:i + ep], 0) for i in range(0, dp, ep)],
                                    *[(data[j::ep], 1) for j in range(ep)]]:
                    group = dist.new_group(ranks)
                    if me in ranks:
                        found[slot], found[slot + 2] = group, ranks
        return tuple(found)

    def _context_parallel_group(self, cp: int):
        """This rank's CP group (every rank creates every group, as torch.distributed requires)."""
        if cp == 1:
            from hybrid.parallel.collectives import SINGLE_RANK
            return SINGLE_RANK
        mine, me = None, dist.get_rank()
        t = self.ds_topology
        for pipe in range(self.dims.pipeline_parallel):
            for model in range(self.dims.tensor_parallel):
                for dp in range(self.dims.data_parallel):
                    ranks = [t.get_rank(pipe=pipe, data=dp * cp + c, model=model) for c in range(cp)]
                    group = dist.new_group(ranks)
                    if me in ranks:
                        mine = group
        return mine

    # -- sizes and ranks (from the layers' ParallelGroups: one place) ---------------------------
    @property
    def tp_world_size(self) -> int:
        return self.groups.tp.size

    @property
    def pp_world_size(self) -> int:
        return self.groups.pp.size

    @property
    def dp_world_size(self) -> int:
        return self.groups.dp.size

    @property
    def cp_world_size(self) -> int:
        return self.groups.cp.size

    @property
    def cp_rank(self) -> int:
        return self.groups.cp.rank

    @property
    def sequence_world_size(self) -> int:
        """Ranks holding parts of one sequence (CP or Ulysses)."""
        return self.groups.sequence_split

    @property
    def data_world_size(self) -> int:
        """Ranks that read different samples: DP (the gradient group, dp_*, is DP x CP)."""
        return self.dp_world_size // self.sequence_world_size

    @property
    def data_rank(self) -> int:
        return self.dp_rank // self.sequence_world_size

    @property
    def tp_rank(self) -> int:
        return self.groups.tp.rank

    @property
    def pp_rank(self) -> int:
        return self.groups.pp.rank

    @property
    def dp_rank(self) -> int:
        return self.groups.dp.rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_world_size - 1

    # -- groups ------------------------------------------------------------------------------
    @property
    def tp_group(self):
        return self.grid.get_tensor_model_parallel_group()

    @property
    def pp_group(self):
        return self.grid.get_pipe_parallel_group()

    @property
    def dp_group(self):
        return self.grid.get_data_parallel_group()

    @property
    def mpu(self):
        """The object DeepSpeed calls `mpu`."""
        return self.grid

    def __repr__(self) -> str:
        return (f"Topology(tp={self.tp_world_size}, cp={self.cp_world_size}, pp={self.pp_world_size}, "
                f"dp={self.data_world_size}, ep={self.dims.expert_parallel}; "
                f"rank tp={self.tp_rank} cp={self.cp_rank} pp={self.pp_rank} dp={self.data_rank})")
