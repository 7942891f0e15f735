"""HF <-> hybrid conversion, resharding, launch/evaluate.py, fine-tuning with frozen layers.

Tiny random GPT-2 and Llama (GQA, untied head) models are made from configs and save_pretrained
locally; nothing comes from a hub.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from hybrid.conversion.layout import read_hybrid
from checks.launch_helpers import MERGES, VOCAB, read_log, run

VOCAB_SIZE = 8192  # the embedded tokenizer's


def make_gpt2(path):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB_SIZE, n_positions=64, n_embd=32, n_layer=4, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(path)
    return model


def make_llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
                         bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # HF inits norms to 1: perturb so the test sees a wrong mapping
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


MAKERS = {"gpt2": make_gpt2, "llama": make_llama}


def convert(*flags, check=True):
    """conversion/checkpoint_util.py with these flags. Successful conversions run in this process (the
    script's own main, no interpreter start-up per call); `check=False` launches the script, to see its
    exit status and error output as a user does."""
    if check:
        from hybrid.conversion.checkpoint_util import main
        assert main([str(f) for f in flags] + ["--no-progress-bar"]) == 0, flags
        return None
    return run("python", 1, list(flags) + ["--no-progress-bar"], script="conversion/checkpoint_util.py",
               check=False, timeout=300)


def hf_windows_loss(model, prefix, seq, count):
    from hybrid.evaluation import stream_windows
    windows = torch.from_numpy(stream_windows(prefix, seq, count))
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                             windows[:, 1:].reshape(-1)).item()


def assert_state_equal(got: dict, want: dict):
    assert set(got) == set(want), set(got) ^ set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_import_at_tp2_pp2_evaluates_to_transformers_loss_and_exports_back_exactly(family, data, tmp_path):
    from safetensors.torch import load_file
    hf_dir, ckpt, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    model = MAKERS[family](hf_dir)
    convert("--loader", "hf", "--load-dir", hf_dir, "--save-dir", ckpt, "--target-tensor-parallel-size", 2,
            "--target-pipeline-parallel-size", 2)
    assert (ckpt / "latest").read_text() == "iter_0000000"
    log = tmp_path / "eval.jsonl"
    proc = run("torchrun", 4, ["--load", ckpt, "--data-path", data, "--seq-length", 32, "--micro-batch-size", 2,
                               "--eval-iters", 3, "--log-json", log], script="launch/evaluate.py")
    ours = read_log(log)[0]
    want = hf_windows_loss(model.eval(), data, 32, 6)
    assert ours["tokens"] == 6 * 32 and '"lm_loss"' in proc.stdout
    assert abs(ours["lm_loss"] - want) <= 1e-4 * abs(want), (ours["lm_loss"], want)

    convert("--load-dir", ckpt, "--save-dir", back, "--hf-convert", "--vocab-file", VOCAB, "--merge-file", MERGES)
    original = load_file(str(hf_dir / "model.safetensors"))
    exported = load_file(str(back / "model.safetensors"))
    assert_state_equal(exported, original)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    reloaded, info = AutoModelForCausalLM.from_pretrained(back, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(reloaded).__name__ == type(model).__name__
    tokenizer = AutoTokenizer.from_pretrained(back)
    ids = tokenizer("The Python language", return_tensors="pt")["input_ids"]
    assert ids.numel() > 1
    out = reloaded.eval().generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    want_out = model.eval().generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert out.shape[1] == ids.shape[1] + 5
    assert torch.equal(out, want_out), "the export generates what the original model generates (greedy)"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_resharding_tp2pp2_to_tp1pp1_to_tp4pp1_is_exact(family, tmp_path):
    MAKERS[family](tmp_path / "hf")
    last_tp = 4 if family == "gpt2" else 2  # Llama's 2 query groups cannot split over 4 ranks
    a, b, c = tmp_path / "tp2pp2", tmp_path / "tp1pp1", tmp_path / "tp4pp1"
    convert("--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", a, "--target-tensor-parallel-size", 2,
            "--target-pipeline-parallel-size", 2)
    convert("--load-dir", a, "--save-dir", b, "--target-tensor-parallel-size", 1)
    convert("--loader", "megatron", "--saver", "hybrid", "--load-dir", b, "--save-dir", c,
            "--target-tensor-parallel-size", last_tp)
    assert len(list((c / "iter_0000000").glob("mp_rank_*_model_states.pt"))) == last_tp
    full_a, _ = read_hybrid(str(a))
    assert_state_equal(read_hybrid(str(b))[0], full_a)
    assert_state_equal(read_hybrid(str(c))[0], full_a)


@pytest.mark.slow
def test_trained_tp2_zero1_checkpoint_exports_to_transformers_with_equal_logits(data, tmp_path):
    ckpt, hf_dir = tmp_path / "ckpt", tmp_path / "hf"
    flags = ["--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 32,
             "--max-position-embeddings", 64, "--micro-batch-size", 2, "--global-batch-size", 4, "--train-iters", 3,
             "--lr", 1e-3, "--data-path", data, "--vocab-file", VOCAB, "--merge-file", MERGES, "--split", "98,2,0",
             "--eval-iters", 0, "--save", ckpt, "--tensor-model-parallel-size", 2, "--deepspeed",
             "ds_configs/zero1.json", "--no-progress-bar"]
    run("torchrun", 2, flags)
    convert("--model-type", "GPT", "--load-dir", ckpt, "--save-dir", hf_dir, "--target-tensor-parallel-size", 1,
            "--target-pipeline-parallel-size", 1, "--hf-convert", "--vocab-file", VOCAB, "--merge-file", MERGES)
    from transformers import AutoModelForCausalLM
    from hybrid.checkpoint.client_state import ClientState
    from hybrid.model.gpt import GPTModel
    state, meta = read_hybrid(str(ckpt))
    config = ClientState.from_meta(meta).model_config()
    config.hidden_dropout = config.attention_dropout = 0.0
    ours = GPTModel(config).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(state[name] if p.shape == state[name].shape else
                    torch.cat([state[name], p.new_zeros(p.size(0) - state[name].size(0), *p.shape[1:])]))
    ids = torch.randint(0, VOCAB_SIZE, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(ids)[..., :VOCAB_SIZE]
        got = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(ids).logits
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_finetune_with_frozen_layers_leaves_them_bit_identical(data, tmp_path):
    make_llama(tmp_path / "hf")
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    convert("--loader", "hf", "--load-dir", tmp_path / "hf", "--save-dir", base, "--target-tensor-parallel-size", 2)
    flags = ["--num-layers", 4, "--hidden-size", 32, "--num-attention-heads", 4, "--group-query-attention",
             "--num-query-groups", 2, "--ffn-hidden-size", 64, "--swiglu", "--disable-bias-linear",
             "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
             "--max-position-embeddings", 64, "--seq-length", 32, "--micro-batch-size", 2, "--global-batch-size", 4,
             "--train-iters", 2, "--lr", 1e-2, "--data-path", data, "--vocab-file", VOCAB, "--merge-file", MERGES,
             "--split", "98,2,0", "--eval-iters", 0, "--load", base, "--finetune", "--freeze-layers", "0-1",
             "--freeze-embeddings", "--save", tuned, "--tensor-model-parallel-size", 2, "--deepspeed",
             "ds_configs/zero2.json", "--no-progress-bar", "--make-vocab-size-divisible-by", 128]
    proc = run("torchrun", 2, flags)
    assert "for fine-tuning" in proc.stdout
    before, _ = read_hybrid(str(base))
    after, meta = read_hybrid(str(tuned))
    assert meta["iteration"] == 2
    for name in before:
        frozen = name.startswith(("layers.0.", "layers.1.", "embedding."))
        assert torch.equal(after[name], before[name]) == frozen, name


@pytest.mark.parametrize("case, message", [
    ("bert", "is not supported; supported: GPT2LMHeadModel, LlamaForCausalLM"),
    ("tp3", "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
    ("missing", "no such directory"),
    ("shape", "has shape"),
    ("truncated", "weight file model.safetensors is unreadable"),
    ("not_a_checkpoint", "pytorch_model.bin is unreadable"),
    ("hf_as_hybrid", "no 'latest' file; not a hybrid checkpoint directory"),  # --loader hybrid, the default
    ("missing_as_hybrid", "no 'latest' file; not a hybrid checkpoint directory"),
])
def test_bad_conversion_input_is_a_clear_error_with_no_output(tmp_path, case, message):
    src, out = tmp_path / "src", tmp_path / "out"
    tp, loader = 1, "hybrid" if case.endswith("_as_hybrid") else "hf"
    if case == "bert":
        src.mkdir()
        (src / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    elif case == "tp3":
        make_gpt2(src)
        tp = 3
    elif case == "missing":
        src = tmp_path / "nothing"
    elif case == "shape":
        make_gpt2(src)
        config = json.loads((src / "config.json").read_text())
        config["n_embd"] = 64
        (src / "config.json").write_text(json.dumps(config))
    elif case == "truncated":  # a download cut short
        make_gpt2(src)
        weights = src / "model.safetensors"
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) // 2)
    elif case == "not_a_checkpoint":  # an HTML error page saved under the weights' name
        make_gpt2(src)
        (src / "model.safetensors").unlink()
        (src / "pytorch_model.bin").write_text("<html><body>404 Not Found</body></html>")
    elif case == "hf_as_hybrid":
        make_gpt2(src)
    elif case == "missing_as_hybrid":
        src = tmp_path / "nothing"
    proc = convert("--loader", loader, "--load-dir", src, "--save-dir", out, "--target-tensor-parallel-size", tp,
                   check=False)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_tp_layout_is_read_from_the_layers_and_shards_each_parameter_as_the_model_does(family):
    """The one TP layout (hybrid.checkpoint.tp_layout, from the parameters' attributes) splits a
    full model's weights into exactly the shards a TP = 2 model builds on each rank."""
    from hybrid.checkpoint.tp_layout import tp_layout
    from hybrid.model.config import ModelConfig
    from tests.model_harness import CONFIGS
    config = ModelConfig(**CONFIGS[family])
    layout = tp_layout(config)
    assert layout["layers.0.attention.dense.weight"].dim == 1 and layout["layers.0.attention.qkv.weight"].dim == 0
    assert layout["embedding.word_embeddings.weight"].vocab_padded
    assert layout["layers.0.mlp.fc1.weight"].stride == (2 if config.swiglu else 1)
    assert layout["final_norm.weight"].dim is None
    from hybrid.model.gpt import GPTModel
    full = {n: p.detach() for n, p in GPTModel(ModelConfig(**CONFIGS[family])).named_parameters()}
    assert all(_tp2_shards_match_layout(CONFIGS[family], full, rank) for rank in range(2))


def _tp2_shards_match_layout(config_kwargs, full, tp_rank):
    """TP rank `tp_rank` of a TP-2 model, built in this process for its shapes (no ranks needed)."""
    import torch
    from hybrid.conversion.layout import shard_for_rank
    from hybrid.model.config import ModelConfig
    from hybrid.model.gpt import GPTModel
    from hybrid.parallel.groups import ParallelGroups
    config = ModelConfig(**config_kwargs)
    for name, param in GPTModel(config, ParallelGroups.shapes_only(2, tp_rank)).named_parameters():
        value = full[name]
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            value = value[: config.vocab_size]
        torch.testing.assert_close(shard_for_rank(name, value, config, 2, tp_rank), param.detach(),
                                   rtol=0, atol=0, msg=name)
    return True


@pytest.mark.slow
def test_resharded_checkpoint_continues_the_lr_schedule_and_finetune_restarts_it(data, tmp_path):
    """Weights-only loads: a pretraining run resumed from a converted checkpoint continues its LR
    schedule at the loaded iteration; --finetune starts it at 0 (as Megatron-LM)."""
    ckpt, resharded = tmp_path / "ckpt", tmp_path / "tp1"
    flags = ["--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 16,
             "--micro-batch-size", 2, "--global-batch-size", 4, "--train-iters", 6, "--lr", 1e-3, "--min-lr", 1e-4,
             "--lr-decay-style", "cosine", "--lr-warmup-iters", 2, "--data-path", data, "--vocab-file", VOCAB,
             "--merge-file", MERGES, "--split", "98,2,0", "--eval-iters", 0, "--log-interval", 1, "--no-progress-bar"]
    straight = tmp_path / "straight.jsonl"
    run("python", 1, flags + ["--log-json", straight])
    run("torchrun", 2, flags + ["--tensor-model-parallel-size", 2, "--save", ckpt, "--exit-interval", 3])
    convert("--load-dir", ckpt, "--save-dir", resharded, "--target-tensor-parallel-size", 1)
    resumed, tuned = tmp_path / "resumed.jsonl", tmp_path / "tuned.jsonl"
    run("python", 1, flags + ["--load", resharded, "--log-json", resumed])
    want = [r["lr"] for r in read_log(straight)]
    got = read_log(resumed)
    assert [r["iteration"] for r in got] == [4, 5, 6]
    assert [r["lr"] for r in got] == want[3:]
    run("python", 1, flags + ["--load", resharded, "--finetune", "--train-iters", 3, "--log-json", tuned])
    assert [r["lr"] for r in read_log(tuned)] == want[:3]


def test_converted_outputs_appear_complete_or_not_at_all(tmp_path):
    """hybrid.checkpoint.files.atomic_directory, used by the HF, resharding and universal writers."""
    from hybrid.checkpoint.files import atomic_directory
    from hybrid.errors import ConfigError
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_directory(str(target)) as tmp:
            (Path(tmp) / "half.safetensors").write_text("x")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []  # neither the target nor the temporary directory
    with atomic_directory(str(target)) as tmp:
        (Path(tmp) / "model.safetensors").write_text("1")
    assert (target / "model.safetensors").read_text() == "1"
    with pytest.raises(ConfigError, match="--save-dir .* exists and is not empty"):
        with atomic_directory(str(target)):
            pass
    with atomic_directory(str(target), replace=True) as tmp:
        (Path(tmp) / "model.safetensors").write_text("2")
    assert [p.name for p in target.iterdir()] == ["model.safetensors"]
    assert (target / "model.safetensors").read_text() == "2"


def test_one_function_tells_every_checkpoint_kind_apart_and_each_source_reads_alike(tmp_path):
    """hybrid.conversion.source: checkpoint_kind names HF, hybrid, Megatron-LM and Megatron-DeepSpeed directories
    (and nothing else), and every source's parts, read a part at a time, are exactly its whole state."""
    from hybrid.conversion.source import (HF, HYBRID, MEGATRON_DEEPSPEED, MEGATRON_LM, checkpoint_kind,
                                          open_source)
    from hybrid.errors import ConfigError
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hf = tmp_path / "hf"
    make_llama(str(hf))
    hybrid = os.path.join(root, "tests", "data", "pipeline_engine", "ckpt")  # layer files, with Megatron's pointer
    mds = os.path.join(root, "tests", "data", "megatron_deepspeed", "gpt2_tp2")
    megatron = tmp_path / "megatron"
    (megatron / "iter_0000003").mkdir(parents=True)
    (megatron / "iter_0000003" / ".metadata").write_text("")
    (megatron / "latest_checkpointed_iteration.txt").write_text("3")
    (tmp_path / "empty").mkdir()
    assert [checkpoint_kind(str(p)) for p in (hf, hybrid, mds, megatron, tmp_path / "empty", tmp_path / "none")] == \
        [HF, HYBRID, MEGATRON_DEEPSPEED, MEGATRON_LM, None, None]
    for path, layout in ((hf, (1, 1)), (hybrid, (1, 2)), (mds, (2, 1))):
        source = open_source(str(path))
        config = source.config()
        whole = source.state(config)
        parts = {}
        for part in source.parts(config, set(whole)):
            assert not set(part) & set(parts), path  # each tensor in one part
            parts.update(part)
        assert set(parts) == set(whole) and source.layout == layout, path
        assert all(torch.equal(parts[name].float(), whole[name].float()) for name in whole), path
    with pytest.raises(ConfigError, match="no checkpoint there"):
        open_source(str(tmp_path / "empty"))
