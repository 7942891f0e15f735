"""What a GPU run needs, checked on CPU: every batch reaches the engine's device (a fake `meta`
device stands in for CUDA), the training step makes no host sync until it logs, compiled layers
give the eager losses (TP 1, TP 2 + SP), --use-flash-attn without flash-attn is a clear error, and
the optimizer is torch's fused AdamW (no JIT build)."""

import ctypes
import gc
import os

import pytest
import torch

from hybrid.config import build_run_config
from hybrid.flags import build_parser
from hybrid.data.gpt_dataset import MockGPTDataset
from hybrid.parallel.groups import ParallelGroups
from checks.rank_pool import run_on_ranks
from hybrid.training.loop import Trainer
from checks.launch_helpers import read_log, run

META = torch.device("meta")
SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "64", "--train-iters", "3", "--eval-iters", "2", "--no-progress-bar"]


class RecordingEngine:
    """Stands in for DeepSpeed's engine on a device the host cannot compute on: records the device of every
    tensor the runtime hands it."""

    def __init__(self):
        from hybrid.model.config import ModelConfig
        from hybrid.model.gpt import GPTModel
        self.device, self.seen, self.optimizer = META, [], None
        # what the runtime looks into (its stages, FP8 histories: none here); the engine computes nothing
        self.module = GPTModel(ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=64,
                                           max_position_embeddings=16))

    def _record(self, *tensors):
        for t in tensors:
            if isinstance(t, (tuple, list)):
                self._record(*t)
            elif t is not None:
                self.seen.append(t.device)

    def __call__(self, ids, stage=0, batch_ids=None):
        self._record(ids, batch_ids)
        return ids  # the recording objective takes it for logits

    def backward(self, loss):
        pass

    def step(self):
        pass

    def eval(self):
        pass

    def train(self):
        pass

    def get_lr(self):
        return [0.1]

    def gradient_accumulation_steps(self):
        return self.gas


class RecordingObjective:
    """Stands in for the run's objective: records the device of every target and scale the runtime makes, and
    gives a host loss (the engine's device cannot compute one)."""

    name, per_item = "recording", True

    def __init__(self, engine):
        self.engine = engine

    def target(self, ids, labels, extra=()):
        self.engine._record(ids, labels)
        return labels

    def count(self, ids, labels):
        self.engine._record(ids, labels)
        return torch.ones((), device=META)

    def model_inputs(self, extra=()):
        return {}  # (the language model's micro-batches give the forward nothing beside the ids)

    def sequence_factor(self, split):
        return split

    def loss(self, logits, target, scale):
        self.engine._record(logits, target, scale)
        return torch.tensor(2.0)

    def metrics(self, groups=None, device=None):
        return {}

    def discard_pending(self):
        return []

    def restore_pending(self, pending):
        pass


def test_training_and_evaluation_batches_reach_the_engine_device(tmp_path, monkeypatch):
    from hybrid.training import loop
    run = build_run_config(build_parser().parse_args(SMALL + ["--eod-mask-loss"]), 1, 64)
    run.logging.log_json = str(tmp_path / "log.jsonl")
    engine = RecordingEngine()
    engine.gas = run.training.grad_acc_steps
    monkeypatch.setattr(loop, "objective_for", lambda *args, **kwargs: RecordingObjective(engine))
    datasets = [MockGPTDataset(64, 16, 64, seed) for seed in (1, 2, 3)]
    Trainer(run, ParallelGroups.single(), engine, datasets, eod_token=63).train(0, 0)
    assert len(engine.seen) > 3 * 2 * 2 + 2 * 2 * 2  # every micro-batch of 3 iterations and the evaluation
    assert set(engine.seen) == {META}, f"tensors left on the host: {engine.seen}"
    assert [r["iteration"] for r in read_log(run.logging.log_json) if "consumed_samples" in r] == [3]


