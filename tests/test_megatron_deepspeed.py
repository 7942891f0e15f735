"""Megatron-DeepSpeed's own checkpoints in (tests/data/megatron_deepspeed: written by Megatron-DeepSpeed itself,
with the loss its own model computes after loading them): a Llama-style model with GQA at TP 2 x PP 2 in the
pipeline engine's layer files (QKV grouped per KV head, its layout until December 2024), and a GPT-2-style
model at TP 2 without the pipeline engine (QKV as [all q | all k | all v] per TP rank, its newest layout).
Each exports to transformers, evaluates, and resumes with Megatron-DeepSpeed's loss."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from checks.launch_helpers import ROOT, env, read_log, run

DATA = os.path.join(ROOT, "tests", "data", "megatron_deepspeed")
CHECKPOINTS = ["llama_gqa_tp2pp2", "gpt2_tp2"]


def _reference(name: str) -> dict:
    with open(os.path.join(DATA, name, "reference.json")) as f:
        return json.load(f)


def _mean_loss(logits_of, ref: dict) -> float:
    """Megatron-DeepSpeed's number: the mean over micro-batches of the token-mean cross-entropy."""
    windows = torch.tensor(ref["windows"])
    mbs = ref["micro_batch_size"]
    losses = []
    for i in range(0, windows.size(0), mbs):
        chunk = windows[i:i + mbs]
        logits = logits_of(chunk[:, :-1])
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten()).item())
    return sum(losses) / len(losses)


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_export_has_megatron_deepspeed_loss(name, tmp_path):
    """checkpoint_util.py --loader megatron reads the checkpoint (TP shards joined, QKV regrouped where its
    version needs it) and the transformers model it writes has the loss Megatron-DeepSpeed's model has."""
    import transformers
    out = str(tmp_path / "hf")
    proc = subprocess.run([sys.executable, "conversion/checkpoint_util.py", "--no-progress-bar", "--loader", "megatron",
                           "--saver", "hf", "--load-dir", os.path.join(DATA, name), "--save-dir", out], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = _reference(name)
    with torch.no_grad():
        loss = _mean_loss(lambda ids: model(ids).logits, ref)
    assert abs(loss - ref["loss"]) < 1e-5


def _windows_dataset(ref: dict, prefix: str) -> None:
    from hybrid.data.indexed import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(prefix)
    builder.add_document(torch.tensor(ref["windows"]).flatten().numpy())
    builder.finalize()


@pytest.mark.slow  # (4.5 s of the quick tier)
def test_evaluate_and_resume_a_megatron_deepspeed_run(tmp_path):
    """evaluate.py --load at TP 1 (the TP 2 x PP 2 files resharded as read) gives Megatron-DeepSpeed's loss; a
    run script's flags with --load continue at iteration 3 with its consumed samples, Adam fresh (said)."""
    name = "llama_gqa_tp2pp2"
    ref = _reference(name)
    prefix = str(tmp_path / "windows")
    _windows_dataset(ref, prefix)
    log = str(tmp_path / "eval.json")
    run("python", 1, ["--load", os.path.join(DATA, name), "--data-path", prefix, "--seq-length", 16, "--eval-iters", 2,
                      "--micro-batch-size", 4, "--log-json", log, "--tensor-model-parallel-size", 1,
                      "--pipeline-model-parallel-size", 1], script="launch/evaluate.py")
    with open(log) as f:
        assert abs(json.loads(f.read().strip().splitlines()[-1])["lm_loss"] - ref["loss"]) < 1e-5
    load = str(tmp_path / "mds")
    shutil.copytree(os.path.join(DATA, name), load)
    train_log = str(tmp_path / "train.jsonl")
    proc = run("python", 1, ["--load", load, "--save", tmp_path / "ckpt", "--seq-length", 16, "--micro-batch-size", 4,
                             "--global-batch-size", 8, "--train-iters", 3, "--lr", 1e-3, "--mock-data",
                             "--tokenizer-type", "NullTokenizer", "--vocab-size", 255, "--log-interval", 1,
                             "--log-json", train_log, "--save-interval", 100, "--eval-iters", 0])
    records = [r for r in read_log(train_log) if "lm_loss" in r and "iteration" in r]
    assert [(r["iteration"], r["consumed_samples"]) for r in records] == [(3, 24)]
    out = proc.stdout + proc.stderr
    assert "Megatron-DeepSpeed checkpoint" in out and "Adam starts fresh" in out


def test_a_damaged_megatron_deepspeed_file_is_one_message(tmp_path):
    load = str(tmp_path / "mds")
    shutil.copytree(os.path.join(DATA, "llama_gqa_tp2pp2"), load)
    with open(os.path.join(load, "global_step2", "layer_02-model_01-model_states.pt"), "r+b") as f:
        f.truncate(200)
    proc = subprocess.run([sys.executable, "conversion/checkpoint_util.py", "--no-progress-bar", "--loader", "megatron",
                           "--saver", "hf", "--load-dir", load, "--save-dir", tmp_path / "hf"], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "layer_02-model_01-model_states.pt" in proc.stderr
    assert "Traceback" not in proc.stderr and not os.path.exists(tmp_path / "hf")


@pytest.mark.parametrize("name,missing", [("gpt2_tp2", "mp_rank_01_model_states.pt"),
                                          ("llama_gqa_tp2pp2", "layer_03-model_01-model_states.pt"),
                                          ("llama_gqa_tp2pp2", "layer_02-model_00-model_states.pt")])
def test_a_missing_rank_file_is_one_message_naming_it(name, missing, tmp_path, capsys):
    """A Megatron-DeepSpeed checkpoint without one TP rank's file (or one layer's) is refused with the file's
    name, exit 2, nothing written: the TP size comes from the args, not from the files found, and a lone shard
    is never taken for the whole tensor."""
    from hybrid.conversion.checkpoint_util import main as convert
    load = str(tmp_path / "mds")
    shutil.copytree(os.path.join(DATA, name), load)
    os.remove(os.path.join(load, "global_step2", missing))
    capsys.readouterr()
    code = convert(["--no-progress-bar", "--loader", "megatron", "--saver", "hf", "--load-dir", load,
                    "--save-dir", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == 2 and missing in err and "incomplete" in err, err
    assert not os.path.exists(tmp_path / "hf")
