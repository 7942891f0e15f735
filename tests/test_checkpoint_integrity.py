"""Every checkpoint lists its files with sizes and a cheap checksum (hybrid_manifest.json, written once
all ranks' files are complete, before 'latest' moves). A truncated or corrupt file is named on load; when
the newest checkpoint is incomplete the run says so and resumes from the newest complete one, with the
uninterrupted losses."""

import glob
import json
import os

import pytest

from checks.launch_helpers import read_log, run
from tests.test_training import TINY


@pytest.fixture(scope="module")
def saved(data, tmp_path_factory):
    """8 iterations with checkpoints at 4 and 8 (ZeRO-1: model states and optimizer partitions)."""
    root = tmp_path_factory.mktemp("saved")
    ckpt, log = root / "ckpt", root / "log.jsonl"
    run("python", 1, TINY + ["--data-path", data, "--save", ckpt, "--save-interval", 4, "--log-json", log,
                             "--deepspeed", "ds_configs/zero1.json"])
    return ckpt, read_log(log)


def _copy(ckpt, tmp_path):
    import shutil
    return shutil.copytree(ckpt, tmp_path / "ckpt")


def test_each_checkpoint_lists_every_file_with_its_size(saved):
    ckpt, _ = saved
    for tag in ("iter_0000004", "iter_0000008"):
        files = json.loads((ckpt / tag / "hybrid_manifest.json").read_text())["files"]
        on_disk = sorted(os.path.relpath(p, ckpt / tag) for p in glob.glob(str(ckpt / tag / "**" / "*"), recursive=True)
                         if os.path.isfile(p) and not p.endswith("hybrid_manifest.json"))
        assert sorted(files) == on_disk and len(on_disk) >= 2
        assert all(files[name]["size"] == os.path.getsize(ckpt / tag / name) for name in files)


@pytest.mark.slow
def test_a_truncated_newest_checkpoint_resumes_from_the_newest_complete_one(saved, data, tmp_path):
    ckpt = _copy(saved[0], tmp_path)
    partition = glob.glob(str(ckpt / "iter_0000008" / "*optim_states.pt"))[0]
    with open(partition, "r+b") as f:
        f.truncate(os.path.getsize(partition) // 2)
    log = tmp_path / "log.jsonl"
    proc = run("python", 1, TINY + ["--data-path", data, "--load", ckpt, "--deepspeed", "ds_configs/zero1.json",
                                    "--log-json", log])
    out = proc.stdout + proc.stderr
    assert "checkpoint iter_0000008" in out and os.path.basename(partition) in out and "truncated" in out
    assert "resuming from iter_0000004, the newest complete checkpoint" in out
    resumed = [r for r in read_log(log) if "consumed_samples" in r]
    assert [r["iteration"] for r in resumed] == [5, 6, 7, 8]
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in saved[1][4:8]], "bitwise on CPU"