def test_a_pipeline_hands_its_schedule_only_device_tensors():
    """PP > 1: what the runtime gives torch's schedule (the micro-batches' ids and targets, joined) stays on the
    engine's device (the schedule itself is torch's; its sends use the tensors it is handed)."""
    from types import SimpleNamespace

    from hybrid.training.pipeline_stages import PipelineSchedules
    seen = []

    class Schedule:
        def step(self, *args, **kwargs):
            seen.extend([a.device for a in args] + [v.device for v in kwargs.values() if torch.is_tensor(v)])

    class Tied:
        def sync_once(self):
            pass

        def begin(self, n):
            pass

        def end(self):
            pass

        def sync(self):
            pass

    engine = RecordingEngine()
    engine.optimizer = SimpleNamespace()
    engine.zero_optimization_stage = lambda: 0
    engine.fp16_enabled = lambda: False
    objective = RecordingObjective(engine)
    runtime = SimpleNamespace(engine=engine, tied=Tied(), objective=objective, device=META,
                              model=SimpleNamespace(config=SimpleNamespace(splits_documents=True,
                                                                           stages_take_ids=True)))
    pipeline = PipelineSchedules.__new__(PipelineSchedules)
    pipeline.runtime, pipeline.schedule, pipeline.has_first, pipeline.has_last = runtime, Schedule(), True, True
    micro = [(torch.zeros(2, 16, dtype=torch.long, device=META), torch.zeros(2, 16, dtype=torch.long, device=META))
             for _ in range(4)]
    pipeline.train(micro, None)
    assert len(seen) == 3 and set(seen) == {META}  # ids, target, batch ids
    assert set(engine.seen) == {META}


def _count_host_syncs(iterations, extra=()):
    """Build a real one-rank engine and count host syncs made from hybrid's own code during
    training iterations (no logging) and then at the log point."""
    import inspect

    from hybrid.parallel.groups import build_groups
    from hybrid.parallel.random import model_parallel_seed
    from hybrid.training.engine import build_engine
    from hybrid.training.reduction import reduce_interval
    run = build_run_config(build_parser().parse_args(SMALL + ["--clip-grad", "0.5", *extra]), 1, 64)
    topology = build_groups()
    model_parallel_seed(1, 0)
    engine, _ = build_engine(run, topology)
    trainer = Trainer(run, topology, engine, (MockGPTDataset(64, 16, 64, 1), None, None))
    batches = trainer._batches(trainer.train_ds, 0)
    syncs = []
    hybrid_dir = os.path.dirname(os.path.dirname(os.path.abspath(inspect.getfile(Trainer))))
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__float__", "__bool__", "cpu")}

    def recording(name):
        def method(self, *args, **kwargs):
            caller = inspect.stack()[1].filename
            if caller.startswith(hybrid_dir) and not caller.endswith("testing.py"):
                syncs.append(f"{name} from {os.path.basename(caller)}")
            return originals[name](self, *args, **kwargs)
        return method

    for name in originals:
        setattr(torch.Tensor, name, recording(name))
    try:
        # as the training loop: the step, then the device-side finiteness of its gradient norm
        pending = [(trainer.step.train(batches), trainer.health.norm_finite()) for _ in range(iterations)]
        during = list(syncs)
        values = reduce_interval(trainer.step, [loss for loss, _ in pending], [ok for _, ok in pending])[:iterations]
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
    clipped_norm = float(engine.get_global_grad_norm())
    from hybrid.training.deepspeed_fixes import release_engine  # (the pool's ranks serve later modules)
    release_engine(engine)
    return during, syncs[len(during):], values, clipped_norm


@pytest.mark.parametrize("extra", [[], ["--calculate-per-token-loss"]], ids=["micro_batch_mean", "per_token"])
def test_training_iterations_make_no_host_sync_until_logged(extra):
    during, at_log, values, grad_norm = run_on_ranks(_count_host_syncs, 1, 3, extra)[0]
    assert during == [], f"host syncs inside training iterations: {during}"
    assert len(at_log) == 1 and len(values) == 3, at_log  # one transfer for the whole interval
    assert all(v > 0 for v in values) and grad_norm > 0


def _losses(log):
    return [r["lm_loss"] for r in read_log(log) if "consumed_samples" in r]


