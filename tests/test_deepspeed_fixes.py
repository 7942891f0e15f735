"""Every DeepSpeed and torch internal that hybrid.training.deepspeed_fixes and hybrid.torch_fixes rely on
still exists and still does what the fix assumes; and no other module of hybrid touches a private
attribute of DeepSpeed or torch."""

import contextlib
import ast
import importlib
import inspect
import os
import textwrap

import pytest

from hybrid import torch_fixes
from hybrid.training import deepspeed_fixes, deepspeed_internals

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("module, path, text", deepspeed_internals.RELIED_ON + torch_fixes.RELIED_ON,
                         ids=lambda x: str(x)[:60])
def test_relied_on_deepspeed_internal_is_there(module, path, text):
    target = importlib.import_module(module)
    for part in path.split("."):
        target = getattr(target, part)  # AttributeError: DeepSpeed (or torch) renamed or removed it
    # DeepSpeed's @instrument_w_nvtx wraps without functools.wraps: its one free variable is the function
    while getattr(getattr(target, "__code__", None), "co_name", None) == "wrapped_fn" and target.__closure__:
        target = target.__closure__[0].cell_contents
    assert text in inspect.getsource(target), (
        f"{module}.{path} no longer contains {text!r}: DeepSpeed or torch changed what hybrid's fixes rely on; "
        f"re-check that fix")


def test_the_installed_deepspeed_is_in_the_series_pyproject_allows_and_the_fixes_were_checked_against():
    import re

    import deepspeed
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    low, high = re.search(r'"deepspeed>=([\d.]+),<([\d.]+)"', pyproject).groups()
    version = tuple(int(x) for x in deepspeed.__version__.split("+")[0].split(".")[:3])
    assert tuple(map(int, low.split("."))) <= version < tuple(map(int, high.split(".")))
    assert all(known.startswith(".".join(low.split(".")[:2])) for known in deepspeed_fixes.KNOWN_GOOD_DEEPSPEED)


def _private_uses(path: str) -> list[str]:
    """`x._name` attribute accesses (not self./cls.) and `from m import _name` in one source file."""
    tree = ast.parse(open(path).read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls", "ctx"):
                continue
            found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} .{node.attr}")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("deepspeed", "torch")):
            found += [f"{os.path.relpath(path, ROOT)}:{node.lineno} import {a.name}" for a in node.names
                      if a.name.startswith("_")]
    return found


# Private accesses outside deepspeed_fixes that are not DeepSpeed's: torch's documented out= aten
# kernels, the aten CPU flash-attention kernel and its backward that F.scaled_dot_product_attention
# dispatches to (the ring needs their log-sum-exp; tests/test_context_parallel.py proves them against
# SDPA) and their CUDA twins (the ring's fused GPU kernels, flash and memory-efficient: the contract tests run
# them with CPU stand-ins in their place), torch's grouped GEMM (torch._grouped_mm: no public API in torch 2.13;
# torchtitan's and DeepSpeed
# AutoEP's expert kernel; tests/test_moe.py proves it against a per-expert loop), a tokenizers model's own
# parameters, torch's memory-snapshot API (torch.cuda.memory._record_memory_history / _dump_snapshot: the
# names torch documents in "Understanding CUDA Memory Usage"; Megatron-LM calls the same), numpy's array
# rebuild (multiarray._reconstruct: what torch's documentation allow-lists for weights_only loads of numpy
# arrays), and the fields of torchao's Float8TrainingTensor (its constructor's arguments, read to relabel
# a tensorwise scale as rowwise without casting again: tests/test_fp8.py proves it bitwise against torchao).
# Our own modules' private helpers: none.
ALLOWED = {".{}".format(name) for name in ("_log_softmax", "_softmax", "_params",
                                           "_scaled_dot_product_flash_attention_for_cpu",
                                           "_scaled_dot_product_flash_attention_for_cpu_backward", "_grouped_mm",
                                           "_scaled_dot_product_flash_attention",
                                           "_scaled_dot_product_flash_attention_backward",
                                           "_scaled_dot_product_efficient_attention",
                                           "_scaled_dot_product_efficient_attention_backward",
                                           "_record_memory_history", "_dump_snapshot", "_reconstruct")}
