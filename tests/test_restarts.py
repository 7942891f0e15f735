"""Restarts that never hang: under `torchrun --max-restarts 1` with --save D --load D, a rank killed with
SIGKILL mid-iteration, mid-save or after the last save is restarted and the job finishes with the
uninterrupted run's losses (dropout on: bitwise), or exits at once when nothing is left; every process
group honours --distributed-timeout-minutes, so a peer that stops answering ends a collective within it."""

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from hybrid.checkpoint.manifest import MANIFEST
from checks.launch_helpers import MERGES, ROOT, VOCAB, command, env, read_log, run

FLAGS = ["--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 32,
         "--micro-batch-size", 2, "--global-batch-size", 8, "--train-iters", 12, "--save-interval", 4,
         "--lr", 1e-3, "--lr-warmup-iters", 2, "--eval-iters", 0, "--log-interval", 1, "--vocab-file", VOCAB,
         "--merge-file", MERGES, "--no-progress-bar", "--deepspeed", "ds_configs/zero1.json"]


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    run("torchrun", 2, FLAGS + ["--data-path", data, "--save", out / "ckpt", "--log-json", out / "log.jsonl"])
    return {r["iteration"]: r["lm_loss"] for r in read_log(out / "log.jsonl")}, out / "ckpt"


def _rank_process(launcher: psutil.Process, rank: str):
    for child in launcher.children(recursive=True):
        try:
            if "launch/train.py" in " ".join(child.cmdline()) and child.environ().get("RANK") == rank:
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def _run_and_kill(flags, trigger, timeout=300, ready=" iteration        2/"):
    """Launch under torchrun --max-restarts 1; rank 1's process is looked up once `ready` is in the output
    and SIGKILLed the first time `trigger(output so far)` holds (polled every few milliseconds).
    Returns (exit code, output, whether a kill happened)."""
    import threading
    cmd = command("torchrun", 2, "launch/train.py")
    cmd.insert(cmd.index("--nproc_per_node"), "--max-restarts=1")
    proc = subprocess.Popen(cmd + [str(f) for f in flags], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    output = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    launcher, victim, killed, start = psutil.Process(proc.pid), None, False, time.time()
    while proc.poll() is None:
        assert time.time() - start < timeout, "".join(output[-50:])
        if not killed:
            text = "".join(output)
            if victim is None and ready in text:
                victim = _rank_process(launcher, "1")  # found ahead, so the kill itself takes no search
            if victim is not None and trigger(text):
                victim.kill()
                killed = True
        time.sleep(0.002)
    reader.join(timeout=10)
    return proc.returncode, "".join(output), killed


def _losses(log):
    out = {}
    for record in read_log(log):
        out[record["iteration"]] = record["lm_loss"]  # a restarted stretch logs its iterations again
    return out


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["mid-iteration", "mid-save", "mid-async-save", "after-the-last-save"])
def test_a_rank_killed_at_any_moment_restarts_and_finishes_with_the_uninterrupted_losses(
        moment, data, uninterrupted, tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    flags = FLAGS + ["--data-path", data, "--save", ckpt, "--load", ckpt, "--log-json", log]
    if moment == "mid-async-save":  # killed while the background writer has iteration 8 half on disk
        flags.append("--async-save")

    def trigger(output):
        if moment == "mid-iteration":
            return " iteration        6/" in output
        if moment in ("mid-save", "mid-async-save"):  # iteration 8's files are being written; no manifest yet
            return (ckpt / "iter_0000008").is_dir() and not (ckpt / "iter_0000008" / MANIFEST).exists()
        return "saved checkpoint iter_0000012" in output

    code, output, killed = _run_and_kill(flags, trigger)
    assert killed and code == 0, output[-3000:]
    assert _losses(log) == uninterrupted[0], output[-3000:]
    if moment == "after-the-last-save":
        assert "nothing to train: the newest checkpoint" in output
    elif moment in ("mid-save", "mid-async-save"):  # the half-written iteration 8 is passed over for iteration 4
        assert "loaded checkpoint" in output and "iter_0000004 at iteration 4" in output, output[-3000:]
    else:
        assert "loaded checkpoint" in output


def _tensors(obj, prefix=""):
    import torch
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if key not in ("args", "run"):  # the flags differ (--async-save, paths)
                yield from _tensors(value, f"{prefix}.{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}[{i}]")


@pytest.mark.slow
def test_async_save_writes_the_synchronous_checkpoints_bit_for_bit_and_trains_the_same(data, uninterrupted, tmp_path):
    import torch
    losses, sync_dir = uninterrupted
    log = tmp_path / "log.jsonl"
    proc = run("torchrun", 2, FLAGS + ["--data-path", data, "--save", tmp_path / "ckpt", "--log-json", log,
                                       "--async-save"])
    assert _losses(log) == losses
    assert (tmp_path / "ckpt" / "latest").read_text() == "iter_0000012"
    assert proc.stdout.count("saved checkpoint iter_") == 3
    # the saves at iterations 4 and 8 are in the next records; a background write's completion joins whichever record
    # follows it (a busy machine may complete iteration 4's only at the save of iteration 8, in that save's stall)
    stalls = {r["iteration"]: r["checkpoint_stall_s"] for r in read_log(log) if "checkpoint_stall_s" in r}
    assert {5, 9} <= set(stalls) and all(s > 0 for s in stalls.values()), stalls
    for tag in ("iter_0000004", "iter_0000008", "iter_0000012"):
        files = sorted(f.name for f in (sync_dir / tag).glob("*.pt"))
        assert files == sorted(f.name for f in (tmp_path / "ckpt" / tag).glob("*.pt")) and len(files) == 3
        for name in files:
            want = dict(_tensors(torch.load(sync_dir / tag / name, weights_only=False)))
            got = dict(_tensors(torch.load(tmp_path / "ckpt" / tag / name, weights_only=False)))
            assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), (tag, name)