TINY_RUN = ["--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4, "--seq-length", 32,
            "--micro-batch-size", 2, "--global-batch-size", 4, "--train-iters", 3, "--log-interval", 1,
            "--eval-iters", 0, "--hidden-dropout", 0, "--attention-dropout", 0, "--no-progress-bar",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", 500]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compiled_layers_give_the_eager_losses_at_tp1_and_tp2_with_sp(tmp_path):
    eager = tmp_path / "eager.jsonl"
    proc = run("python", 1, TINY_RUN + ["--log-json", eager])
    assert "torch.optim.AdamW (fused)" in proc.stdout, "torch's fused AdamW is the default optimizer"
    want = _losses(eager)
    for name, launcher, nproc, extra in (("tp1", "python", 1, []),
                                         ("tp2_sp", "torchrun", 2, ["--tensor-model-parallel-size", 2,
                                                                    "--sequence-parallel"])):
        log = tmp_path / f"compiled_{name}.jsonl"
        run(launcher, nproc, TINY_RUN + extra + ["--torch-compile", "--log-json", log])
        got = _losses(log)
        assert len(got) == len(want) == 3
        for i, (g, w) in enumerate(zip(got, want)):
            assert abs(g - w) <= 1e-5 * abs(w), f"{name} iteration {i + 1}: compiled {g} vs eager {w}"


@pytest.mark.slow
def test_compile_with_zero3_and_flash_attn_without_flash_attn_are_clear_errors():
    proc = run("python", 1, TINY_RUN + ["--use-flash-attn"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--use-flash-attn" in proc.stderr and "SDPA" in proc.stderr and "pip install" in proc.stderr
    proc = run("python", 1, TINY_RUN + ["--torch-compile", "--deepspeed", "ds_configs/zero3.json"], check=False)
    assert proc.returncode == 2 and "--torch-compile with ZeRO-3" in proc.stderr


def test_dropout_free_attention_does_not_fork_the_rng(monkeypatch):
    """With dropout 0 the TP RNG fork (which copies generator states) is skipped."""
    from hybrid.model import attention
    from hybrid.model.config import ModelConfig
    calls = []
    monkeypatch.setattr(attention, "fork_tp_rng", lambda: calls.append("forked"))
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64,
                         max_position_embeddings=8, attention_dropout=0.0, hidden_dropout=0.0)
    core = attention.CoreAttention(config, 0).train()
    q = torch.randn(8, 2, 4, 8)
    core(q, q, q)
    assert calls == []


def _zero3_construction_memory():
    """Peak resident memory of building the model under ZeRO-3 at DP = 2, and the model's fp32 bytes."""
    from hybrid.parallel.groups import build_groups
    from hybrid.parallel.random import model_parallel_seed
    from hybrid.training.engine import build_model
    # 16 layers: the largest parameter (the 8000-row table) is 7% of the model
    flags = ["--num-layers", "16", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "64",
             "--micro-batch-size", "1", "--global-batch-size", "2", "--mock-data", "--tokenizer-type",
             "NullTokenizer", "--vocab-size", "8000", "--deepspeed", "ds_configs/zero3.json"]
    os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # glibc serves allocations of 64 KiB and more (every tensor here) from their own mappings, unmapped when
    # freed, so the resident set follows the live tensors instead of what the allocator keeps (M_MMAP_THRESHOLD)
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)
    topology = build_groups()
    model_parallel_seed(1, 0)
    # A first, tiny build loads what a first build loads once (DeepSpeed's JIT-built communication op on a
    # fresh machine, its modules, the groups), so the peak below is the model's alone.
    small = {"--num-layers": "1", "--hidden-size": "64"}
    tiny = [small.get(flags[i - 1], f) if i else f for i, f in enumerate(flags)]
    build_model(build_run_config(build_parser().parse_args(tiny), 2, 8001), topology)
    run = build_run_config(build_parser().parse_args(flags), 2, 8001)

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))
    peaks = []
    for _ in range(3):  # resident-size peaks are noisy (allocator, gloo threads): the lowest of three builds
        model = None
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed pages back, so the next build's peak is its own
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current resident size
        before = status("VmRSS:")
        model = build_model(run, topology)
        peaks.append(status("VmHWM:") - before)
    peak = min(peaks)
    full = sum(p.ds_numel for p in model.parameters()) * 4
    local = sum(p.ds_tensor.numel() for p in model.parameters()) * 4
    return peak, full, local


@pytest.mark.slow
def test_zero3_builds_each_rank_a_partition_not_the_whole_model():
    for peak, full, local in run_on_ranks(_zero3_construction_memory, 2):
        assert abs(local - full / 2) <= 0.01 * full, "each rank keeps half of the parameters"
        # half the parameters plus the largest one's full tensor while it is initialised (measured: 0.519-0.521x
        # over 5 runs of 3 builds each; building the whole model is 1x)
        assert peak < 0.6 * full, f"building the model peaked at {peak / 2**20:.0f} MiB of {full / 2**20:.0f} MiB"


