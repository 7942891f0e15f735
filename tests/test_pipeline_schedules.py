"""Every pipeline schedule (1F1B, interleaved 1F1B, zero-bubble, ZB-V, DualPipeV: torch.distributed.pipelining
in the one runtime) with DeepSpeed's optimizer: the same mathematics as one rank.

- one iteration on CPU ranks: loss and every gradient equal the single-process model's (1e-5);
- launch/train.py, 8 iterations with clipping and a warmup+cosine schedule: losses and evaluation
  losses equal the one-rank run within 1e-5 relative (fp32, dropout off), at PP 2 with v = 2 (ZeRO-1 at
  DP 2), TP 2 x PP 2 with SP, zero-bubble, ZB-V (tied table on one
  rank), DualPipeV (untied);
- flags that cannot work end in one message (resume with dropout on: tests/test_training.py).
"""

import argparse

import pytest

from hybrid.errors import ConfigError
from checks.rank_pool import run_on_ranks
from checks.launch_helpers import ROOT, one_rank_runs, read_log, run
from tests.model_harness import CONFIGS, assemble_grads, batch, compare_grads, reference, scheduled_run
from tests.test_training import TINY, assert_same_losses

PP2 = ["--pipeline-model-parallel-size", 2]
ZERO1 = ["--deepspeed", "ds_configs/zero1.json"]
UNTIED = ["--untie-embeddings-and-output-weights"]
EVAL = ["--eval-iters", 2, "--eval-interval", 4]