# names too common to allow everywhere: only in the one module that has a reason
ALLOWED_IN = {os.path.join("hybrid", "parallel", "fp8.py"): {"._data", "._scale", "._orig_dtype", "._linear_mm_config",
                                                             "._gemm_input_role"},
              # torch.optim.Muon's own Newton-Schulz iteration and learning-rate adjustment (no public function),
              # applied under ZeRO to the gathered matrices; tests/test_muon.py checks them bitwise against
              # torch.optim.Muon's step
              os.path.join("hybrid", "training", "muon.py"): {"import _adjust_lr",
                                                              "import _zeropower_via_newtonschulz"}}


# every fix of hybrid.training.deepspeed_fixes, by name: a new one (or one gone) fails here, and the architecture
# page's counts with it, so touching DeepSpeed's internals stays a visible decision
FIXES = ("release_engine", "runs_tensor_backward", "prepare_pipeline_engine", "loss_scale", "scaled_for_backward",
         "start_backward", "begin_accumulation", "step_on_gradient_partitions",
         "release_input_embedding_after_its_gradient", "ensure_reduction_buckets",
         "keep_host_activations_when_offloading", "install_fp32_clipping", "skip_one_rank_gradient_allreduce",
         "skip_non_finite_steps", "use_canonical_param_names", "load_table_blocks_from_universal",
         "repair_zero3_universal_load", "keep_run_clipping", "load_checkpoint", "replay_cpu_adam_steps",
         "use_async_checkpoint_engine", "register_moe_layers", "zero_partitions", "zero3_gathered_while_generating")


def test_the_fixes_and_the_relied_on_internals_are_the_listed_ones_and_the_architecture_page_counts_them():
    tree = ast.parse(open(deepspeed_fixes.__file__).read())
    public = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
    assert public == list(FIXES) == list(deepspeed_fixes.FIXES)  # each with its kind, versions and upstream link
    kinds = {"workaround", "speed", "memory", "adapter", "accessor"}
    assert all(kind in kinds and versions.endswith("0.19.8") for kind, versions, _ in deepspeed_fixes.FIXES.values())
    page = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    assert f"**{len(FIXES)} fixes**" in page and f"**{len(deepspeed_internals.RELIED_ON)} internals**" in page


def test_no_private_attribute_of_deepspeed_or_torch_outside_the_fixes_module():
    offenders = []
    for folder, _, files in os.walk(os.path.join(ROOT, "hybrid")):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path.endswith(os.path.join("training", "deepspeed_fixes.py")):
                continue
            allowed = ALLOWED | ALLOWED_IN.get(os.path.relpath(path, ROOT), set())
            for use in _private_uses(path):
                if use.split(" ", 1)[1] not in allowed:
                    offenders.append(use)
    # the remaining ones are hybrid's own private helpers called across its modules: none allowed either
    assert offenders == [], "private attributes touched outside training/deepspeed_fixes.py:\n" + "\n".join(offenders)


def test_fixes_module_says_why_for_each_fix():
    for module, library, version in ((deepspeed_fixes, "DeepSpeed", "0.19"), (torch_fixes, "torch", "2.13")):
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ == module.__name__ and not name.startswith("_"):
                doc = textwrap.dedent(fn.__doc__ or "")
                assert library in doc and version in doc, f"{name}: the docstring names the {library} version"


def test_no_test_helper_ships_in_the_package():
    assert not os.path.exists(os.path.join(ROOT, "hybrid", "testing.py"))


def _one_rank_allreduce_calls() -> list:
    """Which buckets skip_one_rank_gradient_allreduce hands on to DeepSpeed's allreduce_and_copy."""
    import types
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    singles = [dist.new_group([0]), dist.new_group([1])]
    own = singles[rank]
    calls = []
    engine = types.SimpleNamespace(gradient_average=True, predivide=1.0)
    engine.gradient_predivide_factor = lambda: engine.predivide
    engine.allreduce_and_copy = lambda bucket, group, size=None: calls.append(len(bucket))
    deepspeed_fixes.skip_one_rank_gradient_allreduce(engine)
    bucket = [torch.ones(3)]
    engine.allreduce_and_copy(bucket * 1, own)  # one rank, average over 1: skipped
    engine.allreduce_and_copy(bucket * 2, own, 2)  # one rank but divided by 2 (MoE expert groups): DeepSpeed's
    engine.allreduce_and_copy(bucket * 3, dist.group.WORLD)  # two ranks: DeepSpeed's
    engine.predivide = 2.0
    engine.allreduce_and_copy(bucket * 4, own)  # one rank with a pre/post-divide factor: DeepSpeed's
    engine.gradient_average = False
    engine.allreduce_and_copy(bucket * 5, own)  # a sum over one rank: skipped
    return calls