@pytest.mark.slow
def test_a_peer_that_stops_answering_ends_a_deepspeed_group_collective_within_the_timeout(tmp_path):
    """DeepSpeed makes its TP/DP/PP groups with torch's default timeout (30 minutes on gloo); hybrid
    makes --distributed-timeout-minutes the default of every group."""
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        import torch, torch.distributed as dist
        from hybrid.distributed import init_distributed
        from hybrid.parallel.groups import build_groups
        init_distributed(0.05, "gloo")  # 3 seconds
        groups = build_groups(tensor_parallel=2)
        if dist.get_rank() == 1:
            time.sleep(60)
            sys.exit(0)
        start = time.time()
        try:
            dist.all_reduce(torch.ones(1), group=groups.tp.group)
        except RuntimeError as error:
            print("TIMEOUT", round(time.time() - start, 1), str(error).splitlines()[0][:120], flush=True)
    """))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(__import__("hybrid.distributed", fromlist=["free_port"]).free_port()), str(script)]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("TIMEOUT"):
            seconds = float(line.split()[1])
            proc.kill()
            assert seconds < 20, line
            assert "Timed out" in line, line
            return
    pytest.fail("the collective never returned")


def _raise_in_a_collective(error):
    """Raise `error` from a frame of torch.distributed, as gloo's and NCCL's failures arrive."""
    exec(compile("raise error", os.path.join(os.sep, "torch", "distributed", "distributed_c10d.py"), "exec"),
         {"error": error})


def test_a_failed_collective_is_one_message_and_its_own_exit_status(capsys, monkeypatch):
    from hybrid.training import run as loop
    error = RuntimeError("[/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation")
    monkeypatch.setattr(loop, "run_training", lambda argv: _raise_in_a_collective(error))
    assert loop.main(["--distributed-timeout-minutes", "0.5"]) == loop.PEER_FAILED
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: rank 0: a collective with another rank failed")
    assert "--distributed-timeout-minutes 0.5" in err and "Timed out waiting 3000ms" in err
    other = RuntimeError("shape mismatch")  # not a communication failure: a real bug keeps its traceback
    monkeypatch.setattr(loop, "run_training", lambda argv: (_ for _ in ()).throw(other))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        loop.main([])
    # a peer's words outside a collective (a data loader's own timeout) are not a dead peer either
    loader = RuntimeError("DataLoader timed out after 5 seconds")
    monkeypatch.setattr(loop, "run_training", lambda argv: (_ for _ in ()).throw(loader))
    with pytest.raises(RuntimeError, match="DataLoader timed out"):
        loop.main([])
