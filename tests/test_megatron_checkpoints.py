"""Megatron-LM's own checkpoints in and out, against megatron-core itself (tests/megatron_reference.py: its
GPTModel at TP 2 (or EP 2 with experts) on gloo writes a real torch_dist checkpoint and the legacy files,
and gives the logits and its vocabulary-parallel loss; its DDP and optimizer train a few steps): the HF
export has megatron-core's logits, evaluate.py its loss, a run resumes it at the next iteration on
Megatron's LR schedule and, with Megatron's Adam state, with the losses Megatron's own next steps have,
and what --saver megatron writes (both formats) loads in megatron-core with every tensor equal."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from checks.launch_helpers import ROOT, env, read_log, run

pytest.importorskip("megatron.core.models.gpt", reason="megatron-core is not installed")

ITERATION = 7


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(out: str, family: str, *extra: str, tp: int = 2) -> None:
    for attempt in (1, 2):
        port = _free_port()  # a fixed port can still be held by the previous call's ranks
        proc = subprocess.run([sys.executable, "-m", "tests.megatron_reference", out, "--family", family, "--tp",
                               str(tp), "--iteration", str(ITERATION), "--port", str(port), *extra], cwd=ROOT,
                              env=env(), capture_output=True, text=True, timeout=300)
        # megatron-core's spawned ranks on CPU aborted once in this session's 3 full runs, in its own checkpoint load
        # ("terminate called without an active exception", SIGABRT; the same call passed 3 of 3 alone): one new
        # attempt for that abort only; any other failure, or a second abort, fails the test
        if proc.returncode == 0 or attempt == 2 or "terminated with signal SIGABRT" not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("megatron-llama"))
    _reference(out, "llama")
    return out


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """megatron-core's MoE GPTModel (Qwen2-MoE style: softmax over every expert then top-2, a sigmoid-gated
    shared expert, QKV bias) at EP 2: torch_dist, and the legacy files (mp_rank_00_00E) in SequentialMLP's,
    TEGroupedMLP's and the legacy GroupedMLP's expert names."""
    out = str(tmp_path_factory.mktemp("megatron-qwen2-moe"))
    _reference(out, "qwen2_moe", "--ep", "2", tp=1)
    return out


def _as_megatron_wrote_it(path):
    """A file's whole content with megatron-core's own classes (a test edits it and saves it back): unpickled
    outright, outside the safe load the test installed (whose TORCH_FORCE_WEIGHTS_ONLY_LOAD would rebuild them
    as hybrid's stand-ins, which no reader may load)."""
    from hybrid.safe_loading import _ORIGINAL_TORCH_LOAD
    forced = os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
    try:
        return _ORIGINAL_TORCH_LOAD(path, weights_only=False)
    finally:
        if forced is not None:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = forced


def _convert(*flags) -> subprocess.CompletedProcess:
    """conversion/checkpoint_util.py's own main on a warm rank (its exit status and output as a launch gives them;
    an interpreter start-up per call was about 3.5 s, 35 calls in this module)."""
    return run("python", 1, [*map(str, flags), "--no-progress-bar"], script="conversion/checkpoint_util.py",
               check=False, timeout=300)


def _hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def _export_matches(source: str, reference: str, save_dir: str, atol: float = 1e-5) -> None:
    proc = _convert("--loader", "megatron", "--saver", "hf", "--load-dir", source, "--save-dir", save_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = torch.load(os.path.join(reference, "reference.pt"), weights_only=False)
    logits = _hf_logits(save_dir, ref["tokens"])
    assert (logits - ref["logits"]).abs().max().item() < atol
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ref["labels"].flatten(), reduction="none")
    assert torch.allclose(loss.view_as(ref["loss"]), ref["loss"], atol=atol, rtol=0)  # megatron-core's own loss


@pytest.mark.slow
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


SLOW = pytest.mark.slow


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch_dist", pytest.param("torch", marks=SLOW),
                                 pytest.param("torch_te_grouped", marks=SLOW), "torch_grouped"])
def test_moe_export_has_megatron_core_logits(qwen2_moe, fmt, tmp_path):
    """An MoE checkpoint saved at EP 2 in every expert spelling megatron-core has (global [experts, ...]
    tensors; local_experts.J / linear_fc1.weightJ / weight1-weight2 per EP rank's file) exports to
    transformers' Qwen2-MoE with megatron-core's logits."""
    _export_matches(os.path.join(qwen2_moe, fmt), qwen2_moe, str(tmp_path / "hf"))


