"""The README's tutorial, block by block, exactly as written (preprocess, the Megatron run script with
TensorBoard and wandb, resume, convert to HuggingFace and load with transformers, fine-tune, continue
pretraining a HuggingFace model with --load-hf and export it), run in a
scratch directory that links the repository's launch/, conversion/, ds_configs/ and hybrid/."""

import ast
import glob
import os
import subprocess

import pytest

from checks.docs import page_with
from checks.launch_helpers import BIN, ROOT, env


def _blocks() -> list[str]:
    readme = page_with("tutorial")
    return [part.split("```bash", 1)[1].split("```", 1)[0] for part in readme.split("<!-- tutorial -->")[1:]]


def _run(block: str, cwd, shim: str) -> str:
    environment = env()
    environment["PATH"] = os.pathsep.join([shim, BIN, environment.get("PATH", "")])
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (f"{block}\n--- stdout ---\n{proc.stdout[-4000:]}\n"
                                  f"--- stderr ---\n{proc.stderr[-4000:]}")
    return proc.stdout + "\n" + proc.stderr


def _iteration(checkpoint_dir) -> str:
    return open(os.path.join(checkpoint_dir, "latest")).read().strip()


@pytest.mark.slow
def test_readme_tutorial_runs_block_by_block(tmp_path, deepspeed_on_a_free_port):
    for name in ("launch", "conversion", "ds_configs", "hybrid"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    blocks = _blocks()
    assert len(blocks) == 6, ("the README tutorial has six blocks: preprocess, train, resume, convert, fine-tune, "
                              "start from a HuggingFace model")
    preprocess, train, resume, convert, finetune, from_hf = blocks
    tutorial = tmp_path / "tutorial"

    _run(preprocess, tmp_path, deepspeed_on_a_free_port)
    assert (tutorial / "corpus_text_document.bin").stat().st_size > 100_000
    assert (tutorial / "corpus_text_document.idx").exists()

    out = _run(train, tmp_path, deepspeed_on_a_free_port)
    assert "TP=2" in out and _iteration(tutorial / "ckpt") == "iter_0000020"
    assert glob.glob(str(tutorial / "tensorboard" / "**" / "events.out.tfevents.*"), recursive=True)
    assert glob.glob(str(tutorial / "wandb" / "offline-run-*"))

    out = _run(resume, tmp_path, deepspeed_on_a_free_port)
    assert "loaded checkpoint tutorial/ckpt/iter_0000020 at iteration 20" in out
    assert _iteration(tutorial / "ckpt") == "iter_0000040"

    out = _run(convert, tmp_path, deepspeed_on_a_free_port)
    assert (tutorial / "hf" / "config.json").exists()
    sample = [ast.literal_eval(line[len("sample: "):]) for line in out.splitlines() if line.startswith("sample: ")]
    assert sample and sample[0].startswith("The Python") and len(sample[0]) > len("The Python"), out[-2000:]

    out = _run(finetune, tmp_path, deepspeed_on_a_free_port)
    assert "for fine-tuning" in out and _iteration(tutorial / "finetuned") == "iter_0000010"

    out = _run(from_hf, tmp_path, deepspeed_on_a_free_port)
    assert "loaded the qwen3 weights of tutorial/qwen3 (--load-hf)" in out and "TP=2" in out
    assert _iteration(tutorial / "qwen3-cpt") == "iter_0000010"
    assert "Qwen3ForCausalLM" in [line.strip() for line in out.splitlines()], out[-2000:]
