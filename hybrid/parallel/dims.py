"""The degrees of parallelism of a run, validated against the world size before any group is built,
and every size derived from them, declared once (torchtitan's ParallelDims).

Rank order (Megatron-LM's): TP varies fastest, then the sequence split (CP or Ulysses), then DP, then
PP. The axes are named by what they are used for, as megatron-core names its process groups:
- `dp`: ranks that read different samples;
- `dp_cp`: DP x the sequence split: the ranks over which gradients are averaged and ZeRO partitions
  (DeepSpeed's data-parallel axis; CP ranks hold different tokens of the same samples);
- `ep`: experts split over EP consecutive ranks of the DP x CP axis; `edp` (DP x CP / EP): the ranks
  holding the same experts, over which expert gradients are averaged.
Pure: no torch.distributed, no DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.capabilities import Setup, check
from hybrid.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism, validated against the world size before any group is built."""

    world_size: int  # number of ranks in the job
    tensor_parallel: int = 1  # --tensor-model-parallel-size
    pipeline_parallel: int = 1  # --pipeline-model-parallel-size
    context_parallel: int = 1  # --context-parallel-size: the sequence split over CP ranks (ring attention)
    ulysses: int = 1  # --ds-sequence-parallel-size: the sequence split over ranks, all-to-all around attention
    expert_parallel: int = 1  # --expert-model-parallel-size: experts split over EP consecutive DP x CP ranks

    def __post_init__(self):
        for name, value in (("--tensor-model-parallel-size", self.tensor_parallel),
                            ("--pipeline-model-parallel-size", self.pipeline_parallel),
                            ("--context-parallel-size", self.context_parallel),
                            ("--ds-sequence-parallel-size", self.ulysses),
                            ("--expert-model-parallel-size", self.expert_parallel)):
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}.")
        check(Setup(cp=self.context_parallel, ulysses=self.ulysses), only=("cp-ulysses",))
        model_parallel = self.tensor_parallel * self.sequence_split * self.pipeline_parallel
        if self.world_size % model_parallel != 0:
            split = (f"--ds-sequence-parallel-size ({self.ulysses})" if self.ulysses > 1
                     else f"--context-parallel-size ({self.context_parallel})")
            raise ConfigError(
                f"world size {self.world_size} is not a multiple of --tensor-model-parallel-size "
                f"({self.tensor_parallel}) x {split} x "
                f"--pipeline-model-parallel-size ({self.pipeline_parallel}) = {model_parallel}; launch a "
                f"multiple of {model_parallel} ranks or change the sizes.")
        if self.dp_cp % self.expert_parallel != 0:
            raise ConfigError(f"--expert-model-parallel-size {self.expert_parallel} does not divide the "
                              f"data-parallel size {self.dp_cp} (experts are split inside DP"
                              f"{' x CP' if self.sequence_split > 1 else ''}).")

    @property
    def sequence_split(self) -> int:
        """Ranks that hold parts of one sequence (CP or Ulysses; at most one of them is > 1)."""
        return self.context_parallel * self.ulysses

    @property
    def data_parallel(self) -> int:
        """DP: the ranks reading different samples (what is left of the world after TP, the sequence
        split and PP)."""
        return self.world_size // (self.tensor_parallel * self.sequence_split * self.pipeline_parallel)

    @property
    def dp_cp(self) -> int:
        """DP x the sequence split: gradients are averaged and ZeRO partitions over these ranks."""
        return self.data_parallel * self.sequence_split

    @property
    def expert_data_parallel(self) -> int:
        """EDP: the ranks of the DP x CP axis holding the same experts."""
        return self.dp_cp // self.expert_parallel