@pytest.mark.slow
def test_a_glm4_5_style_moe_exports_with_megatron_core_logits_and_round_trips(tmp_path):
    """megatron-core's GPTModel with --rotary-percent 0.5, QKV bias, Q/K norms and DeepSeek's router (sigmoid,
    random expert biases, --moe-router-num-groups 4 / --moe-router-group-topk 1, scaling 2.5, an ungated shared
    expert) at TP 2 + SP: exported to transformers' Glm4MoeForCausalLM with megatron-core's logits, and written
    back as a Megatron-LM checkpoint that megatron-core loads with every tensor (the expert biases too) equal."""
    out = str(tmp_path / "ref")
    _reference(out, "glm4_moe")
    _export_matches(os.path.join(out, "torch_dist"), out, str(tmp_path / "hf"))
    assert json.load(open(tmp_path / "hf" / "config.json"))["architectures"] == ["Glm4MoeForCausalLM"]
    proc = _convert("--loader", "megatron", "--saver", "megatron", "--load-dir", os.path.join(out, "torch_dist"),
                    "--save-dir", tmp_path / "back", "--target-tensor-parallel-size", 2, "--ckpt-format", "torch")
    assert proc.returncode == 0, proc.stderr[-3000:]
    check = _check_in_megatron_core(out, "glm4_moe", str(tmp_path / "back"), "torch", tmp_path)
    assert any(key.endswith("router.expert_bias") for key in check["keys"])
    assert all(diff == 0.0 for rank in check["diffs"] for diff in rank.values()), check["diffs"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_grouped"])
def test_moe_with_expert_tensor_parallelism_exports(fmt, tmp_path):
    """Mixtral style at TP 2 with SP: the legacy files split every expert over expert-TP 2 ([gate; up] per
    rank of fc1, fc2 by columns; grouped: the experts packed in weight1/weight2), joined as they are read."""
    out = str(tmp_path / "ref")
    _reference(out, "mixtral")
    _export_matches(os.path.join(out, fmt), out, str(tmp_path / "hf"))


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


@pytest.mark.slow
def test_moe_evaluates_at_ep2_to_megatron_core_loss(qwen2_moe, tmp_path):
    """evaluate.py --load (torch_dist, saved at EP 2) at EP 2: each rank reads its own experts only, and the
    mean loss is megatron-core's."""
    prefix = str(tmp_path / "windows")
    _windows_dataset(qwen2_moe, prefix)
    log = str(tmp_path / "eval.json")
    run("torchrun", 2, ["--load", os.path.join(qwen2_moe, "torch_dist"), "--data-path", prefix, "--seq-length", 16,
                        "--eval-iters", 2, "--log-json", log, "--expert-model-parallel-size", 2,
                        "--tensor-model-parallel-size", 1], script="launch/evaluate.py")
    with open(log) as f:
        result = json.loads(f.read().strip().splitlines()[-1])
    ref = torch.load(os.path.join(qwen2_moe, "reference.pt"), weights_only=False)
    assert abs(result["lm_loss"] - ref["loss"].mean().item()) < 1e-5


@pytest.mark.slow
def test_moe_parts_read_only_the_ranks_experts(qwen2_moe, safe_torch_load):
    """An EP rank's read of a torch_dist MoE checkpoint: only the experts it asks for come (a layer at a
    time), equal to the same experts of the whole read."""
    from hybrid.conversion.megatron.lm import open_megatron
    from hybrid.conversion.megatron.names import expert_name
    source = open_megatron(os.path.join(qwen2_moe, "torch_dist"))
    config = source.config()
    whole = source.state(config)
    mine = {expert_name(f"layers.{layer}.", e, fc)
            for layer in range(config.num_layers) for e in (2, 3) for fc in ("fc1", "fc2")}
    read = {}
    for part in source.parts(config, mine):
        read.update(part)
    assert set(read) == mine and all(torch.equal(read[name], whole[name]) for name in mine)


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


def _check_in_megatron_core(reference: str, family: str, written: str, fmt: str, tmp_path, *extra) -> dict:
    """megatron-core's own loader reads `written`: {"keys": its model's tensors, "diffs": per rank, each
    tensor's largest difference from the reference checkpoint's}."""
    return _checks_in_megatron_core(reference, family, [(written, fmt)], tmp_path, *extra)[fmt]


def _checks_in_megatron_core(reference: str, family: str, checks: list, tmp_path, *extra) -> dict:
    """Each (written, format) of `checks` (formats apart) read by megatron-core's own loader in one launch: format ->
    _check_in_megatron_core's record."""
    out = str(tmp_path / "check")
    os.makedirs(out)
    for name in ("torch", "reference.pt"):  # the source, as the check reads it
        os.symlink(os.path.join(reference, name), os.path.join(out, name))
    _reference(out, family, *[arg for written, fmt in checks for arg in ("--check", written, fmt)], *extra)
    return {fmt: torch.load(os.path.join(out, f"check_{fmt}.pt"), weights_only=False) for _, fmt in checks}


@pytest.mark.parametrize("fmt,spelling", [pytest.param("torch", "transformer_engine", marks=SLOW),
                                          pytest.param("torch", "local", marks=SLOW),
                                          pytest.param("torch_dist", None, marks=SLOW)])  # (10 s: the full suite)
def test_saver_megatron_loads_in_megatron_core(llama, fmt, spelling, tmp_path):
    """--saver megatron (legacy format at TP 2 in either key spelling; torch_dist written at TP 1, whose
    global tensors megatron-core's dist_checkpointing.load reads at its TP 2) from the torch_dist source:
    megatron-core's GPTModel loads it (strict), every tensor equal to the source's."""
    written = str(tmp_path / "written")
    proc = _convert("--loader", "megatron", "--saver", "megatron", "--ckpt-format", fmt,
                    *(["--saver-transformer-impl", spelling, "--target-tensor-parallel-size", 2] if spelling else []),
                    "--load-dir", os.path.join(llama, "torch_dist"), "--save-dir", written)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check = _check_in_megatron_core(llama, "llama", written, fmt, tmp_path)
    # every weight of the 2-layer Llama (torch_dist: also as the local spec's model reads it, "local:" in the check)
    assert len([key for key in check["keys"] if not key.startswith("local:")]) == 15
    assert len(check["keys"]) == (30 if fmt == "torch_dist" else 15)
    assert all(diff == 0.0 for rank in check["diffs"] for diff in rank.values())


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [pytest.param("torch_dist", marks=SLOW), "torch"])
def test_moe_saver_megatron_loads_in_megatron_core(qwen2_moe, fmt, tmp_path):
    """An MoE model written as Megatron-LM's (torch_dist: experts stacked [layers, experts, ...]; legacy: one
    file per EP rank, local expert numbers) loads in megatron-core at EP 2 with every tensor equal."""
    written = str(tmp_path / "written")
    proc = _convert("--loader", "megatron", "--saver", "megatron", "--ckpt-format", fmt,
                    "--target-expert-parallel-size",
                    2, "--load-dir", os.path.join(qwen2_moe, "torch_dist"), "--save-dir", written)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check = _check_in_megatron_core(qwen2_moe, "qwen2_moe", written, fmt, tmp_path, "--ep", "2", "--tp", "1")
    # embeddings, head, final norm; per layer 2 norms, QKV (+bias), proj, router, 2 local experts x 2, shared expert
    # fc1/fc2 and its gate (torch_dist: loaded by TE's names and by the local spec's, whose pre-router norm differs)
    assert len([key for key in check["keys"] if not key.startswith("local:")]) == 29
    assert len(check["keys"]) == (58 if fmt == "torch_dist" else 29)
    assert all(diff == 0.0 for rank in check["diffs"] for diff in rank.values())


