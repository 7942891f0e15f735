"""Megatron-LM's own checkpoints in and out, against megatron-core itself (tests/megatron_reference.py: its
GPTModel at TP 2 on gloo writes a real torch_dist checkpoint and the legacy files, and gives the logits and
its vocabulary-parallel loss): the HF export has megatron-core's logits, evaluate.py its loss, a run resumes
it at TP 1 at the next iteration on Megatron's LR schedule, and what --saver megatron writes loads in
megatron-core with every tensor equal."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.launch_helpers import ROOT, env, read_log, run

pytest.importorskip("megatron.core.models.gpt", reason="megatron-core is not installed")

ITERATION = 7


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(out: str, family: str, *extra: str) -> None:
    port = _free_port()  # a fixed port can still be held by the previous call's ranks
    proc = subprocess.run([sys.executable, "-m", "tests.megatron_reference", out, "--family", family, "--tp", "2",
                           "--iteration", str(ITERATION), "--port", str(port), *extra], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("megatron-llama"))
    _reference(out, "llama")
    return out


def _convert(*flags) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "conversion/checkpoint_util.py", "--no-progress-bar", *map(str, flags)],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)


def _hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def _export_matches(source: str, reference: str, save_dir: str) -> None:
    proc = _convert("--loader", "megatron", "--saver", "hf", "--load-dir", source, "--save-dir", save_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = torch.load(os.path.join(reference, "reference.pt"), weights_only=False)
    logits = _hf_logits(save_dir, ref["tokens"])
    assert (logits - ref["logits"]).abs().max().item() < 1e-5
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ref["labels"].flatten(), reduction="none")
    assert torch.allclose(loss.view_as(ref["loss"]), ref["loss"], atol=1e-5, rtol=0)  # megatron-core's own loss


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_hf_export_has_megatron_core_logits(llama, fmt, tmp_path):
    """torch_dist written by megatron-core's dist_checkpointing at TP 2, and the legacy TP 2 files with
    Transformer Engine's key names: each exports to a transformers Llama with megatron-core's logits."""
    _export_matches(os.path.join(llama, fmt), llama, str(tmp_path / "hf"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gpt2"])
def test_other_families_export_with_megatron_core_logits(family, tmp_path):
    """Qwen2 (QKV bias, tied), Qwen3 (Q/K norms) and GPT-2 style (LayerNorm, fused bias + GeLU, learned
    positions, biases): read from torch_dist, exported to their transformers families."""
    out = str(tmp_path / "ref")
    _reference(out, family)
    _export_matches(os.path.join(out, "torch_dist"), out, str(tmp_path / "hf"))


def _windows_dataset(reference: str, prefix: str) -> None:
    from hybrid.data.indexed import IndexedDatasetBuilder
    ref = torch.load(os.path.join(reference, "reference.pt"), weights_only=False)
    builder = IndexedDatasetBuilder(prefix)
    builder.add_document(ref["windows"].flatten().numpy())
    builder.finalize()


@pytest.mark.parametrize("fmt,nproc", [("torch_dist", 2), ("torch", 1)])
def test_evaluate_gives_megatron_core_loss(llama, fmt, nproc, tmp_path):
    """evaluate.py --load MEGATRON_DIR at TP 2 (torch_dist) and TP 1 (legacy, resharded as it loads):
    megatron-core's mean loss over the same windows."""
    prefix = str(tmp_path / "windows")
    _windows_dataset(llama, prefix)
    log = str(tmp_path / "eval.json")
    run("torchrun" if nproc > 1 else "python", nproc,
        ["--load", os.path.join(llama, fmt), "--data-path", prefix, "--seq-length", 16, "--eval-iters", 2,
         "--log-json", log, "--tensor-model-parallel-size", nproc], script="launch/evaluate.py")
    with open(log) as f:
        result = json.loads(f.read().strip().splitlines()[-1])
    ref = torch.load(os.path.join(llama, "reference.pt"), weights_only=False)
    assert abs(result["lm_loss"] - ref["loss"].mean().item()) < 1e-5