def test_peak_tflops_comes_from_the_gpu_name_and_precision(monkeypatch):
    from hybrid.training.metrics import device_peak_tflops
    assert device_peak_tflops(torch.device("cpu"), "bf16", False) is None
    names = iter(["NVIDIA H200", "NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB",
                  "NVIDIA A100-SXM4-80GB", "Some Future GPU"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: next(names))
    cuda = torch.device("cuda", 0)
    assert device_peak_tflops(cuda, "bf16", True) == 1978.9  # FP8 GEMMs: the FP8 peak
    assert device_peak_tflops(cuda, "bf16", False) == 756.0  # the PCIe card before the plain H100
    assert device_peak_tflops(cuda, "fp32", False) == 494.7  # fp32 runs TF32 GEMMs
    assert device_peak_tflops(cuda, "fp16", False) == 312.0
    assert device_peak_tflops(cuda, "bf16", True) is None  # no FP8 on an A100
    assert device_peak_tflops(cuda, "bf16", False) is None  # unknown: --peak-tflops gives it
    # whole words only: a GPU whose name contains a table entry's letters is not that GPU
    for name, want in [("NVIDIA L40", None), ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.1), ("NVIDIA GB200", None),
                       ("NVIDIA B200", 2250.0), ("NVIDIA GH200 480GB", 989.4), ("NVIDIA H100 NVL", 835.0),
                       ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA H800", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert device_peak_tflops(cuda, "bf16", False) == want, name


def test_cpu_ranks_share_the_cores_unless_omp_num_threads_is_set(monkeypatch):
    import os
    from hybrid.distributed import share_cpu_cores
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's
        assert share_cpu_cores() == max(1, cores // 2) == torch.get_num_threads()
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        monkeypatch.setenv("LOCAL_SIZE", str(cores * 2))  # DeepSpeed's launcher's; more ranks than cores
        assert share_cpu_cores() == 1 == torch.get_num_threads()
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stands
        torch.set_num_threads(before)
        assert share_cpu_cores() is None and torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_the_loop_calls_its_features_around_each_iteration_in_order_and_says_whether_it_stepped():
    """MoE, FP8 and profiling act through hybrid.training.features: before an iteration in the list's order, after
    it in reverse (the profiler innermost), told whether DeepSpeed took the step; a run without the features has
    none."""
    from types import SimpleNamespace

    from hybrid.training.features import loop_features
    calls, skip = [], [0]

    class Recorder:
        def __init__(self, name):
            self.name = name

        def before_iteration(self, done, micro_batches):
            calls.append((self.name, "before", done, micro_batches))

        def after_iteration(self, done, stepped):
            calls.append((self.name, "after", done, stepped))

    engine = SimpleNamespace(get_lr=lambda: [0.1], skipped_steps=0)

    def train(batches):
        calls.append(("train",))
        engine.skipped_steps += skip[0]
        return torch.tensor(1.0)
    trainer = Trainer.__new__(Trainer)
    trainer.engine, trainer.step = engine, SimpleNamespace(train=train, micro_batches=4)
    trainer.health, trainer.skipped = SimpleNamespace(norm_finite=lambda: True), 0
    trainer.features = [Recorder("first"), Recorder("second")]
    trainer._iteration(None, 5)
    assert calls == [("first", "before", 5, 4), ("second", "before", 5, 4), ("train",),
                     ("second", "after", 5, True), ("first", "after", 5, True)]
    calls.clear()
    skip[0] = 1  # DeepSpeed skipped this step (fp16 overflow, a non-finite gradient norm)
    trainer._iteration(None, 6)
    assert calls[-2:] == [("second", "after", 6, False), ("first", "after", 6, False)] and trainer.skipped == 1
    plain = SimpleNamespace(model=SimpleNamespace(num_experts=None, fp8_recipe=None, dsa_indexer_loss_coeff=0.0),
                            logging=SimpleNamespace(profile=None))
    assert loop_features(plain, None, torch.nn.Linear(1, 1), torch.device("cpu")) == []