@pytest.mark.slow
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
    proc = _convert("--loader", "megatron", "--saver", "universal", "--load-dir", os.path.join(llama, "torch"),
                    "--save-dir", tmp_path / "out")  # the legacy files: weights only
    assert proc.returncode == 2 and "optimizer state is not mapped" in proc.stderr and "Traceback" not in proc.stderr
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("tied", [False, True])
def test_legacy_round_trip_at_tp2_pp2(llama, tied, tmp_path, safe_torch_load):
    """--saver megatron at TP 2 x PP 2 (stage-local layer numbers, the last stage's copy of a tied table),
    read back by the Megatron reader: every tensor bitwise equal."""
    import dataclasses

    from hybrid.checkpoint.client_state import ClientState
    from hybrid.conversion.megatron.lm import open_megatron
    from hybrid.conversion.megatron.write import write_megatron
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
    # args that do not say whether the head is tied (an older Megatron-LM's): the last stage's copy of a tied
    # table equals the embedding, an untied head does not; the model read is the one written
    for path in (tmp_path / "out" / "iter_0000003").glob("mp_rank_*/model_optim_rng.pt"):
        content = _as_megatron_wrote_it(path)
        del content["args"].untie_embeddings_and_output_weights
        torch.save(content, path)
    assert open_megatron(str(tmp_path / "out")).config().untie_embeddings_and_output_weights == (not tied)


# --- Megatron's Adam state: a run trained by megatron-core continues here as it would have there ------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """megatron-core trains 5 steps at TP 2 (its GPTDataset's samples, DDP, FP32Optimizer, its LR scheduler:
    no weight decay on norms) and saves torch_dist with its optimizer after step 3; its 5 losses."""
    import numpy as np

    from hybrid.data.indexed import IndexedDatasetBuilder
    out = str(tmp_path_factory.mktemp("megatron-trained"))
    prefix = os.path.join(out, "data")
    rng = np.random.RandomState(0)
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    for _ in range(60):  # documents ending in EOD (NullTokenizer --vocab-size 255: id 255)
        builder.add_document(list(rng.randint(0, 255, size=int(rng.randint(5, 40)))) + [255])
    builder.finalize()
    _reference(out, "llama", "--train", prefix)
    return out, prefix, torch.load(os.path.join(out, "training.pt"), weights_only=False)


def _continue_training(trained, tmp_path, launcher="python", nproc=1, load=None, *flags) -> tuple:
    """launch/train.py with the reference run's flags from its step-3 checkpoint: (losses of iterations 4
    and 5, the run's output)."""
    out, prefix, ref = trained
    t = ref["train"]
    log = str(tmp_path / "log.jsonl")
    proc = run(launcher, nproc, [
        "--load", load or os.path.join(out, "trained"), "--save", tmp_path / "ckpt", "--seq-length", 16,
        "--micro-batch-size", t["micro_batch_size"], "--global-batch-size", t["global_batch_size"],
        "--train-iters", t["iterations"], "--lr", t["lr"], "--min-lr", t["lr"], "--lr-decay-style", "constant",
        "--weight-decay", t["weight_decay"], "--clip-grad", 0, "--data-path", prefix, "--split", "100,0,0",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", 255, "--seed", t["seed"], "--log-interval", 1,
        "--save-interval", 100, "--eval-iters", 0, "--hidden-dropout", 0, "--attention-dropout", 0,
        "--log-json", log, *flags])
    records = [r for r in read_log(log) if "lm_loss" in r and "iteration" in r]
    assert [r["iteration"] for r in records] == [4, 5]
    return [r["lm_loss"] for r in records], proc.stdout + proc.stderr


@pytest.mark.slow
def test_resume_with_megatron_adam_state_continues_megatron_run(trained, tmp_path):
    """--load of the step-3 checkpoint (saved at TP 2) at TP 1 with ZeRO-1: Megatron's Adam moments and step
    come along (as DeepSpeed's universal checkpoint), so iterations 4 and 5 have the losses megatron-core's
    own steps 4 and 5 had; with --no-load-optim (Adam fresh) step 5 differs."""
    losses, out = _continue_training(trained, tmp_path / "adam", "python", 1, None, "--zero-stage", 1)
    expected = trained[2]["losses"][3:]
    assert losses == pytest.approx(expected, abs=1e-5)
    assert "with its Adam state (step 3)" in out
    assert not os.path.exists(tmp_path / "adam" / "ckpt" / ".megatron-universal")
    fresh, out = _continue_training(trained, tmp_path / "fresh", "python", 1, None, "--zero-stage", 1,
                                    "--no-load-optim")
    assert fresh[0] == pytest.approx(expected[0], abs=1e-5) and abs(fresh[1] - expected[1]) > 1e-3
    assert "Adam starts fresh: --no-load-optim" in out


@pytest.mark.slow
def test_megatron_adam_state_at_tp2_zero2_and_through_saver_universal(trained, tmp_path):
    """The same continuation at TP 2 with ZeRO-2 (2 ranks), and at ZeRO-3 from `checkpoint_util.py --loader
    megatron --saver universal` resumed with --universal-checkpoint (the architecture from the flags)."""
    expected = trained[2]["losses"][3:]
    losses, _ = _continue_training(trained, tmp_path / "tp2", "torchrun", 2, None, "--zero-stage", 2,
                                   "--tensor-model-parallel-size", 2)
    assert losses == pytest.approx(expected, abs=1e-5)
    universal = str(tmp_path / "universal")
    proc = _convert("--loader", "megatron", "--saver", "universal", "--load-dir", os.path.join(trained[0], "trained"),
                    "--save-dir", universal)
    assert proc.returncode == 0, proc.stderr[-3000:]
    llama = ["--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4, "--group-query-attention",
             "--num-query-groups", 2, "--swiglu", "--ffn-hidden-size", 96, "--normalization", "RMSNorm",
             "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
             "--use-rope-scaling"]
    losses, _ = _continue_training(trained, tmp_path / "z3", "python", 1, universal, "--zero-stage", 3,
                                   "--universal-checkpoint", *llama)
    assert losses == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("layout", ["legacy_tp2", "legacy_tp2_pp2"])