def _scheduler_lrs(args: dict, steps: list) -> list:
    """megatron-core's OptimizerParamScheduler: the learning rate a step uses after `consumed` samples."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    gbs = args["global_batch_size"]
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args["lr"], min_lr=args["min_lr"], lr_warmup_steps=args["lr_warmup_iters"] * gbs,
        lr_decay_steps=args["lr_decay_iters"] * gbs, lr_decay_style=args["lr_decay_style"],
        start_wd=args["weight_decay"], end_wd=args["weight_decay"], wd_incr_steps=args["train_iters"] * gbs,
        wd_incr_style="constant")
    lrs, consumed = [], 0
    for target in steps:
        scheduler.step(target - consumed)
        consumed = target
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def test_resume_at_tp1_continues_the_megatron_run(llama, tmp_path):
    """A Megatron-LM run script's flags with --load MEGATRON_DIR (saved at TP 2): training continues at TP 1
    at the next iteration, with the consumed samples and the learning rates of megatron-core's scheduler."""
    ref = torch.load(os.path.join(llama, "reference.pt"), weights_only=False)
    args = ref["args"]
    log = str(tmp_path / "log.jsonl")
    proc = run("python", 1, [
        "--load", os.path.join(llama, "torch_dist"), "--save", tmp_path / "ckpt", "--num-layers", 2,
        "--hidden-size", 64, "--num-attention-heads", 4, "--seq-length", 16, "--micro-batch-size", 4,
        "--global-batch-size", args["global_batch_size"], "--train-iters", ITERATION + 2, "--lr", args["lr"],
        "--min-lr", args["min_lr"], "--lr-decay-style", args["lr_decay_style"], "--lr-decay-iters",
        args["lr_decay_iters"], "--lr-warmup-iters", args["lr_warmup_iters"], "--weight-decay", args["weight_decay"],
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", 255, "--log-interval", 1,
        "--log-json", log, "--save-interval", 100, "--eval-iters", 0])
    records = [r for r in read_log(log) if "lm_loss" in r and "iteration" in r]
    assert [r["iteration"] for r in records] == [ITERATION + 1, ITERATION + 2]
    gbs = args["global_batch_size"]
    assert [r["consumed_samples"] for r in records] == [(ITERATION + 1) * gbs, (ITERATION + 2) * gbs]
    expected = _scheduler_lrs(args, [ITERATION * gbs, (ITERATION + 1) * gbs])  # the LR each step uses
    assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-6)
    assert "Megatron-LM checkpoint" in proc.stdout + proc.stderr and "Adam starts fresh" in proc.stdout + proc.stderr


def test_contradicting_flags_are_one_message(llama, tmp_path):
    proc = run("python", 1, ["--load", os.path.join(llama, "torch"), "--num-layers", 2, "--hidden-size", 128,
                             "--seq-length", 16, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                             255, "--train-iters", 1, "--global-batch-size", 8], check=False)
    assert proc.returncode == 2
    assert "--hidden-size 128 (the checkpoint: 64)" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("spelling", ["transformer_engine", "local"])
def test_saver_megatron_loads_in_megatron_core(llama, spelling, tmp_path):
    """--saver megatron (legacy format, TP 2, either key spelling) from the torch_dist source: megatron-core's
    GPTModel loads it with load_state_dict(strict=True), every tensor equal to the source's."""
    written = str(tmp_path / "written")
    proc = _convert("--loader", "megatron", "--saver", "megatron", "--ckpt-format", "torch", "--saver-transformer-impl",
                    spelling, "--load-dir", os.path.join(llama, "torch_dist"), "--save-dir", written,
                    "--target-tensor-parallel-size", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = str(tmp_path / "check")
    os.makedirs(out)
    for name in ("torch", "reference.pt"):  # the source, as the check reads it
        os.symlink(os.path.join(llama, name), os.path.join(out, name))
    _reference(out, "llama", "--check", written, "torch")
    check = torch.load(os.path.join(out, "check_torch.pt"), weights_only=False)
    assert len(check["keys"]) == 15  # every weight of the 2-layer Llama
    assert all(diff == 0.0 for rank in check["diffs"] for diff in rank.values())


def test_bad_checkpoints_are_one_message(llama, tmp_path):
    import shutil
    broken = str(tmp_path / "broken")
    shutil.copytree(os.path.join(llama, "torch_dist"), broken)
    tag = os.path.join(broken, f"iter_{ITERATION:07d}")
    chunk = sorted(f for f in os.listdir(tag) if f.endswith(".distcp"))[0]
    with open(os.path.join(tag, chunk), "r+b") as f:
        f.truncate(100)
    proc = _convert("--loader", "megatron", "--saver", "hf", "--load-dir", broken, "--save-dir", tmp_path / "hf")
    assert proc.returncode == 2 and "truncated" in proc.stderr and chunk in proc.stderr
    assert "Traceback" not in proc.stderr and not os.path.exists(tmp_path / "hf")
    proc = _convert("--loader", "megatron", "--saver", "megatron", "--ckpt-format", "torch_dist", "--load-dir",
                    os.path.join(llama, "torch"), "--save-dir", tmp_path / "out")
    assert proc.returncode == 2 and "--ckpt-convert-format torch_dist" in proc.stderr


@pytest.mark.parametrize("tied", [False, True])
def test_legacy_round_trip_at_tp2_pp2(llama, tied, tmp_path):
    """--saver megatron at TP 2 x PP 2 (stage-local layer numbers, the last stage's copy of a tied table),
    read back by the Megatron reader: every tensor bitwise equal."""
    import dataclasses

    from hybrid.checkpoint.client_state import ClientState
    from hybrid.conversion.megatron import open_megatron
    from hybrid.conversion.megatron_write import write_megatron
    from hybrid.safe_loading import install_safe_torch_load
    install_safe_torch_load()
    source = open_megatron(os.path.join(llama, "torch_dist"))
    config = source.config()
    state = source.state(config)
    if tied:
        config = dataclasses.replace(config, untie_embeddings_and_output_weights=False)
        state.pop("output_layer.weight")
    write_megatron(state, config, 2, 2, str(tmp_path / "out"), ClientState(iteration=3, consumed_samples=24))
    assert sorted(os.listdir(tmp_path / "out" / "iter_0000003")) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    back = open_megatron(str(tmp_path / "out"))
    assert (back.iteration, back.consumed_samples, back.format) == (3, 24, "torch")
    read = back.state(back.config())
    assert sorted(read) == sorted(state)
    assert all(torch.equal(read[name], state[name]) for name in state)
