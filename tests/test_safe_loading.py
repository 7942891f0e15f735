"""Nothing hybrid loads runs code (every other launched test resumes and converts under the same
allow-list): a pickle whose __reduce__ calls os.system is planted in each kind of file hybrid or DeepSpeed reads (model
states, ZeRO partitions, pipeline layer files, universal-checkpoint
files, DeepSpeed's ds_to_universal input, a HuggingFace pytorch_model.bin); every load refuses it with one
message naming the file and the class, and the command never runs. With --allow-unsafe-checkpoint-load it
does run (the payload is real, so the refusals above mean something)."""

import glob
import os

import pytest

from hybrid.safe_loading import safe_load
from checks.launch_helpers import run
from tests.test_training import TINY

REFUSED = "refused to unpickle posix.system"


class Payload:
    """Unpickling it runs `touch MARKER`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(path, marker):
    """Add the payload to the file, and (as whoever made a malicious checkpoint would) a matching manifest."""
    import torch
    from hybrid.checkpoint.manifest import MANIFEST, write_manifest
    state = safe_load(path)
    state["payload"] = Payload(marker)
    torch.save(state, path)
    folder = os.path.dirname(str(path))
    while folder != os.path.dirname(folder):
        if os.path.isfile(os.path.join(folder, MANIFEST)):
            write_manifest(folder)
            break
        folder = os.path.dirname(folder)


@pytest.fixture(scope="module")
def saved(data, tmp_path_factory):
    """A ZeRO-1 checkpoint at iteration 2 (and its universal form), and DeepSpeed pipeline-engine layer files (PP 2:
    tests/data/pipeline_engine); fresh copies per test."""
    root = tmp_path_factory.mktemp("saved")
    zero1 = root / "zero1"
    run("python", 1, TINY + ["--data-path", data, "--train-iters", 2, "--save", zero1, "--deepspeed",
                             "ds_configs/zero1.json", "--log-json", root / "zero1.jsonl"])
    from hybrid.conversion.checkpoint_util import main
    assert main(["--saver", "universal", "--load-dir", str(zero1), "--no-progress-bar"]) == 0
    pp2 = root / "pp2"
    import shutil
    shutil.copytree(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "pipeline_engine", "ckpt"), pp2)
    return zero1, pp2


def _copy(src, tmp_path):
    import shutil
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def _refused(proc, path, marker):
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert REFUSED in proc.stderr and os.path.basename(str(path)) in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.split(REFUSED)[0][-2000:]
    assert not os.path.exists(marker), "the planted command ran"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["model_states", "zero_partition", "universal_file"])
def test_resume_refuses_a_planted_pickle(kind, saved, data, tmp_path):
    ckpt = _copy(saved[0], tmp_path)
    marker = tmp_path / "ran"
    flags = TINY + ["--data-path", data, "--load", ckpt, "--deepspeed", "ds_configs/zero1.json"]
    if kind == "model_states":
        path = ckpt / "iter_0000002" / "mp_rank_00_model_states.pt"
    elif kind == "zero_partition":
        path = glob.glob(str(ckpt / "iter_0000002" / "*optim_states.pt"))[0]
    else:
        path = ckpt / "iter_0000002_universal" / "zero" / "layers.1.mlp.fc1.weight" / "fp32.pt"
        flags.append("--universal-checkpoint")
    plant(path, marker)
    _refused(run("python", 1, flags, check=False), path, marker)


def _convert(*flags):
    """The conversion script, launched as a user runs it."""
    return run("python", 1, [str(f) for f in flags] + ["--no-progress-bar"], script="conversion/checkpoint_util.py",
               check=False)


def _convert_here(capsys, *flags):
    """The conversion script's main in this process (no interpreter start-up), as a completed process."""
    from types import SimpleNamespace
    from hybrid.conversion.checkpoint_util import main
    capsys.readouterr()
    code = main([str(f) for f in flags] + ["--no-progress-bar"])
    return SimpleNamespace(returncode=code, stderr=capsys.readouterr().err)


def test_conversion_refuses_planted_pickles_in_layer_files_deepspeeds_tool_input_and_hf_bin(saved, tmp_path, capsys):
    pp2 = _copy(saved[1], tmp_path)
    marker = tmp_path / "ran"
    layer = pp2 / "iter_0000002" / "layer_02-model_00-model_states.pt"
    plant(layer, marker)
    _refused(_convert_here(capsys, "--load-dir", pp2, "--save-dir", tmp_path / "out", "--saver", "hf"), layer, marker)
    assert not (tmp_path / "out").exists(), "nothing half-written"

    zero1 = _copy(saved[0], tmp_path)
    partition = glob.glob(str(zero1 / "iter_0000002" / "*optim_states.pt"))[0]
    plant(partition, marker)  # read by DeepSpeed's ds_to_universal, in its own process
    _refused(_convert_here(capsys, "--saver", "universal", "--load-dir", zero1), partition, marker)

    from transformers import GPT2Config, GPT2LMHeadModel
    hf = tmp_path / "hf"
    import torch
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    model.save_pretrained(hf)
    os.remove(hf / "model.safetensors")  # the older format, which is a pickle
    torch.save(dict(model.state_dict()), hf / "pytorch_model.bin")
    plant(hf / "pytorch_model.bin", marker)
    _refused(_convert_here(capsys, "--loader", "hf", "--load-dir", hf, "--save-dir", tmp_path / "out2"),
             hf / "pytorch_model.bin", marker)


def test_unsafe_flag_unpickles_fully_so_the_payload_is_real(saved, tmp_path):
    pp2 = _copy(saved[1], tmp_path)
    marker = tmp_path / "ran"
    plant(pp2 / "iter_0000002" / "layer_02-model_00-model_states.pt", marker)
    proc = _convert("--load-dir", pp2, "--save-dir", tmp_path / "out", "--saver", "hf",
                    "--allow-unsafe-checkpoint-load")
    assert os.path.exists(marker), proc.stderr[-2000:]


@pytest.mark.parametrize("content", ["text", "truncated", "empty"])
def test_a_file_that_is_no_readable_checkpoint_is_one_message_not_a_refusal(content, tmp_path):
    """safe_load (every checkpoint file hybrid reads itself) on bytes that are no torch file, or a cut one:
    one ConfigError naming the file and saying it is damaged, never the "refused to unpickle" of a file that
    asks for code (which would send the user to --allow-unsafe-checkpoint-load)."""
    import torch

    from hybrid.errors import ConfigError
    from hybrid.safe_loading import UnsafeCheckpointError, safe_load
    path = tmp_path / "model_optim_rng.pt"
    if content == "text":
        path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n")  # an LFS pointer
    else:
        torch.save({"w": torch.ones(64)}, path)
        with open(path, "r+b") as f:
            f.truncate(0 if content == "empty" else 200)
    for mmap in (False, True):
        with pytest.raises(ConfigError, match=f"checkpoint file {path} is unreadable") as caught:
            safe_load(str(path), mmap=mmap)
        assert not isinstance(caught.value, UnsafeCheckpointError) and "truncated, damaged" in str(caught.value)