def test_a_missing_rank_file_is_one_message_naming_it(llama, layout, tmp_path, capsys, safe_torch_load):
    """A legacy Megatron-LM checkpoint without one rank's file is refused (exit 2, the file named, nothing
    written): the layout is the args' TP x PP, not the files found (before: TP 2 without mp_rank_01 read as
    TP 1, and the HF export held half-width tensors)."""
    import shutil

    from hybrid.checkpoint.client_state import ClientState
    from hybrid.conversion.checkpoint_util import main as convert
    from hybrid.conversion.megatron.lm import open_megatron
    from hybrid.conversion.megatron.write import write_megatron
    load = str(tmp_path / "load")
    if layout == "legacy_tp2":  # written by megatron-core itself
        shutil.copytree(os.path.join(llama, "torch"), load)
        gone = os.path.join(f"iter_{ITERATION:07d}", "mp_rank_01")
    else:
        source = open_megatron(os.path.join(llama, "torch_dist"))
        write_megatron(source.state(source.config()), source.config(), 2, 2, load,
                       ClientState(iteration=3, consumed_samples=24))
        gone = os.path.join("iter_0000003", "mp_rank_01_001")
    shutil.rmtree(os.path.join(load, gone))
    capsys.readouterr()
    code = convert(["--no-progress-bar", "--loader", "megatron", "--saver", "hf", "--load-dir", load,
                    "--save-dir", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == 2 and os.path.basename(gone) in err and "incomplete" in err, err
    assert not os.path.exists(tmp_path / "hf")


def test_a_lone_shard_is_never_taken_for_the_whole_tensor():
    """The general rule under every reader (Megatron-LM, Megatron-DeepSpeed, hybrid, universal): a joined tensor
    must have the model's full size (hybrid.checkpoint.tp_layout.full_numels), whatever the TP size claimed."""
    from hybrid.conversion.layout import merge_shards
    from hybrid.errors import ConfigError
    from hybrid.model.config import ModelConfig
    config = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=4, vocab_size=32, ffn_hidden_size=24,
                         max_position_embeddings=8)
    whole = torch.randn(24, 16)
    assert merge_shards({"layers.0.mlp.fc1.weight": {0: whole[:12], 1: whole[12:]}}, config, 2)[
        "layers.0.mlp.fc1.weight"].equal(whole)
    for tp in (1, 2):  # one shard of two, whether TP 2 is known or not
        with pytest.raises(ConfigError, match="layers.0.mlp.fc1.weight joined from 1 TP shard"):
            merge_shards({"layers.0.mlp.fc1.weight": {0: whole[:12]}}, config, tp)


def _megatron_args(**changes):
    """Args as Megatron-LM's parser leaves them for a small GPT (its defaults where the model does not set them)."""
    import argparse
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=128, max_position_embeddings=32,
                seq_length=32, ffn_hidden_size=256, swiglu=False, openai_gelu=True, add_bias_linear=True,
                normalization="LayerNorm", norm_epsilon=1e-5, position_embedding_type="learned_absolute",
                rotary_base=10000, group_query_attention=False, num_query_groups=1, kv_channels=16,
                untie_embeddings_and_output_weights=False, qk_layernorm=False, add_qkv_bias=False,
                apply_layernorm_1p=False, window_size=None, use_rope_scaling=False, rope_scaling_factor=8.0,
                rotary_seq_len_interpolation_factor=None, make_vocab_size_divisible_by=128, init_method_std=0.02,
                rope_type=None, rotary_scaling_factor=1.0, window_attn_skip_freq=None, no_rope_freq=None,
                softmax_type="vanilla", glu_linear_offset=0.0)
    base.update(changes)
    return argparse.Namespace(**base)


# a small DeepSeek-style MLA (its latents normed, as DeepSeek's scripts give --qk-layernorm), YaRN x 40
MLA = dict(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
           q_lora_rank=None, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
           rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=0.5)
