"""The parallel layout: Megatron rank order, every axis named by use, DeepSpeed's mpu API, clear errors."""

import pytest
import torch

from hybrid.errors import ConfigError
from checks.rank_pool import run_on_ranks
from hybrid.parallel.dims import ParallelDims


def test_parallel_groups_carry_sizes_and_build_shapes_without_ranks():
    """A TP-2 rank's shards are built in one process (ParallelGroups.shapes_only); their collectives refuse."""
    from hybrid.model.config import ModelConfig
    from hybrid.model.gpt import GPTModel
    from hybrid.parallel.groups import ParallelGroups
    from tests.model_harness import CONFIGS
    groups = ParallelGroups.shapes_only(tp=2, tp_rank=1)
    assert (groups.tp_size, groups.tp_rank, groups.cp.size, groups.ep.size) == (2, 1, 1, 1)
    model = GPTModel(ModelConfig(**CONFIGS["llama"]), groups)
    assert model.layers[0].attention.qkv.weight.shape[0] == (4 + 2 * 2) * 8 // 2  # (heads + 2 groups) x d / TP
    with pytest.raises(RuntimeError, match="shapes_only"):
        model(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"--context-parallel-size \(2\)"):
        ParallelDims(world_size=6, tensor_parallel=2, context_parallel=2)
    assert ParallelDims(world_size=8, tensor_parallel=2, context_parallel=2).data_parallel == 2
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 3 does not divide"):
        ParallelDims(world_size=4, expert_parallel=3)


def test_world_size_not_multiple_of_tp_times_pp_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"world size 6 .*--tensor-model-parallel-size \(4\)"):
        ParallelDims(world_size=6, tensor_parallel=4)
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size"):
        ParallelDims(world_size=4, tensor_parallel=1, pipeline_parallel=0)
    assert ParallelDims(world_size=8, tensor_parallel=2, pipeline_parallel=2).data_parallel == 2


def _describe(tp, pp):
    import torch
    import torch.distributed as dist
    from hybrid.parallel.groups import build_groups
    groups = build_groups(tensor_parallel=tp, pipeline_parallel=pp)
    mpu = groups.mpu
    # the group objects must contain the ranks the grid claims
    t = torch.tensor([dist.get_rank()], dtype=torch.float32)
    dist.all_reduce(t, group=groups.tp.group)
    return dict(rank=dist.get_rank(), tp=groups.tp.rank, pp=groups.pp.rank, dp=groups.dp.rank,
                dp_world=mpu.get_data_parallel_world_size(), tp_world=mpu.get_tensor_model_parallel_world_size(),
                tp_sum=t.item(), first=groups.pp.first, last=groups.pp.last,
                has_tp_group=mpu.get_tensor_model_parallel_group() is mpu.get_slice_parallel_group())


@pytest.mark.slow
def test_topology_groups_on_four_ranks_tp2_pp2():
    out = run_on_ranks(_describe, 4, 2, 2)
    assert [(o["tp"], o["pp"], o["dp"]) for o in out] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert [o["tp_sum"] for o in out] == [1, 1, 5, 5]
    assert [o["first"] for o in out] == [True, True, False, False]
    assert all(o["has_tp_group"] and o["tp_world"] == 2 and o["dp_world"] == 1 for o in out)


def test_topology_groups_on_four_ranks_tp2_dp2():
    out = run_on_ranks(_describe, 4, 2, 1)
    assert [(o["tp"], o["dp"]) for o in out] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert all(o["dp_world"] == 2 and o["first"] and o["last"] for o in out)


def test_distributed_backend_flag_is_honoured(capsys, monkeypatch):
    from hybrid.distributed import default_backend, resolve_backend
    monkeypatch.setenv("RANK", "0")
    assert resolve_backend("gloo") == "gloo"
    assert resolve_backend(None) == ("nccl" if torch.cuda.is_available() else "gloo") == default_backend()
    if not torch.cuda.is_available():
        assert resolve_backend("nccl") == "gloo"
        assert "no CUDA device here, using gloo" in capsys.readouterr().out