@pytest.mark.slow
def test_with_no_complete_checkpoint_the_error_names_the_file_and_conversion_refuses_it_too(saved, data, tmp_path):
    ckpt = _copy(saved[0], tmp_path)
    for tag in ("iter_0000004", "iter_0000008"):
        model = ckpt / tag / "mp_rank_00_model_states.pt"
        data_bytes = bytearray(model.read_bytes())
        data_bytes[10] ^= 0xFF  # same size, different bytes
        model.write_bytes(bytes(data_bytes))
    proc = run("python", 1, TINY + ["--data-path", data, "--load", ckpt, "--deepspeed", "ds_configs/zero1.json"],
               check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "iter_0000008 is incomplete" in proc.stderr and "mp_rank_00_model_states.pt does not match" in proc.stderr
    assert "Traceback" not in proc.stderr
    from hybrid.conversion.checkpoint_util import main
    assert main(["--load-dir", str(ckpt), "--save-dir", str(tmp_path / "hf"), "--hf-convert", "--no-progress-bar"]) == 2
    assert not (tmp_path / "hf").exists()


def test_a_resume_names_what_changes_its_data_plan_and_continues_where_megatron_does(saved, data, tmp_path):
    """Resumed at iteration 4 with the same flags: nothing said. With another --seed (the samples' order) and a
    doubled global batch: each named with both values and the fix, the run continuing at the checkpoint's consumed
    samples (32), 16 per iteration, as Megatron-LM continues (before: nothing said)."""
    ckpt = _copy(saved[0], tmp_path)
    (ckpt / "latest").write_text("iter_0000004")
    common = TINY + ["--data-path", data, "--load", ckpt, "--deepspeed", "ds_configs/zero1.json"]
    same = run("python", 1, common + ["--train-iters", 5])
    assert "data plan" not in same.stdout + same.stderr and "trained with" not in same.stdout + same.stderr
    log = tmp_path / "log.jsonl"
    changed = run("python", 1, common + ["--train-iters", 6, "--seed", 8, "--global-batch-size", 16, "--log-json", log])
    out = changed.stdout + changed.stderr
    assert "another data plan: --seed 7 (this run: 8). This run continues at consumed sample 32 (iteration 4)" in out
    assert "give the checkpoint's values" in out and "add --finetune" in out
    assert "trained with --global-batch-size 8 (this run: 16): continuing at consumed sample 32 (iteration 4)" in out
    logged = [(r["iteration"], r["consumed_samples"]) for r in read_log(log) if "consumed_samples" in r]
    assert logged == [(5, 48), (6, 64)]


def test_a_resume_past_the_end_of_its_data_is_one_message_before_the_first_iteration():
    """A checkpoint that consumed 80 samples (a Megatron one trained at another global batch), resumed at iteration
    10 with --train-iters 12 --global-batch-size 4: the 8 samples after the 80th are past the 48 this run's data
    holds; one message naming both counts and the fixes (before: a StopIteration traceback midway). With room
    for them (88 samples) it passes; with a batch ramp-up each iteration's own size is counted."""
    from hybrid.config import build_run_config
    from hybrid.errors import ConfigError
    from hybrid.flags import build_parser
    from hybrid.training.loop import check_enough_samples
    flags = [str(f) for f in TINY + ["--train-iters", 12, "--global-batch-size", 4, "--mock-data"]]
    run = build_run_config(build_parser().parse_args(flags), 1, 8192)
    with pytest.raises(ConfigError, match="has consumed 80 samples at iteration 10; reaching --train-iters 12 from "
                                          "there needs 88 samples, and this run's training data holds 48"):
        check_enough_samples(run, 10, 80, 48)
    check_enough_samples(run, 10, 80, 88)
    at = TINY.index("--train-iters")
    ramp = [str(f) for f in TINY[:at] + TINY[at + 2:] + ["--global-batch-size", 4, "--mock-data", "--train-samples",
                                                         48, "--rampup-batch-size", 2, 2, 8]]
    ramped = build_run_config(build_parser().parse_args(ramp), 1, 8192)
    needed = 0
    for _ in range(ramped.training.train_iters):
        needed += ramped.training.rampup.batch_size(needed, 4)
    assert needed != ramped.training.train_iters * 4  # (the ramp's smaller batches counted)
    check_enough_samples(ramped, 0, 0, needed)
    with pytest.raises(ConfigError, match=f"needs {needed} samples"):
        check_enough_samples(ramped, 0, 0, needed - 1)


def test_the_data_plan_compares_each_setting_and_each_files_size(tmp_path):
    """plan_changes: the sequence length, the blend, the chat options and every data file's size (the same path
    holding other data) are differences; the batch size is reported apart; a checkpoint that did not record a
    field (written before it was) is not compared on it."""
    import dataclasses

    from hybrid.config import DataConfig
    from hybrid.data.chat.options import ChatOptions
    from hybrid.data.plan import data_files, plan_changes
    prefix = str(tmp_path / "corpus")
    for suffix in (".bin", ".idx"):
        with open(prefix + suffix, "wb") as f:
            f.write(b"x" * 64)
    config = DataConfig(data_path=["0.5", prefix, "0.5", prefix], split="98,2,0")
    saved = {"training": {"seq_length": 16, "seed": 7, "global_batch_size": 8},
             "data": dataclasses.asdict(config), "data_files": data_files(config)}
    assert plan_changes(saved, saved) == ([], "")
    with open(prefix + ".bin", "ab") as f:
        f.write(b"y" * 8)
    now = {"training": {"seq_length": 32, "seed": 7, "global_batch_size": 4},
           "data": dataclasses.asdict(dataclasses.replace(config, chat=ChatOptions(pairs=True))),
           "data_files": data_files(config)}
    changes, batch = plan_changes(saved, now)
    assert changes[0] == "--seq-length 16 (this run: 32)"
    assert changes[1].startswith("--sft / --dpo and the --sft-* / --dpo-* options None (this run: {")
    assert changes[2:] == [f"{prefix}.bin: 64 bytes (this run: 72)"]
    assert batch == "--global-batch-size 8 (this run: 4)"
    older = {"training": {"seq_length": 32, "global_batch_size": 4}, "data": now["data"]}  # no seed, no files
    assert plan_changes(older, now) == ([], "")


def test_the_pointers_name_iterations_past_ten_million(tmp_path):
    """Tags have at least 7 digits (Megatron's iter_0000100) and 8 from iteration 10,000,000: `latest` names the tag
    and Megatron's latest_checkpointed_iteration.txt its number (it said "None" past 9,999,999)."""
    from hybrid.checkpoint.files import LATEST, MEGATRON_LATEST, iteration_of, tag_for, write_latest
    for iteration in (100, 12_345_678):
        write_latest(str(tmp_path), tag_for(iteration))
        assert (tmp_path / LATEST).read_text() == tag_for(iteration) and iteration_of(tag_for(iteration)) == iteration
        assert (tmp_path / MEGATRON_LATEST).read_text() == str(iteration)
    assert iteration_of("iter_123") is None and iteration_of("release") is None
