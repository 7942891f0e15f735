"""Start launch/*.py the way users do (python, torchrun, deepspeed, accelerate) and read --log-json."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from hybrid.distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
DEFAULT_ASSETS = os.path.join(ROOT, "hybrid", "data", "default")
VOCAB = os.path.join(DEFAULT_ASSETS, "vocab.json")
MERGES = os.path.join(DEFAULT_ASSETS, "merges.txt")


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline",
             HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(key, None)
    return e


def command(launcher: str, nproc: int, script: str) -> list[str]:
    path = os.path.join(ROOT, script)
    port = str(free_port())
    if launcher == "python":
        assert nproc == 1
        return [sys.executable, path]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", port, path]
    if launcher == "deepspeed":
        return [os.path.join(BIN, "deepspeed"), "--num_gpus", str(nproc), "--master_port", port, path]
    if launcher == "accelerate":
        return [os.path.join(BIN, "accelerate"), "launch", "--config_file",
                os.path.join(ROOT, "launch", "accelerate", "zero2.yaml"), "--num_processes", str(nproc),
                "--main_process_port", port, path]
    raise ValueError(launcher)


def run(launcher: str, nproc: int, flags: list[str], script: str = "launch/train.py", timeout: int = 600,
        check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(command(launcher, nproc, script) + [str(f) for f in flags], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{launcher} x{nproc} {script} exited {proc.returncode}\n--- stdout ---\n"
                             f"{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


_ONE_RANK: dict = {}  # flags -> log records, for the whole test run


def one_rank(flags: list) -> list[dict]:
    """The log records of the one-rank run of `flags` (a baseline), run once per test run whichever
    modules ask for it."""
    key = tuple(map(str, flags))
    if key not in _ONE_RANK:
        import tempfile
        log = os.path.join(tempfile.mkdtemp(prefix="hybrid-baseline-"), "log.jsonl")
        run("python", 1, list(flags) + ["--log-json", log])
        _ONE_RANK[key] = read_log(log)
    return _ONE_RANK[key]


def one_rank_runs(data: str, base_flags: list, untied_flags: list):
    """`get(untied)` -> the log records of the uninterrupted one-rank run of `base_flags`, with or
    without `untied_flags` (the baseline a module's layouts are compared with)."""
    return lambda untied: one_rank(base_flags + ["--data-path", data, *(untied_flags if untied else [])])


def read_log(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def copy_default_corpus(directory) -> str:
    """The embedded corpus's token files in `directory` (index caches get written beside them)."""
    from hybrid.data.default import default_data_prefix
    prefix = default_data_prefix()
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, os.path.join(directory, "corpus_text_document" + ext))
    return os.path.join(directory, "corpus_text_document")
