"""The main job's export-and-sample step never breaks a finished run: the sample stays within the model's
positions, and a failed export is one line, the checkpoint kept, exit status EXPORT_FAILED."""

import os
from types import SimpleNamespace

import pytest

from hybrid.training.demo import EXPORT_FAILED, finish
from checks.launch_helpers import run


@pytest.mark.slow
def test_tp2_run_with_32_positions_exports_and_samples_within_them(tmp_path):
    """The case that crashed: the main job at TP 2 with --seq-length 32 --max-position-embeddings 32 (the
    sample ran past the 32-position table and rank 1 died on a closed connection)."""
    save = tmp_path / "default"
    proc = run("torchrun", 2, ["--tensor-model-parallel-size", 2, "--seq-length", 32, "--max-position-embeddings", 32,
                               "--train-iters", 2, "--micro-batch-size", 2, "--save", save, "--no-progress-bar"])
    assert "sample (transformers, from" in proc.stdout, proc.stdout[-2000:]
    from transformers import AutoConfig
    assert AutoConfig.from_pretrained(save / "hf").n_positions == 32


def test_a_failed_export_is_one_line_and_exit_status_3_and_the_checkpoint_stays(tmp_path, capsys):
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest").write_text("iter_0000002")
    checkpoint = SimpleNamespace(export_hf=str(tmp_path / "no" / "such" / "file.txt" / "hf"), save=str(save),
                                 sample_prompt="The")
    (tmp_path / "no" / "such").mkdir(parents=True)
    (tmp_path / "no" / "such" / "file.txt").write_text("a file where the export directory's parent should be")
    assert finish(SimpleNamespace(checkpoint=checkpoint, training=SimpleNamespace(seed=1))) == EXPORT_FAILED == 3
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if "WARNING" in line]
    assert len(lines) == 1 and "export or sample after training failed" in lines[0], out
    assert os.path.exists(save / "latest")


def test_an_older_export_is_replaced_only_by_a_complete_one_and_nothing_is_left_beside_it(tmp_path, monkeypatch):
    """export_hf writes beside the export and renames when the conversion returns: a conversion that fails midway
    leaves the older export whole and no partial directory."""
    from hybrid.training import demo
    export = tmp_path / "hf"
    export.mkdir()
    (export / "config.json").write_text("older")

    def fails_midway(args):
        (tmp_path / "seen").write_text(args.save_dir)
        with open(os.path.join(args.save_dir, "config.json"), "w") as f:
            f.write("newer")
        raise OSError("No space left on device")

    monkeypatch.setattr(demo, "convert", fails_midway)
    with pytest.raises(OSError):
        demo.export_hf(str(tmp_path / "ckpt"), str(export))
    assert (export / "config.json").read_text() == "older"
    assert sorted(os.listdir(tmp_path)) == ["hf", "seen"] and (tmp_path / "seen").read_text() != str(export)

    def writes(args):
        with open(os.path.join(args.save_dir, "config.json"), "w") as f:
            f.write("newer")

    monkeypatch.setattr(demo, "convert", writes)
    demo.export_hf(str(tmp_path / "ckpt"), str(export))
    assert (export / "config.json").read_text() == "newer" and sorted(os.listdir(tmp_path)) == ["hf", "seen"]


def test_a_replaced_directory_is_moved_aside_whole_and_comes_back_when_the_rename_fails(tmp_path, monkeypatch):
    """atomic_directory(replace=True): the older directory is renamed aside before the new one takes its name, and
    renamed back if that fails, so no moment leaves a part of either."""
    from hybrid.checkpoint import files
    target = tmp_path / "out"
    target.mkdir()
    (target / "a").write_text("older")
    real = os.replace

    def fails_for_the_new_one(src, dst):
        if os.path.basename(src).startswith(".tmp-"):
            raise OSError("rename failed")
        return real(src, dst)

    monkeypatch.setattr(files.os, "replace", fails_for_the_new_one)
    with pytest.raises(OSError):
        with files.atomic_directory(str(target), replace=True) as tmp:
            with open(os.path.join(tmp, "a"), "w") as f:
                f.write("newer")
    assert (target / "a").read_text() == "older" and sorted(os.listdir(tmp_path)) == ["out"]