def test_gradients_are_not_copied_through_an_allreduce_of_one_rank():
    from checks.rank_pool import run_on_ranks
    assert run_on_ranks(_one_rank_allreduce_calls, 2) == [[2, 3, 4]] * 2


def _engines_and_gloo_threads_after_a_run(data: str, zero_config: str, pp: int = 2) -> tuple:
    """On a pool rank: one training by launch/train.py's entry, then the DeepSpeed engines it left alive and this
    process's gloo threads (the pool destroys the run's groups after the task: what stays is what a run leaked).
    Engines counted before and after the run: the rank may hold some from an earlier module's helpers."""
    import gc

    from deepspeed.runtime.engine import DeepSpeedEngine

    from hybrid.training.run import run_training
    from tests.test_training import TINY
    gc.collect()
    before = sum(isinstance(o, DeepSpeedEngine) for o in gc.get_objects())
    assert run_training([str(f) for f in TINY] + ["--data-path", data, "--train-iters", "2", "--deepspeed",
                                                  zero_config, "--pipeline-model-parallel-size", str(pp)]) == 0
    gc.collect()
    threads = sum(open(f"/proc/self/task/{t}/comm").read().startswith(("pt_gloo", "gloo"))
                  for t in os.listdir("/proc/self/task"))
    return sum(isinstance(o, DeepSpeedEngine) for o in gc.get_objects()) - before, threads


@pytest.mark.slow
@pytest.mark.parametrize("zero_config", ["ds_configs/zero1.json", "ds_configs/zero3.json"])
def test_a_finished_run_leaves_no_engine_and_no_group_threads_behind(data, zero_config):
    """release_engine: after a run no DeepSpeed engine survives (its gradient hooks, ZeRO-3's module stack and
    its coordinator's class-level cache kept them all, with their process groups: a pool rank reached 2,800
    gloo threads in the sweep), so a process that trains again holds one run's gloo threads, not every run's."""
    from checks.rank_pool import run_on_ranks
    per_run = [run_on_ranks(_engines_and_gloo_threads_after_a_run, 2, data, zero_config) for _ in range(3)]
    for rank in range(2):
        engines, threads = zip(*[results[rank] for results in per_run])
        # (from the second run on: DeepSpeed keeps the latest run's grid as its module-level mpu until the next)
        assert engines == (0, 0, 0) and threads[2] == threads[1], per_run
    # and a later run of one stage trains: ZeRO-3's module numbers start again from 0 on both ranks (the two
    # stages above had numbered different module counts; its trace check across ranks failed)
    assert [engines for engines, _ in run_on_ranks(_engines_and_gloo_threads_after_a_run, 2, data, zero_config,
                                                   1)] == [0, 0]


def _zero3_steps(precision: str, in_place: bool) -> dict:
    """On a pool rank: three ZeRO-3 steps (sub-groups of 100 elements: several step calls) of a small model,
    with or without step_on_gradient_partitions; the weights after them, and whether any sub-group's step
    flattened its gradient partitions (DeepSpeed's copy) or read them where they lie."""
    import deepspeed
    import torch

    from hybrid.parallel.groups import build_groups
    from hybrid.training.deepspeed_fixes import release_engine, step_on_gradient_partitions
    groups = build_groups()  # DP 2
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 24), torch.nn.GELU(),
                                torch.nn.Linear(24, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
              "zero_optimization": {"stage": 3, "sub_group_size": 100, "stage3_param_persistence_threshold": 0},
              "steps_per_print": 10 ** 9, **({"bf16": {"enabled": True}} if precision == "bf16" else {})}
    # torch's AdamW as the client optimizer, as hybrid's engine builds it (DeepSpeed's own would JIT-build an op)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=groups.mpu)
    if in_place:
        step_on_gradient_partitions(engine)
    optimizer = engine.optimizer
    flattened, shared = [], []
    flatten = optimizer.flatten
    optimizer.flatten = lambda tensors: flattened.append(len(tensors)) or flatten(tensors)
    step = optimizer._optimizer_step

    def watch(i):
        grad = optimizer.fp32_partitioned_groups_flat[i].grad
        flat = optimizer.grad_partitions_flat_buffer
        shared.append(grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr())
        return step(i)
    optimizer._optimizer_step = watch
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    generator = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    for _ in range(6):  # 3 steps of 2 micro-batches
        x = torch.randn(2, 16, generator=generator).to(dtype)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = [p.detach().float().clone() for p in engine.module.parameters()]
    sub_groups = len(optimizer.fp32_partitioned_groups_flat)
    release_engine(engine)
    return dict(weights=weights, flattened=len(flattened), shared=shared, sub_groups=sub_groups)


