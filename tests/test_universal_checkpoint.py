"""Universal checkpoints, the DeepSpeed way: DeepSpeed's own ds_to_universal (strict mode) converts what
launch/train.py saves, and `--load DIR --universal-checkpoint` resumes at another TP/PP/DP/ZeRO layout
with optimizer state, LR schedule, iteration and consumed samples: iterations 5-8 equal the
uninterrupted one-rank run within 1e-5 (fp32, dropout off). Plain loads at another layout end in one
message naming what differs and the fix. ZeRO-3 checkpoints at TP 2 and TP 1 consolidate to HuggingFace."""

import os
import re

import pytest

from checks.launch_helpers import one_rank_runs, read_log, run
from tests.test_training import TINY, assert_same_losses

UNTIED = ["--untie-embeddings-and-output-weights"]

# (source launcher, ranks, flags) -> (target launcher, ranks, flags)
# trimmed for the suite's time (each passed when removed): dp2_zero3_to_tp2_zero1 (pp2_dp2_zero3_untied_to_tp2_zero1 and
# dp2_to_dp1_zero3), tp2_to_tp1_dp2 (TP changes stay in
# tp2_pp2_to_tp1_pp2_dp2), dp2_zero2_to_tp2_zero1 (dp2_zero3_to_tp2_zero1), tp2_zero0_to_dp2_zero2
# (pp2_zero0_to_pp1_zero1),
# deepspeed_1f1b_pp2_to_interleaved_pp2_dp2 (interleaved_pp2_v2_to_pp1 and tp2_to_zbv_pp2)
CASES = {
    "dp2_to_dp1_zero3": (("torchrun", 2, ["--deepspeed", "ds_configs/zero3.json"]),
                         ("python", 1, ["--deepspeed", "ds_configs/zero3.json"])),
    # ZeRO-3 under a pipeline (the one runtime) to TP 2 with ZeRO-1, the optimizer kept; untied, so ZeRO-3 holds
    # both vocabulary tables as row blocks (ModelConfig.zero3_vocab_block_rows), joined into the tables here
    "pp2_dp2_zero3_untied_to_tp2_zero1": (("torchrun", 4, ["--pipeline-model-parallel-size", 2, "--deepspeed",
                                                           "ds_configs/zero3.json", *UNTIED]),
                                          ("torchrun", 2, ["--tensor-model-parallel-size", 2, "--deepspeed",
                                                           "ds_configs/zero1.json", *UNTIED])),
    # and the tables split into the blocks of a ZeRO-3 run from a universal checkpoint, padding rows in the last
    "tp2_zero1_to_dp2_zero3_untied_padded_vocab": (
        ("torchrun", 2, ["--tensor-model-parallel-size", 2, "--deepspeed", "ds_configs/zero1.json",
                         "--make-vocab-size-divisible-by", 60, *UNTIED]),
        ("torchrun", 2, ["--deepspeed", "ds_configs/zero3.json", "--make-vocab-size-divisible-by", 60, *UNTIED])),
    # no ZeRO (fp32): converted here, DeepSpeed's tool reads ZeRO partitions only
    "pp2_zero0_to_pp1_zero1": (("torchrun", 2, ["--pipeline-model-parallel-size", 2]),
                               ("python", 1, ["--deepspeed", "ds_configs/zero1.json"])),
    "pp2_to_pp1_untied": (("torchrun", 2, ["--pipeline-model-parallel-size", 2, "--deepspeed", "ds_configs/zero1.json",
                                           *UNTIED]),
                          ("python", 1, ["--deepspeed", "ds_configs/zero1.json", *UNTIED])),
    "tp2_pp2_to_tp1_pp2_dp2": (
        ("torchrun", 4, ["--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2, "--deepspeed",
                         "ds_configs/zero1.json"]),
        ("torchrun", 4, ["--pipeline-model-parallel-size", 2, "--deepspeed", "ds_configs/zero1.json"])),
    # virtual pipeline stages (torch.distributed.pipelining schedules) to and from other layouts
    "interleaved_pp2_v2_to_pp1": (
        ("torchrun", 2, ["--pipeline-model-parallel-size", 2, "--num-virtual-stages-per-pipeline-rank", 2,
                         "--deepspeed", "ds_configs/zero1.json"]),
        ("python", 1, ["--deepspeed", "ds_configs/zero1.json"])),
    "tp2_to_zbv_pp2": (("torchrun", 2, ["--tensor-model-parallel-size", 2, "--deepspeed", "ds_configs/zero1.json"]),
                       ("torchrun", 2, ["--pipeline-model-parallel-size", 2, "--pipeline-schedule", "zbv",
                                        "--deepspeed", "ds_configs/zero1.json"])),
    # context parallelism: DeepSpeed's data-parallel world is DP x CP, so CP ranks hold ZeRO partitions
    "cp2_zero1_to_cp1": (("torchrun", 2, ["--context-parallel-size", 2, "--deepspeed", "ds_configs/zero1.json"]),
                         ("python", 1, ["--deepspeed", "ds_configs/zero1.json"])),
}