QUICK = dict(position_embedding_type="rope", normalization="RMSNorm", openai_gelu=False, quick_geglu=True)
# each mapped argument at a value other than its default -> (the ModelConfig field, the value it must take)
MAPPED = {
    "norm_epsilon": (dict(norm_epsilon=1e-6), "norm_epsilon", 1e-6),
    "layernorm_epsilon (megatron-core's TransformerConfig name, without norm_epsilon)":
        (dict(norm_epsilon=None, layernorm_epsilon=3e-6), "norm_epsilon", 3e-6),
    "rotary_base": (dict(position_embedding_type="rope", rotary_base=500000), "rotary_base", 500000.0),
    "position_embedding_type": (dict(position_embedding_type="rope"), "position_embedding_type", "rope"),
    "normalization": (dict(normalization="RMSNorm"), "normalization", "RMSNorm"),
    "qk_layernorm": (dict(qk_layernorm=True), "qk_layernorm", True),
    "add_qkv_bias": (dict(add_qkv_bias=True, add_bias_linear=False, swiglu=True), "add_qkv_bias", True),
    "apply_layernorm_1p": (dict(apply_layernorm_1p=True), "apply_layernorm_1p", True),
    "window_size": (dict(window_size=(7, 0)), "sliding_window", 8),
    "window_attn_skip_freq": (dict(window_size=(7, 0), window_attn_skip_freq=2), "window_attn_skip_freq", 2),
    "window_attn_skip_freq_list": (dict(window_size=(7, 0), window_attn_skip_freq=[0, 1]), "window_attn_skip_freq",
                                   [0, 1]),
    "untie_embeddings_and_output_weights": (dict(untie_embeddings_and_output_weights=True),
                                            "untie_embeddings_and_output_weights", True),
    "group_query_attention": (dict(group_query_attention=True, num_query_groups=2), "num_query_groups", 2),
    "kv_channels": (dict(kv_channels=32), "kv_channels", 32),
    "ffn_hidden_size": (dict(ffn_hidden_size=96), "ffn_hidden_size", 96),
    "swiglu": (dict(swiglu=True, add_bias_linear=False), "swiglu", True),
    "add_bias_linear": (dict(add_bias_linear=False, swiglu=True), "add_bias_linear", False),
    "max_position_embeddings": (dict(max_position_embeddings=64), "max_position_embeddings", 64),
    "init_method_std": (dict(init_method_std=0.006), "init_method_std", 0.006),
    "use_rope_scaling": (dict(position_embedding_type="rope", use_rope_scaling=True, rope_scaling_factor=16.0),
                         "rope_scaling", lambda v: v["rope_type"] == "llama3" and v["factor"] == 16.0),
    "rotary_seq_len_interpolation_factor": (dict(position_embedding_type="rope", rotary_seq_len_interpolation_factor=4),
                                            "rope_scaling", {"rope_type": "linear", "factor": 4.0}),
    "rope_type rope (the default spelled out)": (dict(position_embedding_type="rope", rope_type="rope"),
                                                 "rope_scaling", None),
    "layernorm_zero_centered_gamma (megatron-core's name of apply_layernorm_1p)":
        (dict(layernorm_zero_centered_gamma=True), "apply_layernorm_1p", True),
    "rotary_percent": (dict(position_embedding_type="rope", rotary_percent=0.5), "rotary_percent", 0.5),
    "moe_router_num_groups": (dict(num_experts=8, add_bias_linear=False, swiglu=True, moe_router_topk=2,
                                   moe_router_num_groups=4, moe_router_group_topk=1), "moe_router_num_groups", 4),
    "moe_router_group_topk": (dict(num_experts=8, add_bias_linear=False, swiglu=True, moe_router_topk=4,
                                   moe_router_num_groups=4, moe_router_group_topk=2), "moe_router_group_topk", 2),
    "mtp_num_layers": (dict(position_embedding_type="rope", mtp_num_layers=2), "mtp_num_layers", 2),
    "mtp_loss_scaling_factor": (dict(position_embedding_type="rope", mtp_num_layers=1, mtp_loss_scaling_factor=0.3),
                                "mtp_loss_scaling_factor", 0.3),
    "multi_latent_attention (its rope YaRN by default, as megatron-core's MLA)": (
        dict(MLA), "rope_scaling",
        lambda v: v["rope_type"] == "yarn" and v["factor"] == 40.0 and v["mscale_all_dim"] == 0.5),
    **{f"{name} (MLA)": (dict(MLA, **{name: value}), name, value) for name, value in (
        ("q_lora_rank", 24), ("kv_lora_rank", 20), ("qk_head_dim", 12), ("qk_pos_emb_head_dim", 8),
        ("v_head_dim", 10))},
    "rope_type rope (MLA without YaRN)": (dict(MLA, rope_type="rope"), "rope_scaling", None),
    "position_embedding_type yarn (and the --yarn-* arguments)": (
        dict(position_embedding_type="yarn", rotary_scaling_factor=32.0, yarn_original_max_position_embeddings=4096,
             yarn_beta_fast=16.0, yarn_beta_slow=2.0, yarn_correction_range_round_to_int=False), "rope_scaling",
        dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=16.0, beta_slow=2.0,
             truncate=False)),
    # GPT-OSS's (Megatron-LM's gpt-oss-20b.sh): learned sinks, the clamped quick-GeGLU, biased experts, its YaRN
    "softmax_type learnable": (dict(position_embedding_type="rope", softmax_type="learnable"), "attention_sinks", True),
    "quick_geglu": (dict(QUICK), "quick_geglu", True),
    "glu_linear_offset": (dict(QUICK, glu_linear_offset=1.0), "glu_linear_offset", 1.0),
    "activation_func_clamp_value": (dict(QUICK, activation_func_clamp_value=7.0), "activation_func_clamp_value", 7.0),
    "add_bias_linear with experts": (dict(QUICK, num_experts=4, moe_router_topk=2), "num_experts", 4),
    "enable_gpt_oss (post-training's: GPT-OSS's YaRN over the rope flags)": (
        dict(position_embedding_type="rope", enable_gpt_oss=True), "rope_scaling",
        dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=131072, beta_fast=32.0, beta_slow=1.0,
             truncate=False)),
    "moe_router_dtype": (dict(num_experts=4, add_bias_linear=False, swiglu=True, moe_router_dtype="fp32"),
                         "moe_router_dtype", "fp32"),
    "moe_router_load_balancing_type as the parser makes it (a one-element list)":
        (dict(num_experts=4, add_bias_linear=False, swiglu=True, moe_router_load_balancing_type=["seq_aux_loss"],
              moe_aux_loss_coeff=[0.01]),
         "moe_router_load_balancing_type", "seq_aux_loss"),
}


@pytest.mark.parametrize("case", list(MAPPED))
def test_every_mapped_megatron_argument_reaches_the_model_at_a_value_other_than_its_default(case):
    """The model a Megatron-LM checkpoint's args describe, each mapped argument given a value other than its default
    (a mapping that read the wrong name or ignored it would leave the default and fail)."""
    from hybrid.conversion.megatron.args import config_from_args
    changes, field, want = MAPPED[case]
    got = getattr(config_from_args(_megatron_args(**changes), where="ckpt"), field)
    default = getattr(config_from_args(_megatron_args(), where="ckpt"), field)
    assert (want(got) if callable(want) else got == want), (case, got)
    assert got != default or field == "rope_scaling", (case, got, default)