def _zero3_generation_collectives_and_linear() -> dict:
    """On a pool rank: a ZeRO-3 engine of 8 linear layers (16 parameters, 8 x 72 elements); inside
    zero3_gathered_while_generating, which F.linear runs, whether every parameter is gathered, the all-gathers it took
    and a forward beside the model's copy from before ZeRO-3 partitioned it; after it, the same; then a training
    step with the hooks back."""
    import copy

    import deepspeed
    import torch
    from deepspeed.comm import comm  # every ZeRO-3 all-gather goes through its backend's all_gather_into_tensor
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    from hybrid.parallel.groups import build_groups
    from hybrid.training.deepspeed_fixes import release_engine, zero3_gathered_while_generating
    groups = build_groups()  # DP 2
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[layer for _ in range(8) for layer in (torch.nn.Linear(8, 8), torch.nn.GELU())])
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
              "stage3_param_persistence_threshold": 0}, "steps_per_print": 10 ** 9}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=groups.mpu)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    out = {"before": torch.nn.functional.linear is zero3_linear_wrap}
    gathers = []
    gather = comm.cdb.all_gather_into_tensor
    comm.cdb.all_gather_into_tensor = lambda *a, **k: gathers.append(1) or gather(*a, **k)
    try:
        with zero3_gathered_while_generating(engine) as gathered:
            out.update(gathered=gathered, inside=torch.nn.functional.linear is zero3_linear_wrap,
                       available=all(p.ds_status.name == "AVAILABLE" for p in engine.module.parameters()),
                       gathers=len(gathers))
            with torch.inference_mode():
                out.update(decoded=engine.module(x).clone(), expected=reference(x))
    finally:
        comm.cdb.all_gather_into_tensor = gather
    out.update(after=torch.nn.functional.linear is zero3_linear_wrap,
               partitioned=all(p.ds_status.name == "NOT_AVAILABLE" for p in engine.module.parameters()))
    loss = engine(x).pow(2).mean()  # the hooks gather again for training
    engine.backward(loss)
    engine.step()
    release_engine(engine)
    return out


def test_zero3_generation_block_gathers_in_eighths_and_runs_torchs_linear():
    """zero3_gathered_while_generating: the stage's parameters gathered by flat all-gathers of at most an eighth of
    the stage each (here 8 for 16 parameters; GatheredParameters alone took one per parameter), torch's F.linear
    inside the block instead of ZeRO-3's zero3_linear_wrap (its autograd Function, a third of the decode time on
    CPU) and ZeRO-3's back after it, the parameters partitioned again, and a training step after."""
    import torch
    from checks.rank_pool import run_on_ranks
    for out in run_on_ranks(_zero3_generation_collectives_and_linear, 2):
        assert out["before"] and out["after"] and not out["inside"] and out["gathered"]
        assert out["available"] and out["partitioned"] and out["gathers"] == 8, out
        assert torch.equal(out["decoded"], out["expected"])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero3_steps_on_its_gradient_partitions_bitwise_as_deepspeed(precision):
    """step_on_gradient_partitions: ZeRO-3's step reads each sub-group's gradient partitions where they lie (fp32:
    the flat buffer itself; bf16: one fp32 conversion of its slice) instead of DeepSpeed's flattened copy, and the
    weights after three clipped, accumulated steps over several sub-groups are bitwise DeepSpeed's own."""
    import torch

    from checks.rank_pool import run_on_ranks
    ours, theirs = (run_on_ranks(_zero3_steps, 2, precision, in_place) for in_place in (True, False))
    for mine, deepspeeds in zip(ours, theirs):
        assert mine["sub_groups"] > 2 and deepspeeds["flattened"] >= 3 * mine["sub_groups"]
        assert mine["flattened"] == 0, "a sub-group's gradient partitions were still copied"
        # (DeepSpeed's flatten of a one-parameter sub-group is a view too; of the others, a copy)
        assert all(mine["shared"]) == (precision == "fp32") and not all(deepspeeds["shared"])
        assert all(torch.equal(a, b) for a, b in zip(mine["weights"], deepspeeds["weights"]))