@pytest.fixture(scope="module")
def baseline(data, tmp_path_factory):
    """The uninterrupted one-rank losses, tied and untied."""
    return one_rank_runs(data, TINY, UNTIED)


def _save_4(data, ckpt, launcher, nproc, flags, log):
    run(launcher, nproc, TINY + ["--data-path", data, "--save", ckpt, "--save-interval", 4, "--exit-interval", 4,
                                 "--log-json", log, *flags])


def _to_universal(ckpt):
    """conversion/checkpoint_util.py --saver universal, in this process (DeepSpeed's ds_to_universal still
    runs in its own)."""
    from hybrid.conversion.checkpoint_util import main
    assert main(["--saver", "universal", "--load-dir", str(ckpt), "--no-progress-bar"]) == 0


@pytest.fixture(scope="module")
def universal_sources(data, tmp_path_factory):
    """`get(launcher, ranks, flags)` -> (checkpoint directory saved at iteration 4 and made universal, its
    log of iterations 1-4); each source layout saved and converted once for every case that starts from it
    (the resumed runs only read it)."""
    cache = {}

    def get(launcher, nproc, flags):
        key = (launcher, nproc, tuple(map(str, flags)))
        if key not in cache:
            directory = tmp_path_factory.mktemp("source")
            ckpt, log = directory / "ckpt", directory / "log.jsonl"
            _save_4(data, ckpt, launcher, nproc, flags, log)
            _to_universal(ckpt)
            cache[key] = ckpt, log.read_text()
        return cache[key]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_universal_checkpoint_resumes_at_another_layout_with_the_uninterrupted_losses(case, data, baseline,
                                                                                    universal_sources, tmp_path):
    (src_launcher, src_n, src_flags), (dst_launcher, dst_n, dst_flags) = CASES[case]
    ckpt, source_log = universal_sources(src_launcher, src_n, src_flags)
    log = tmp_path / "log.jsonl"
    log.write_text(source_log)  # iterations 1-4 as the source run logged them
    assert (ckpt / "latest_universal").read_text() == "iter_0000004_universal"
    assert (ckpt / "iter_0000004_universal" / "zero" / "layers.3.attention.qkv.weight" / "exp_avg.pt").exists()
    proc = run(dst_launcher, dst_n, TINY + ["--data-path", data, "--load", ckpt, "--universal-checkpoint",
                                            "--log-json", log, *dst_flags])
    # each parameter group keeps its own weight decay (biases and norms none; DeepSpeed 0.19.8's ZeRO-3 load
    # copies the first group's into every group unless repaired)
    assert "at iteration 4 (weight decay per parameter group: 0.01, 0)" in proc.stdout + proc.stderr
    records = read_log(log)
    assert [r["iteration"] for r in records] == list(range(1, 9))
    assert [r["consumed_samples"] for r in records] == [8 * i for i in range(1, 9)]
    straight = baseline(UNTIED[0] in src_flags)
    assert_same_losses([r["lm_loss"] for r in records], [r["lm_loss"] for r in straight])
    assert [r["lr"] for r in records] == pytest.approx([r["lr"] for r in straight], rel=1e-12)  # schedule continues