REFUSED = {"no_rope_freq": 2, "mtp_hsm": True, "mtp_use_repeated_layer": True, "mtp_hybrid_override_pattern": "*-",
           "mtp_detach_heads": True, "experimental_attention_variant": "gdn",
           "linear_attention_freq": 4, "hybrid_override_pattern": "M*M*", "softmax_type": "off-by-one",
           "attention_output_gate": True, "qk_l2_norm": True,
           "hybrid_layer_pattern": "M*M*", "is_hybrid_model": True, "use_fused_weighted_squared_relu": True,
           "moe_apply_probs_on_input": True, "moe_mlp_glu_interleave_size": 32,
           "moe_shared_expert_glu_interleave_size": 32, "moe_expert_rank_capacity_factor": 1.5,
           "moe_router_force_biased": 0.1, "moe_router_padding_for_quantization": True,
           "moe_router_quantile_balancing_ema": 0.9, "apply_residual_connection_post_layernorm": True, "use_mup": True,
           "enable_mhc_connections": True, "mrope_section": [16, 24, 24], "spec": ["my_module", "my_spec"]}


@pytest.mark.parametrize("name", list(REFUSED))
def test_every_model_changing_megatron_argument_not_computed_is_refused_by_name(name):
    """Arguments that change the mathematics in ways hybrid's model does not compute (before: accepted and ignored,
    e.g. a window on every layer where Megatron alternated windowed and full layers, YaRN read as plain RoPE):
    one message naming the argument and its value. Every refused name is one megatron-core's TransformerConfig or
    Megatron-LM's arguments.py defines; and missing args are one message too."""
    from hybrid.conversion.megatron.args import REFUSED_ARGS, config_from_args
    from hybrid.errors import ConfigError
    assert set(REFUSED) == set(REFUSED_ARGS)
    with pytest.raises(ConfigError, match=re.escape(f"--{name.replace('_', '-')} {REFUSED[name]}")):
        config_from_args(_megatron_args(position_embedding_type="rope", **{name: REFUSED[name]}), where="ckpt")
    args = _megatron_args()
    del args.num_attention_heads
    with pytest.raises(ConfigError, match="lack num_attention_heads"):
        config_from_args(args, where="ckpt")


def test_group_query_attention_without_num_query_groups_is_one_message():
    """Args saying group_query_attention with no num_query_groups (before: a TypeError from int(None)) are one
    message naming both and the fix; with the groups they give the model's key/value heads."""
    from hybrid.conversion.megatron.args import config_from_args
    from hybrid.errors import ConfigError
    assert config_from_args(_megatron_args(group_query_attention=True, num_query_groups=2),
                            where="ckpt").num_query_groups == 2
    with pytest.raises(ConfigError, match="group_query_attention but hold no num_query_groups"):
        config_from_args(_megatron_args(group_query_attention=True, num_query_groups=None), where="ckpt")


def test_no_position_embedding_without_rotary_embeddings_is_refused():
    """--no-position-embedding (add_position_embedding False) with rotary embeddings is Llama's; without them the
    model has no position information, which hybrid does not build (before: read as a learned position table)."""
    from hybrid.conversion.megatron.args import config_from_args
    from hybrid.errors import ConfigError
    assert config_from_args(_megatron_args(add_position_embedding=False, use_rotary_position_embeddings=True),
                            where="ckpt").position_embedding_type == "rope"
    with pytest.raises(ConfigError, match="no position embedding"):
        config_from_args(_megatron_args(add_position_embedding=False), where="ckpt")


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_args_that_do_not_say_whether_the_head_is_tied_are_read_from_the_files(llama, fmt, tmp_path, safe_torch_load):
    """An older Megatron-LM's args without untie_embeddings_and_output_weights: the checkpoint holding a head of its
    own (this untied one) is read untied, its trained head kept (before: exported tied, the head dropped)."""
    import shutil

    from hybrid.conversion.megatron.lm import open_megatron
    source = open_megatron(os.path.join(llama, fmt))
    assert source.args.untie_embeddings_and_output_weights
    load = tmp_path / "old"
    shutil.copytree(os.path.join(llama, fmt), load)
    tag = load / f"iter_{ITERATION:07d}"
    if fmt == "torch":
        for path in tag.glob("mp_rank_*/model_optim_rng.pt"):
            content = _as_megatron_wrote_it(path)  # the file as megatron-core wrote it
            del content["args"].untie_embeddings_and_output_weights
            torch.save(content, path)
    else:
        content = _as_megatron_wrote_it(tag / "common.pt")
        del content["args"].untie_embeddings_and_output_weights
        torch.save(content, tag / "common.pt")
    old = open_megatron(str(load))
    assert old.config().untie_embeddings_and_output_weights
    assert torch.equal(old.state(old.config())["output_layer.weight"],
                       source.state(source.config())["output_layer.weight"])


def test_a_megatron_deepspeed_position_table_beside_rotary_embeddings_is_refused():
    """Megatron-DeepSpeed adds its learned position table to the embeddings unless --no-position-embedding, also with
    --use-rotary-position-embeddings (its own Llama-2 script keeps it): refused by name, never dropped."""
    import argparse

    from hybrid.conversion.megatron.megatron_deepspeed import megatron_lm_args
    from hybrid.errors import ConfigError
    args = argparse.Namespace(num_attention_heads=4, use_rotary_position_embeddings=True, add_position_embedding=True)
    with pytest.raises(ConfigError, match="learned position table"):
        megatron_lm_args(args, "ckpt")
    megatron_lm_args(argparse.Namespace(num_attention_heads=4, use_rotary_position_embeddings=True,
                                        add_position_embedding=False, hidden_size=64), "ckpt")