def _zero3_embedding_release(release: bool, blocked: bool = False) -> dict:
    """On a pool rank: three ZeRO-3 steps of an embedding-first model, with or without
    release_input_embedding_after_its_gradient; the table's status (`blocked`: each of its three row blocks')
    each time ZeRO reduces its gradient, and the weights after the steps."""
    import deepspeed
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from hybrid.parallel.groups import build_groups
    from hybrid.parallel.layers import VocabParallelEmbedding, default_init
    from hybrid.training.deepspeed_fixes import release_engine, release_input_embedding_after_its_gradient
    class EmbeddingThenLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = (VocabParallelEmbedding(300, 16, groups, default_init(seed=3), block_rows=100)
                              if blocked else torch.nn.Embedding(300, 16))
            self.hidden = torch.nn.Linear(16, 16)
            self.head = torch.nn.Linear(16, 300, bias=False)

        def forward(self, ids):
            return self.head(self.hidden(self.embedding(ids)).tanh())

    groups = build_groups()
    torch.manual_seed(0)
    model = EmbeddingThenLinear()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "steps_per_print": 10 ** 9,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 1000}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=groups.mpu)
    tables = [block.weight for block in engine.module.embedding.blocks] if blocked else [engine.module.embedding.weight]
    statuses = []
    reduce = engine.optimizer.reduce_ready_partitions_and_remove_grads

    def watch(param, *args, **kwargs):
        if any(param is table for table in tables):
            statuses.append(param.ds_status == ZeroParamStatus.AVAILABLE)
        return reduce(param, *args, **kwargs)
    engine.optimizer.reduce_ready_partitions_and_remove_grads = watch
    if release:
        release_input_embedding_after_its_gradient(engine, engine.module.embedding)
    generator = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    for _ in range(6):
        ids = torch.randint(0, 300, (2, 8), generator=generator)
        loss = torch.nn.functional.cross_entropy(engine(ids).flatten(0, 1), ids.roll(1, 1).flatten())
        engine.backward(loss)
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = [p.detach().clone() for p in engine.module.parameters()]
    release_engine(engine)
    return dict(gathered_at_reduce=statuses, weights=weights)


def test_zero3_releases_the_input_embedding_before_reducing_its_gradient():
    """release_input_embedding_after_its_gradient: DeepSpeed keeps an embedding's gathered table (its input, ids,
    takes no gradient) until the backward ends, through its gradient's reduction; with the fix the table is
    released when its gradient reaches ZeRO (a table in row blocks: each block), and three accumulated, clipped
    steps are bitwise DeepSpeed's."""
    import torch

    from checks.rank_pool import run_on_ranks
    for blocked in (False, True):  # the table whole, and as ZeRO-3's row blocks (hybrid.parallel.layers.TableBlock)
        ours, theirs = (run_on_ranks(_zero3_embedding_release, 2, release, blocked) for release in (True, False))
        for mine, deepspeeds in zip(ours, theirs):
            assert len(mine["gathered_at_reduce"]) == (18 if blocked else 6) and all(deepspeeds["gathered_at_reduce"])
            assert not any(mine["gathered_at_reduce"])
            assert all(torch.equal(a, b) for a, b in zip(mine["weights"], deepspeeds["weights"]))


def _zero3_forwards_then_backwards(fixed: bool) -> dict:
    """On a pool rank: three ZeRO-3 iterations as a pipeline's first stage runs them (two micro-batches' forwards,
    then their two backwards: GPipe, or 1F1B's warmup and cooldown), each backward after start_backward (`fixed`)
    or after DeepSpeed's own per-backward reset alone; the most parameters gathered at once while ZeRO takes each
    backward's gradients, and the weights after the steps."""
    import deepspeed
    import torch
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from hybrid.parallel.groups import build_groups
    from hybrid.training.deepspeed_fixes import release_engine, start_backward
    groups = build_groups()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()) for _ in range(4)))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2000}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=config, mpu=groups.mpu)
    seen = []  # the parameters gathered each time ZeRO takes a gradient
    reduce = engine.optimizer.reduce_ready_partitions_and_remove_grads

    def watch(param, *args, **kwargs):
        seen.append(sum(p.ds_status == ZeroParamStatus.AVAILABLE for p in engine.module.parameters()))
        return reduce(param, *args, **kwargs)
    engine.optimizer.reduce_ready_partitions_and_remove_grads = watch
    generator = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    gathered = []  # the most gathered at once in each backward
    for _ in range(3):
        losses = [engine(torch.randn(2, 32, generator=generator)).square().mean() for _ in range(2)]
        for loss in losses:
            if fixed:
                start_backward(engine)
            else:
                ZeROOptimizer.clear_backward_seen_flag(engine.optimizer)
            seen.clear()
            loss.backward()
            gathered.append(max(seen))
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = [p.detach().clone() for p in engine.module.parameters()]
    release_engine(engine)
    return dict(gathered=gathered, weights=weights)


