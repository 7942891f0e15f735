"""--check-for-nan-in-loss-and-grad (on by default): a diverging run stops at the first non-finite loss or
gradient norm with one message naming the iteration and the last good checkpoint, saves nothing after it,
and never applies an update from a non-finite gradient; the check makes no host sync per iteration
(tests/test_device_and_step.py counts them)."""

import pytest
import torch

from checks.launch_helpers import read_log, run
from checks.rank_pool import run_on_ranks
from tests.test_training import TINY

DIVERGING = [str(f) for f in TINY]
DIVERGING[DIVERGING.index("--lr") + 1] = "1e4"  # the run the issue reports: NaN from a few iterations in
DIVERGING[DIVERGING.index("--train-iters") + 1] = "12"


@pytest.mark.slow
@pytest.mark.parametrize("launcher, nproc, extra", [("python", 1, []),
                                                    ("torchrun", 2, ["--deepspeed", "ds_configs/zero1.json"])],
                         ids=["zero0", "dp2_zero1"])
def test_a_diverging_run_stops_with_one_message_and_saves_nothing_after(data, tmp_path, launcher, nproc, extra):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    proc = run(launcher, nproc, DIVERGING + ["--data-path", data, "--save", ckpt, "--save-interval", 2,
                                             "--log-json", log, *extra], check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: iteration")]
    assert len(lines) == 1, proc.stderr[-3000:]
    stopped = int(lines[0].split()[2].rstrip(":"))
    assert "stopping (--check-for-nan-in-loss-and-grad)" in lines[0]
    assert stopped < 12, "it stopped before the end"
    good = (ckpt / "latest").read_text()
    assert f"last good checkpoint is {ckpt}/{good}" in lines[0]
    assert int(good.split("_")[1]) < stopped
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_"))[-1] == good, "nothing saved after"
    records = [r for r in read_log(log) if "consumed_samples" in r]
    assert all(r["iteration"] < stopped for r in records)


@pytest.mark.slow
def test_without_the_check_the_run_trains_on_to_the_end(data, tmp_path):
    log = tmp_path / "log.jsonl"
    run("python", 1, DIVERGING + ["--data-path", data, "--log-json", log, "--no-check-for-nan-in-loss-and-grad"])
    records = [r for r in read_log(log) if "consumed_samples" in r]
    assert [r["iteration"] for r in records] == list(range(1, 13))
    import math
    assert any(not math.isfinite(r["grad_norm"]) or not math.isfinite(r["lm_loss"]) for r in records)


def _step_with_a_nan_gradient(extra):
    from hybrid.config import build_run_config
    from hybrid.flags import build_parser
    from hybrid.parallel.random import model_parallel_seed
    from hybrid.parallel.groups import build_groups
    from hybrid.training.engine import build_engine
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "10", "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--lr", "1e-2", "--lr-warmup-iters", "0",
             "--lr-decay-style", "constant",
             *extra]
    run_config = build_run_config(build_parser().parse_args(flags), 1, 64)
    model_parallel_seed(1, 0)
    engine, model = build_engine(run_config, build_groups())
    ids = torch.randint(0, 64, (2, 16))
    changed = []
    for poison in (False, False, True, False):  # the first step creates the moments
        before = [p.detach().clone() for p in model.parameters()]
        moments = [s["exp_avg"].clone() for s in engine.optimizer.state.values() if "exp_avg" in s]
        loss = engine(ids, ids)
        engine.backward(loss)
        if poison:
            next(model.parameters()).grad.view(-1)[0] = float("nan")
        engine.step()
        after = [p.detach() for p in model.parameters()]
        moments_after = [s["exp_avg"] for s in engine.optimizer.state.values() if "exp_avg" in s]
        changed.append((any(not torch.equal(a, b) for a, b in zip(before, after)),
                        any(not torch.equal(a, b) for a, b in zip(moments, moments_after)),
                        all(bool(torch.isfinite(a).all()) for a in after)))
    from hybrid.training.deepspeed_fixes import release_engine  # (the pool's ranks serve later modules)
    release_engine(engine)
    return changed


@pytest.mark.parametrize("extra", [[], ["--clip-grad", "1.0"]], ids=["no_clipping", "clipping"])
def test_no_update_from_a_non_finite_gradient_without_zero(extra):
    """ZeRO-0 fp32, where DeepSpeed steps the torch optimizer whatever the gradients hold: the NaN step
    leaves every parameter and Adam moment bitwise as it was (the steps around it do change them)."""
    _, clean, poisoned, after = run_on_ranks(_step_with_a_nan_gradient, 1, extra)[0]
    assert clean[0] and clean[1] and after[0], "normal steps update the parameters and moments"
    assert poisoned == (False, False, True), poisoned


def test_without_the_check_deepspeed_applies_the_nan_step():
    """What the test above guards against (so it can fail): DeepSpeed's fp32 step writes the NaN in."""
    _, _, poisoned, _ = run_on_ranks(_step_with_a_nan_gradient, 1, ["--no-check-for-nan-in-loss-and-grad"])[0]
    assert poisoned[0] and not poisoned[2], poisoned