def test_a_gemma3_model_is_refused_as_a_megatron_checkpoint_before_anything_is_written(tmp_path):
    """Megatron-LM has no argument for Gemma 3's sandwich norms, local rope base or softmax scale: writing one as a
    Megatron-LM checkpoint would describe another model, so it is one message naming them and the HF route, and
    nothing is written (its window pattern alone is Megatron-LM's --window-attn-skip-freq, written as such)."""
    from hybrid.checkpoint.client_state import ClientState
    from hybrid.conversion.megatron.write import megatron_args, write_megatron
    from hybrid.errors import ConfigError
    from hybrid.model.config import ModelConfig
    common = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, position_embedding_type="rope",
                  normalization="RMSNorm", sliding_window=8, window_attn_skip_freq=[1, 1, 0, 1])
    gemma3 = ModelConfig(**common, sandwich_norms=True, local_rotary_base=10000.0, softmax_scale=0.2)
    with pytest.raises(ConfigError, match="--sandwich-norms, --local-rotary-base, --softmax-scale .*--saver hf"):
        write_megatron({}, gemma3, 1, 1, str(tmp_path / "out"), ClientState(iteration=1, consumed_samples=8))
    assert not (tmp_path / "out").exists()
    args = megatron_args(ModelConfig(**common), 1, 1, ClientState(iteration=1, consumed_samples=8))
    assert args.window_attn_skip_freq == [1, 1, 0, 1] and args.window_size == (7, 0)
    # MiniMax-M2's Q/K norms across heads and Mistral 4's query temperature: neither has a Megatron-LM argument
    minimax = ModelConfig(**common, qk_layernorm=True, qk_norm_across_heads=True, llama_4_scaling_beta=0.1,
                          llama_4_scaling_length=16)
    with pytest.raises(ConfigError, match="--qk-norm-across-heads, --llama-4-scaling-beta.*--saver hf"):
        write_megatron({}, minimax, 1, 1, str(tmp_path / "out"), ClientState(iteration=1, consumed_samples=8))
    assert not (tmp_path / "out").exists()


def _hybrid_model(directory: str):
    """hybrid's one-rank model (training mode, where the MTP layers run; dropout off) holding a Megatron checkpoint's
    weights, read as conversion reads them."""
    from hybrid.conversion.megatron.lm import open_megatron, whole_state
    from hybrid.model.gpt import GPTModel
    from hybrid.parallel.groups import ParallelGroups
    ckpt = open_megatron(directory)
    config = dataclasses.replace(ckpt.config(), hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, ParallelGroups.single()).train()
    model.load_state_dict(whole_state(ckpt, config), strict=True)
    return model


@pytest.mark.slow
def test_a_deepseek_v3_style_model_with_mla_and_mtp_exports_with_megatron_core_logits_and_round_trips(tmp_path):
    """megatron-core's GPTModel with MLA (a low-rank query, the latent norms, a value head of its own size, YaRN with
    mscale_all_dim, DeepSeek's rope rows), GLM-4.5's DeepSeek MoE and two MTP depths, at TP 2 + SP: its torch_dist
    (the local spec's names) and the legacy files with Transformer Engine's names (latent norms fused into the up
    projections, the down projections whole on each rank) export to transformers' DeepseekV3ForCausalLM with
    megatron-core's logits, and hybrid's model holding them has megatron-core's loss at each MTP depth (the one its
    training forward logs); --saver megatron writes TE's legacy files at TP 2 and torch_dist, which megatron-core
    loads with every tensor equal (the MTP layers' too), and the local spec's legacy files at TP 2 x PP 2 (the down
    projections split over TP, the MTP layers on the last stage), which read back to the same logits and losses."""
    out = str(tmp_path / "ref")
    _reference(out, "deepseek_v3")
    ref = torch.load(os.path.join(out, "reference.pt"), weights_only=False)
    assert ref["mtp_losses"].shape == (2,)

    def read_back(directory: str, hf_dir: str) -> None:
        import torch.nn.functional as F
        _export_matches(directory, out, hf_dir)
        model = _hybrid_model(directory)
        ids, labels, s = ref["tokens"], ref["labels"], ref["tokens"].size(1)
        logits = model(ids, stage=0)[..., :ref["logits"].size(-1)]  # [3 s, b, V]: the decoder's, depth 1's, 2's
        for k in (1, 2):  # megatron-core's: labels shifted k more, the last k positions masked
            got = F.cross_entropy(logits[k * s:(k + 1) * s].transpose(0, 1)[:, :s - k].reshape(-1, logits.size(-1)),
                                  labels[:, k:].reshape(-1))
            assert abs(got.item() - ref["mtp_losses"][k - 1].item()) < 1e-5, (k, got, ref["mtp_losses"])
    for fmt in ("torch_dist", "torch"):
        read_back(os.path.join(out, fmt), str(tmp_path / f"hf_{fmt}"))
    assert json.load(open(tmp_path / "hf_torch" / "config.json"))["architectures"] == ["DeepseekV3ForCausalLM"]
    written = []
    for fmt, tp in (("torch", 2), ("torch_dist", 1)):
        proc = _convert("--loader", "megatron", "--saver", "megatron", "--load-dir", os.path.join(out, "torch_dist"),
                        "--save-dir", tmp_path / f"back_{fmt}", "--target-tensor-parallel-size", tp, "--ckpt-format",
                        fmt)
        assert proc.returncode == 0, proc.stderr[-3000:]
        written.append((str(tmp_path / f"back_{fmt}"), fmt))
    for fmt, check in _checks_in_megatron_core(out, "deepseek_v3", written, tmp_path).items():
        assert any(key.endswith("linear_kv_down_proj.weight") for key in check["keys"])
        assert any(key.startswith("mtp.layers.1.transformer_layer.mlp.experts") for key in check["keys"])
        assert all(diff == 0.0 for rank in check["diffs"] for diff in rank.values()), check["diffs"]
    proc = _convert("--loader", "megatron", "--saver", "megatron", "--load-dir", os.path.join(out, "torch"),
                    "--save-dir", tmp_path / "local" / "ckpt", "--target-tensor-parallel-size", 2,
                    "--target-pipeline-parallel-size", 2, "--ckpt-format", "torch", "--saver-transformer-impl", "local")
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = torch.load(tmp_path / "local" / "ckpt" / f"iter_{ITERATION:07d}" / "mp_rank_01_001" / "model_optim_rng.pt",
                      weights_only=True)["model"]
    assert last["decoder.layers.0.self_attention.linear_kv_down_proj.weight"].shape[0] == (16 + 8) // 2
    assert "mtp.layers.1.eh_proj.weight" in last
    first = torch.load(tmp_path / "local" / "ckpt" / f"iter_{ITERATION:07d}" / "mp_rank_01_000" / "model_optim_rng.pt",
                       weights_only=True)["model"]  # (megatron-core builds the embeddings on the MTP stage too)
    assert torch.equal(last["embedding.word_embeddings.weight"], first["embedding.word_embeddings.weight"])
    read_back(str(tmp_path / "local" / "ckpt"), str(tmp_path / "hf_local"))