@pytest.mark.slow
def test_a_dense_model_resumes_from_a_universal_checkpoint_in_a_process_that_trained_an_moe_model(data, baseline,
                                                                                                 universal_sources,
                                                                                                 tmp_path):
    """DeepSpeed keeps expert groups in module-level registries that outlive their run; its universal-checkpoint load
    asks the largest registered one for its rank. A process that trained an MoE model (an RL loop, a notebook, a pool
    rank) and then resumed a dense model from a universal checkpoint ended "Group ... is not registered" (the MoE
    run's groups destroyed since): each model now registers only its own (deepspeed_fixes.register_moe_layers)."""
    run("python", 1, TINY + ["--data-path", data, "--train-iters", 1, "--swiglu", "--disable-bias-linear",
                             "--num-experts", 2, "--moe-ffn-hidden-size", 16, "--deepspeed", "ds_configs/zero1.json"])
    ckpt, source_log = universal_sources(*CASES["pp2_to_pp1_untied"][0])
    log = tmp_path / "log.jsonl"
    log.write_text(source_log)
    run("python", 1, TINY + ["--data-path", data, "--load", ckpt, "--universal-checkpoint", "--log-json", log,
                             "--deepspeed", "ds_configs/zero1.json", *UNTIED])  # (the MoE run's rank)
    assert_same_losses([r["lm_loss"] for r in read_log(log)], [r["lm_loss"] for r in baseline(True)])


def _run_config(flags, world):
    from hybrid.config import build_run_config
    from hybrid.flags import build_parser
    return build_run_config(build_parser().parse_args([str(f) for f in TINY + flags]), world, 8192)


@pytest.mark.slow
def test_plain_load_at_another_layout_is_one_message_naming_the_difference_and_the_fix(data, tmp_path):
    from hybrid.checkpoint.client_state import read_client_state
    from hybrid.errors import ConfigError
    from hybrid.training import resume as checkpoint
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    _save_4(data, ckpt, "torchrun", 2, ["--tensor-model-parallel-size", 2, "--deepspeed", "ds_configs/zero1.json"],
            log)
    # launched once: the refusal is one message and a non-zero exit, with no traceback from hybrid's code
    proc = run("torchrun", 2, TINY + ["--data-path", data, "--load", ckpt, "--deepspeed", "ds_configs/zero1.json"],
               check=False)
    assert proc.returncode != 0 and "--tensor-model-parallel-size 2 (this run: 1)" in proc.stderr, proc.stderr[-3000:]
    assert "--saver universal --load-dir" in proc.stderr
    assert not re.search(r'File "[^"]*/hybrid/[^"]*\.py"', proc.stderr), proc.stderr[-3000:]
    # the same checks in this process for the other differences (what the launched run calls)
    saved = read_client_state(str(ckpt), "iter_0000004")
    run_config = _run_config(["--data-path", data, "--load", ckpt, "--tensor-model-parallel-size", 1, "--deepspeed",
                              "ds_configs/zero3.json"], 1)
    with pytest.raises(ConfigError, match=r"ZeRO stage 1 \(this run: 3\).*--saver universal --load-dir"):
        checkpoint.check_same_layout(saved, run_config, str(ckpt), "iter_0000004")
    run_config = _run_config(["--data-path", data, "--load", ckpt, "--tensor-model-parallel-size", 2,
                              "--context-parallel-size", 2, "--deepspeed", "ds_configs/zero1.json"], 4)
    with pytest.raises(ConfigError, match=r"--context-parallel-size 1 and --ds-sequence-parallel-size 1 \(this run: "
                                          r"2 and 1; ZeRO partitions the optimizer state over DP x CP\)"):
        checkpoint.check_same_layout(saved, run_config, str(ckpt), "iter_0000004")
    universal = ["--data-path", data, "--load", ckpt, "--universal-checkpoint"]
    with pytest.raises(ConfigError, match="--universal-checkpoint needs a ZeRO optimizer"):
        _run_config(universal, 1)
    with pytest.raises(ConfigError, match="ZeRO-3 at --tensor-model-parallel-size > 1 is not supported"):
        _run_config(universal + ["--tensor-model-parallel-size", 2, "--deepspeed", "ds_configs/zero3.json"], 2)
    with pytest.raises(ConfigError, match="no universal checkpoint there"):  # before the engine is touched
        checkpoint.start(None, _run_config(universal + ["--deepspeed", "ds_configs/zero1.json"], 1), None)