@pytest.mark.slow
@pytest.mark.parametrize("model, schedule, virtual, tp, sp", [
    ("gpt2", "interleaved-1f1b", 2, 1, False),  # tied: table copies on ranks 0 and 1, gradients summed
    ("gpt2", "zero-bubble", 2, 1, False),
    ("llama", "zbv", 2, 1, False),
    ("gpt2", "dualpipev", 2, 1, False),  # tied table used by stages 0 and 3, both on rank 0
    ("llama", "interleaved-1f1b", 2, 2, True),
])
def test_one_iteration_loss_and_gradients_equal_one_rank(model, schedule, virtual, tp, sp):
    cfg = CONFIGS[model]
    data = batch(8, 16)
    ref_loss, _, ref_grads = reference(cfg, data)
    results = run_on_ranks(scheduled_run, tp * 2, cfg, tp, 2, data, schedule, virtual, micro_batches=4,
                           sequence_parallel=sp, timeout=240)
    for r in results:
        assert abs(r["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), (r["loss"], ref_loss)
    compare_grads(assemble_grads(results), ref_grads, cfg["vocab_size"], atol=1e-5)


# "pp2_v2_compiled" (PP 2, v 2, --torch-compile) passed too; cut for the suite's time (compiled layers are
# proven against eager in tests/test_device_and_step.py)
LAYOUTS = {
    "pp2_dp2_zero1_v2": (4, PP2 + ["--num-layers-per-virtual-pipeline-stage", 1, *ZERO1]),
    "tp2_pp2_sp_v2_zero1": (4, PP2 + ["--tensor-model-parallel-size", 2, "--sequence-parallel",
                                      "--num-virtual-stages-per-pipeline-rank", 2, *ZERO1]),
    "zero_bubble_pp2": (2, PP2 + ["--pipeline-schedule", "zero-bubble", "--num-virtual-stages-per-pipeline-rank", 2]),
    "zbv_pp2_zero1": (2, PP2 + ["--pipeline-schedule", "zbv", *ZERO1]),
    "dualpipev_pp2_untied": (2, PP2 + ["--pipeline-schedule", "dualpipev", *UNTIED]),
}


@pytest.fixture(scope="module")
def baseline(data, tmp_path_factory):
    return one_rank_runs(data, TINY + EVAL, UNTIED)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_losses_equal_one_rank(layout, data, baseline, tmp_path):
    nproc, flags = LAYOUTS[layout]
    log = tmp_path / "log.jsonl"
    proc = run("torchrun", nproc, TINY + EVAL + ["--data-path", data, "--log-json", log, *flags])
    records = [r for r in read_log(log) if "consumed_samples" in r]
    want = baseline(UNTIED[0] in flags)
    assert_same_losses([r["lm_loss"] for r in records], [r["lm_loss"] for r in want if "consumed_samples" in r])
    # evaluation (forward only through the same virtual stages) at iterations 4 and 8
    evaluations = [r["lm_loss"] for r in read_log(log) if "consumed_samples" not in r]
    expected = [r["lm_loss"] for r in want if "consumed_samples" not in r]
    assert len(evaluations) == len(expected) == 2
    assert all(abs(g - w) <= 1e-5 * abs(w) for g, w in zip(evaluations, expected)), (evaluations, expected)
    assert all(r["consumed_samples"] == 8 * r["iteration"] for r in records)
    assert all(r["grad_norm"] > 0 for r in records)
    schedule = ("interleaved-1f1b" if "--pipeline-schedule" not in flags
                else flags[flags.index("--pipeline-schedule") + 1])
    output = proc.stdout + proc.stderr
    assert f"PP=2 {schedule}" in output
    if ZERO1[1] in flags:  # DeepSpeed's ZeRO-1 optimizer holds the optimizer state, partitioned over DP
        assert "inside DeepSpeed's DeepSpeedZeroOptimizer" in output and "ZeRO-1" in output


def _flags(*extra, layers=4, pp=2):
    from hybrid.flags import build_parser
    from checks.launch_helpers import MERGES, VOCAB
    argv = ["--num-layers", str(layers), "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", "2", "--lr", "1e-3", "--vocab-file", VOCAB, "--merge-file", MERGES, "--mock-data",
            "--pipeline-model-parallel-size", str(pp), *map(str, extra)]
    return build_parser().parse_args(argv)


def _build(args: argparse.Namespace, world_size: int = 2):
    from hybrid.config import build_run_config
    return build_run_config(args, world_size, 8192)


def test_flags_resolve_megatron_spellings():
    run_config = _build(_flags("--num-layers-per-virtual-pipeline-stage", 1, layers=8))
    assert (run_config.pipeline.schedule, run_config.pipeline.virtual_stages) == ("interleaved-1f1b", 4)
    run_config = _build(_flags("--num-virtual-stages-per-pipeline-rank", 2))
    assert (run_config.pipeline.schedule, run_config.pipeline.virtual_stages) == ("interleaved-1f1b", 2)
    run_config = _build(_flags("--pipeline-schedule", "zbv"))
    assert (run_config.pipeline.schedule, run_config.pipeline.virtual_stages) == ("zbv", 2)
    assert _build(_flags()).pipeline.schedule == "1f1b"  # the default (torch's Schedule1F1B)
    assert _build(_flags()).pipeline.stage_layers == (2, 2)  # as DeepSpeed's PipelineModule divides the layers


@pytest.mark.parametrize("extra, layers, message", [
    (["--num-virtual-stages-per-pipeline-rank", 3], 4,
     "--num-layers 4 does not split into 2 pipeline ranks x 3 virtual stages = 6 stages"),
    (["--num-layers-per-virtual-pipeline-stage", 3], 4, "--num-layers 4 must be a multiple of"),
    (["--pipeline-schedule", "zbv", "--num-virtual-stages-per-pipeline-rank", 4], 8, "runs exactly 2 virtual stages"),
    (["--pipeline-schedule", "1f1b", "--num-virtual-stages-per-pipeline-rank", 2], 4,
     "use --pipeline-schedule interleaved-1f1b"),
    (["--pipeline-schedule", "interleaved-1f1b"], 4, "needs 2 or more virtual stages"),
    (["--pipeline-schedule", "zbv", "--global-batch-size", 2], 4, "at least as many micro-batches"),
    (["--pipeline-schedule", "dualpipev", "--global-batch-size", 6], 4, "dualpipev needs at least as many"),
    (["--pipeline-partition", "3,1,1"], 4, "expected 2 positive layer counts"),
])
def test_flags_that_cannot_work_are_refused_with_the_fix(extra, layers, message):
    with pytest.raises(ConfigError, match=".*") as error:
        _build(_flags(*extra, layers=layers))
    assert message in str(error.value), str(error.value)


@pytest.mark.slow
def test_bad_schedule_flags_end_in_one_message_and_exit_2(data):
    proc = run("torchrun", 2, TINY + ["--data-path", data, *PP2, "--num-virtual-stages-per-pipeline-rank", 3],
               check=False)
    assert proc.returncode != 0
    assert "error: --num-layers 4 does not split into 2 pipeline ranks x 3 virtual stages" in proc.stderr


@pytest.mark.slow
def test_plain_load_across_stage_layouts_names_the_difference_and_weights_convert(data, tmp_path):
    """A checkpoint of virtual stages: its weights read back (conversion's reader) equal a one-rank
    run's; a plain --load with one stage per rank (1f1b) is one message with the fix."""
    from hybrid.conversion.layout import read_hybrid
    from checks.rank_pool import assert_close
    one, staged = tmp_path / "one", tmp_path / "staged"
    short = ["--data-path", data, "--train-iters", 2]
    run("python", 1, TINY + short + ["--save", one])
    run("torchrun", 2, TINY + short + ["--save", staged, *PP2, "--num-virtual-stages-per-pipeline-rank", 2])
    want, _ = read_hybrid(str(one))
    got, meta = read_hybrid(str(staged))
    assert set(got) == set(want)
    for name in want:
        assert_close(got[name], want[name], 1e-6, name)
    assert meta["layout"]["pipeline_schedule"] == "interleaved-1f1b"
    # the check a plain --load makes (launched refusals: tests/test_universal_checkpoint.py)
    from hybrid.checkpoint.client_state import read_client_state
    from hybrid.training.resume import check_same_layout
    run_config = _build(_flags("--load", staged))
    with pytest.raises(ConfigError) as error:
        check_same_layout(read_client_state(str(staged), "iter_0000002"), run_config, str(staged), "iter_0000002")
    assert ("pipeline stages: 2 virtual per rank, loop placement (--pipeline-schedule interleaved-1f1b) (this run: "
            "one per rank (--pipeline-schedule 1f1b))") in str(error.value)
    assert "--saver universal" in str(error.value)


@pytest.mark.slow
def test_bubble_benchmark_measures_each_ranks_activations_as_planned(tmp_path):
    """benchmarks/pipeline_bubble.py (small: PP 2, 4 micro-batches), run as users run it: every schedule's measured
    peak of live activations per rank equals its own action order's and the estimator's; records are JSON."""
    import json
    import os
    import subprocess
    import sys
    from hybrid.memory import activations
    out = tmp_path / "records.jsonl"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "pipeline_bubble.py"), "--pp", "2",
                           "--micro-batches", "4", "--layer-ms", "2", "--steps", "1", "--json-out", str(out),
                           "--png", str(tmp_path / "chart.png")], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["schedule"] for r in records] == ["1f1b", "torch-1f1b", "interleaved-1f1b", "zero-bubble", "zbv",
                                                "dualpipev"]
    for r in records:
        assert r["peak_activations"] == r["planned_activations"], r
        name = "1f1b" if r["schedule"] == "torch-1f1b" else r["schedule"]
        estimated = [activations.in_flight_micro_batches(rank, 2, 4, name, r["virtual_stages"]) for rank in range(2)]
        assert max(estimated) == r["peak_activations"], r
        assert 0.0 <= r["idle_fraction"] < 1.0 and r["busy_over_expected"] >= 1.0, r
    assert (tmp_path / "chart.png").stat().st_size > 10_000
    assert '"benchmark": "pipeline_bubble_summary"' in proc.stdout