@pytest.mark.slow
def test_a_gpt_oss_style_model_exports_with_megatron_core_logits_and_round_trips(tmp_path):
    """megatron-core's GPTModel as Megatron-LM's gpt-oss-20b.sh builds it, scaled down, at TP 2 + SP (expert-TP 1, where
    megatron-core builds biased experts): learned sinks (core_attention.softmax_offset), windowed and full layers
    alternating, biases on QKV, output, router and experts, the clamped quick-GeGLU, a softmax top-2 router,
    --enable-gpt-oss's YaRN. Its torch_dist and its legacy files (each TP rank's holding the whole experts) export to
    transformers' GptOssForCausalLM with megatron-core's logits; --saver megatron writes legacy files at TP 2 and
    torch_dist, which megatron-core loads with every tensor equal."""
    out = str(tmp_path / "ref")
    _reference(out, "gpt_oss")
    for fmt in ("torch_dist", "torch"):  # (the sinks' softmax and the clamped GLU in another order: 8.7e-6 measured)
        _export_matches(os.path.join(out, fmt), out, str(tmp_path / f"hf_{fmt}"), atol=2e-5)
    hf_config = json.load(open(tmp_path / "hf_torch" / "config.json"))
    assert hf_config["architectures"] == ["GptOssForCausalLM"]
    assert hf_config["layer_types"] == ["sliding_attention", "full_attention"] and hf_config["sliding_window"] == 4
    written = []
    for fmt, tp in (("torch", 2), ("torch_dist", 1)):
        proc = _convert("--loader", "megatron", "--saver", "megatron", "--load-dir", os.path.join(out, "torch_dist"),
                        "--save-dir", tmp_path / f"back_{fmt}", "--target-tensor-parallel-size", tp, "--ckpt-format",
                        fmt)
        assert proc.returncode == 0, proc.stderr[-3000:]
        written.append((str(tmp_path / f"back_{fmt}"), fmt))
    for fmt, check in _checks_in_megatron_core(out, "gpt_oss", written, tmp_path).items():
        for part in ("core_attention.softmax_offset", "router.bias", "local_experts.3.linear_fc2.bias"):
            assert any(key.endswith(part) for key in check["keys"]), part
        assert all(diff == 0.0 for rank in check["diffs"] for diff in rank.values()), check["diffs"]


YARNS = [  # (multi-latent attention, rope_scaling): each as Megatron-LM's args say it
    (True, {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0}),  # DeepSeek-V3's
    (True, {"factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}),
    (False, {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
             "truncate": False}),  # GPT-OSS's
    (False, {"factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 16.0, "beta_slow": 2.0,
             "attention_factor": 1.3}),
    (False, {"factor": 2.0, "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
             "mscale": 0.7, "mscale_all_dim": 0.5}),
]


@pytest.mark.parametrize("mla,yarn", YARNS)
def test_a_yarn_rope_is_written_as_megatron_args_that_read_back_to_it(mla, yarn):
    """--saver megatron's args for a YaRN rope (MLA's --rope-type yarn, else --position-embedding-type yarn and the
    --yarn-* arguments) read back, through the reader Megatron-LM checkpoints go through, to the same rope; MLA's
    YaRN, whose original context and betas no argument sets, is refused where they differ from megatron-core's."""
    from hybrid.checkpoint.client_state import ClientState
    from hybrid.conversion.megatron.args import config_from_args
    from hybrid.conversion.megatron.write import megatron_args
    from hybrid.errors import ConfigError
    from hybrid.model.config import ModelConfig
    mla_fields = dict(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=8, kv_lora_rank=8, qk_head_dim=8,
                      qk_pos_emb_head_dim=4, v_head_dim=8) if mla else {}
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                         position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                         rope_scaling=dict(yarn, rope_type="yarn"), **mla_fields)
    back = config_from_args(megatron_args(config, 1, 1, ClientState(iteration=1, consumed_samples=8)))
    assert back.rope_scaling.keys() == config.rope_scaling.keys()
    for key, value in config.rope_scaling.items():
        assert back.rope_scaling[key] == pytest.approx(value, rel=1e-12) if isinstance(value, float) else \
            back.rope_scaling[key] == value, key
    assert back.attention_scale == pytest.approx(config.attention_scale, rel=1e-12)
    if mla:
        odd = dataclasses.replace(config, rope_scaling=dict(config.rope_scaling, original_max_position_embeddings=8192))
        with pytest.raises(ConfigError, match="original context 4096"):
            megatron_args(odd, 1, 1, ClientState(iteration=1, consumed_samples=8))
        llama3 = dataclasses.replace(config, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 8192})
        with pytest.raises(ConfigError, match="llama3 scaling, which megatron-core's MLA does not compute"):
            megatron_args(llama3, 1, 1, ClientState(iteration=1, consumed_samples=8))
