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


# the entry scripts a test may run on warm pool ranks instead of a new launch: script -> module with `main(argv)`
IN_PROCESS = {"launch/train.py": "hybrid.training.run", "launch/evaluate.py": "hybrid.evaluation",
              "conversion/checkpoint_util.py": "hybrid.conversion.checkpoint_util",
              "launch/generate.py": "hybrid.generation"}
REAL_LAUNCHES = "HYBRID_TEST_REAL_LAUNCHES"  # set to 1: every run() starts its launcher, as before the pool


def run(launcher: str, nproc: int, flags: list[str], script: str = "launch/train.py", timeout: int = 600,
        check: bool = True, launch: bool = False) -> subprocess.CompletedProcess:
    """`script flags` on `nproc` ranks -> its exit status and output.

    The entry runs on warm gloo ranks of the pool (checks/rank_pool.py: imports done once per pool, the
    script's own `main(argv)` called on every rank, its output captured), which is what a launcher would run
    minus the process start; the tests that are about launching itself (the launchers, restarts, signals,
    process memory) pass `launch=True`, as do the `deepspeed` and `accelerate` launchers."""
    argv = [str(f) for f in flags]
    if launch or launcher in ("deepspeed", "accelerate") or script not in IN_PROCESS or os.environ.get(REAL_LAUNCHES):
        from checks.rank_pool import build_deepspeed_cpu_ops
        build_deepspeed_cpu_ops()
        proc = subprocess.run(command(launcher, nproc, script) + argv, cwd=ROOT, env=env(), capture_output=True,
                              text=True, timeout=timeout)
    else:
        assert launcher in ("python", "torchrun") and (nproc == 1 or launcher == "torchrun"), (launcher, nproc)
        proc = _run_in_pool(launcher, nproc, script, argv, timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{launcher} x{nproc} {script} exited {proc.returncode}\n--- stdout ---\n"
                             f"{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def _run_in_pool(launcher: str, nproc: int, script: str, argv: list, timeout: int) -> subprocess.CompletedProcess:
    """The pooled run: each rank's exit status, stdout and stderr; a rank that gave none within 15 s of another
    rank's failure (waiting in a collective its failed peer never joins) counts as killed, as a launcher kills
    it. torchrun's status is 1 when any rank failed (its ChildFailedError), python's the rank's own."""
    from checks.rank_pool import run_on_ranks
    results = run_on_ranks(_entry_on_rank, nproc, script, argv, timeout=timeout,
                           failed=lambda result: result[0] != 0, partial=True)
    results = [r if r is not None else (-9, "", "(killed: no result after a peer failed)\n") for r in results]
    codes = [code for code, _, _ in results]
    code = codes[0] if launcher == "python" else int(any(codes))
    return subprocess.CompletedProcess(argv, code, "".join(out for _, out, _ in results),
                                       "".join(err for _, _, err in results))


def _entry_on_rank(script: str, argv: list):
    """On a pool rank: the script's `main(argv)` in ROOT with file descriptors 1 and 2 captured -> (exit status,
    stdout, stderr), with a launched interpreter's outcomes for SystemExit and uncaught exceptions."""
    import importlib
    import tempfile
    import traceback
    main = importlib.import_module(IN_PROCESS[script]).main
    cwd = os.getcwd()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        os.chdir(ROOT)
        try:
            try:
                code = main(argv)
            except SystemExit as error:  # as the interpreter reports it
                code = error.code if isinstance(error.code, int) else 0 if error.code is None else 1
                if not isinstance(error.code, (int, type(None))):
                    print(error.code, file=sys.stderr)
            except BaseException:  # an uncaught exception: its traceback and status 1
                traceback.print_exc()
                code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            os.chdir(cwd)
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode("utf-8", "replace"))
    return (code or 0, *texts)


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