@pytest.mark.slow
def test_zero3_releases_each_module_in_every_backward_after_several_forwards():
    """start_backward: DeepSpeed sets a module's count of pending input gradients anew at each forward, so after
    two micro-batches' forwards only the first backward released the modules' gathered weights; the second held
    every module it reached gathered through its gradients' reduction (a layer-heavy pipeline stage: 0.14 GiB more
    at PP 2 x DP 2, benchmarks/bench_memory.py). With the fix each backward holds one module's weights at a time,
    and the steps are bitwise DeepSpeed's."""
    import torch

    from checks.rank_pool import run_on_ranks
    ours, theirs = (run_on_ranks(_zero3_forwards_then_backwards, 2, fixed) for fixed in (True, False))
    for mine, deepspeeds in zip(ours, theirs):
        assert mine["gathered"] == [2] * 6, mine["gathered"]  # one module's weight and bias at a time
        assert deepspeeds["gathered"] == [2, 8] * 3, deepspeeds["gathered"]  # the first module reached last
        assert all(torch.equal(a, b) for a, b in zip(mine["weights"], deepspeeds["weights"]))


def _zero3_generation_block(gather: bool):
    """A DP 2 ZeRO-3 engine: 2 steps, 4 forwards without gradients (inside zero3_gathered_while_generating with
    `gather`, else as ZeRO-3's hooks run them), 2 more steps; each forward's parameter statuses after it, the
    statuses after the block, the forwards' outputs and the final weights."""
    import deepspeed
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from hybrid.parallel.groups import build_groups
    from hybrid.training.deepspeed_fixes import release_engine, zero3_gathered_while_generating
    groups = build_groups()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 9,
              # (nothing kept gathered between modules, as in a model larger than a device)
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=config, mpu=groups.mpu)
    generator = torch.Generator().manual_seed(1 + torch.distributed.get_rank())

    def steps(n):
        for _ in range(n):
            x = torch.randn(2, 16, generator=generator)
            engine.backward((engine(x) - x).square().mean())
            engine.step()
    steps(2)
    available, outputs = [], []
    block = zero3_gathered_while_generating(engine) if gather else contextlib.nullcontext(False)
    with block as gathered, torch.no_grad():
        for _ in range(4):
            outputs.append(engine.module(torch.ones(1, 16)))
            available.append([p.ds_status == ZeroParamStatus.AVAILABLE for p in engine.module.parameters()])
    after = [p.ds_status == ZeroParamStatus.AVAILABLE for p in engine.module.parameters()]
    steps(2)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = [p.detach().clone() for p in engine.module.parameters()]
    release_engine(engine)
    return dict(gathered=gathered, available=available, after=after, outputs=outputs, weights=weights)


@pytest.mark.slow
def test_zero3_generation_keeps_the_stage_gathered_and_training_goes_on_as_without_it():
    """zero3_gathered_while_generating: inside the block every parameter stays gathered from forward to forward
    (ZeRO-3's hooks alone, with nothing kept live, release them after each module: a decoding step would gather
    every layer again); after it every parameter is partitioned again, and the forwards' outputs and two later
    training steps are bitwise those of a run whose forwards went through the hooks."""
    import torch

    from checks.rank_pool import run_on_ranks
    ours, hooks = (run_on_ranks(_zero3_generation_block, 2, gather) for gather in (True, False))
    for mine, theirs in zip(ours, hooks):
        assert mine["gathered"] and all(all(step) for step in mine["available"])
        assert not any(any(step) for step in theirs["available"])
        assert not any(mine["after"]) and not any(theirs["after"])
        assert all(torch.equal(a, b) for a, b in zip(mine["outputs"], theirs["outputs"]))
        assert all(torch.equal(a, b) for a, b in zip(mine["weights"], theirs["weights"]))