@pytest.mark.slow
def test_zero3_checkpoints_convert_to_huggingface_with_the_one_rank_weights(data, tmp_path):
    from safetensors.torch import load_file
    import torch
    """A Llama (untied): ZeRO-3 holds its vocabulary tables as row blocks (ModelConfig.zero3_vocab_block_rows),
    joined by the readers: at TP 2 through DeepSpeed's ds_to_universal (each block's TP slices), at TP 1 through
    its zero_to_fp32."""
    llama = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
             *UNTIED]
    exported = {}
    for name, nproc, flags in (("zero3_tp2", 2, ["--tensor-model-parallel-size", 2, "--deepspeed",
                                                 "ds_configs/zero3.json", *llama]),
                               ("zero3_dp2", 2, ["--deepspeed", "ds_configs/zero3.json", *llama]),
                               ("one_rank", 1, llama)):
        ckpt, hf = tmp_path / name, tmp_path / f"{name}_hf"
        _save_4(data, ckpt, "torchrun" if nproc > 1 else "python", nproc, flags, tmp_path / f"{name}.jsonl")
        run("python", 1, ["--saver", "hf", "--load-dir", ckpt, "--save-dir", hf, "--no-progress-bar"],
            script="conversion/checkpoint_util.py")
        exported[name] = load_file(str(hf / "model.safetensors"))
    # 4 Adam steps at either layout: the same weights, within 1% of the largest step Adam can take over them (the sum
    # of the 4 learning rates; a misplaced row or block is off by the weights themselves, ~0.02). A fixed 1e-6 was
    # below the rounding: for rows that barely appear, Adam divides a near-zero moment by the root of a near-zero
    # second moment, so summation-order differences that vary with the CPU's kernels grow there (4.1e-6 seen)
    steps = sum(r["lr"] for r in read_log(tmp_path / "one_rank.jsonl"))
    assert 1e-2 * steps < 1e-4, steps  # (far below a misplaced weight)
    for layout in ("zero3_tp2", "zero3_dp2"):
        assert exported[layout].keys() == exported["one_rank"].keys()
        for key, value in exported["one_rank"].items():
            torch.testing.assert_close(exported[layout][key], value, rtol=0, atol=1e-2 * steps, msg=f"{layout} {key}")


PIPELINE_ENGINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "pipeline_engine")
ENGINE_FLAGS = ["--num-layers", 2, "--hidden-size", 16, "--num-attention-heads", 2, "--seq-length", 16,
                "--max-position-embeddings", 16, "--micro-batch-size", 2, "--global-batch-size", 4, "--lr", 1e-2,
                "--min-lr", 1e-3, "--lr-decay-style", "cosine", "--lr-warmup-iters", 1, "--weight-decay", 0.01,
                "--clip-grad", 1.0, "--hidden-dropout", 0, "--attention-dropout", 0, "--seed", 7, "--mock-data",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", 63, "--make-vocab-size-divisible-by", 8,
                "--log-interval", 1, "--eval-iters", 0, "--no-progress-bar", "--num-workers", 0, "--train-iters", 4]


@pytest.mark.slow
def test_a_checkpoint_deepspeeds_pipeline_engine_wrote_resumes_with_its_optimizer(tmp_path):
    """tests/data/pipeline_engine (made by its make.sh with the last hybrid that ran 1f1b on DeepSpeed's
    PipelineEngine: layer files, ZeRO-1, PP 2, a tied table): a plain --load resumes it on the one runtime with its
    Adam state (a universal checkpoint made under --save, removed after) and iterations 3-4 equal that engine's
    uninterrupted run; --finetune reads its weights."""
    want = [r["lm_loss"] for r in read_log(os.path.join(PIPELINE_ENGINE, "uninterrupted.jsonl"))]
    log, save = tmp_path / "log.jsonl", tmp_path / "save"
    proc = run("torchrun", 2, ENGINE_FLAGS + ["--pipeline-model-parallel-size", 2, "--deepspeed",
                                              "ds_configs/zero1.json", "--load", os.path.join(PIPELINE_ENGINE, "ckpt"),
                                              "--save", save, "--log-json", log])
    assert "written by DeepSpeed's pipeline engine, with its optimizer state" in proc.stdout + proc.stderr
    records = [r for r in read_log(log) if "consumed_samples" in r]
    assert [r["iteration"] for r in records] == [3, 4]
    got = [r["lm_loss"] for r in records]
    assert all(abs(g - w) <= 1e-6 * abs(w) for g, w in zip(got, want[2:])), (got, want)
    assert not os.path.exists(os.path.join(save, ".pipeline-engine-universal"))
    # its weights into another layout, a fresh optimizer
    proc = run("python", 1, ENGINE_FLAGS + ["--load", os.path.join(PIPELINE_ENGINE, "ckpt"), "--finetune",
                                            "--log-json", tmp_path / "finetune.jsonl"])
    first = [r for r in read_log(tmp_path / "finetune.jsonl") if "consumed_samples" in r][0]
    assert first["iteration"] == 1 and abs(first["lm_loss"] - want[0]) > 1e-4  # trained weights, not a fresh model
