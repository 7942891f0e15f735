"""--sft: conversations in the formats people bring, the model's own chat template and its assistant mask,
packing with no attention across conversations; the loss equals transformers' over the assistant tokens, and
every layout equals one rank."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch

from hybrid.data.chat.cache import load_tokenized, tokenize_file
from hybrid.data.chat.dataset import evaluation_windows
from hybrid.data.chat.options import ChatOptions, Counts
from hybrid.data.chat.packing import pack
from hybrid.data.chat.template import ChatEncoder
from hybrid.errors import ConfigError
from tests.chat_helpers import (CHATML_PLAIN, as_row, conversations, make_chat_model, make_chat_tokenizer,
                                write_jsonl)

SEQ = 128


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A tiny Qwen2 with the ChatML tokenizer and a file of 40 conversations (some longer than a window)."""
    d = tmp_path_factory.mktemp("chat")
    model, tok = make_chat_model(d / "hf", max_position_embeddings=256)
    convs = conversations(40, seed=3, long_every=7)
    return {"dir": d, "hf": str(d / "hf"), "model": model, "tok": tok, "convs": convs,
            "data": write_jsonl(d / "chat.jsonl", [as_row(c, "messages") for c in convs])}


def transformers_loss(model, tok, convs, width: int = SEQ + 1) -> tuple[float, int]:
    """The token mean of transformers' cross-entropy over the tokens apply_chat_template(
    return_assistant_tokens_mask=True) marks, each conversation alone (cut to `width` tokens)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for c in convs:
            out = tok.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            ids = torch.tensor([out["input_ids"][:width]])
            mask = torch.tensor(out["assistant_masks"][:width], dtype=torch.bool)
            logits = model(ids).logits[0, :-1].double()
            ce = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
            total += ce[mask[1:]].sum().item()
            count += int(mask[1:].sum())
    return total / count, count


def test_every_row_format_gives_the_same_tokens_and_mask(tmp_path):
    """messages, ShareGPT, Alpaca (single exchanges), prompt/completion, JSONL, Parquet and a datasets directory."""
    import datasets
    tok = make_chat_tokenizer()
    encoder = ChatEncoder(tok, "test")
    convs = [c[:3] if c[0]["role"] == "system" else c[:2] for c in conversations(12, seed=1)]  # one exchange
    want = tokenize_file(write_jsonl(tmp_path / "m.jsonl", [as_row(c, "messages") for c in convs]), encoder)
    rows = {fmt: [as_row(c, fmt) for c in convs] for fmt in ("sharegpt", "alpaca")}
    rows["completion"] = [{"prompt": c[:-1], "completion": c[-1]["content"]} for c in convs]
    paths = [write_jsonl(tmp_path / f"{fmt}.jsonl", r) for fmt, r in rows.items()]
    datasets.Dataset.from_list([as_row(c, "sharegpt") for c in convs]).to_parquet(str(tmp_path / "s.parquet"))
    datasets.Dataset.from_list([as_row(c, "messages") for c in convs]).save_to_disk(str(tmp_path / "saved"))
    paths += [str(tmp_path / "s.parquet"), str(tmp_path / "saved")]
    for path in paths:
        got = tokenize_file(path, encoder)
        assert np.array_equal(got.ids, want.ids) and np.array_equal(got.mask, want.mask), path
        assert np.array_equal(got.offsets, want.offsets), path
    # pre-tokenized rows: transformers' labels (-100 where no loss) give the same mask
    pre = [{"input_ids": want.conversation(k)[0].tolist(),
            "labels": [int(t) if m else -100 for t, m in zip(*want.conversation(k))]} for k in range(len(want))]
    got = tokenize_file(write_jsonl(tmp_path / "pre.jsonl", pre), encoder)
    assert np.array_equal(got.ids, want.ids) and np.array_equal(got.mask, want.mask)


def test_the_mask_covers_what_the_assistant_writes_with_or_without_generation_markers():
    """With {% generation %} markers: transformers' assistant mask; without (Qwen2's shipped template): the same
    spans found by rendering turn by turn; --sft-train-on-prompt: every token."""
    tagged = ChatEncoder(make_chat_tokenizer(), "tagged")
    plain = ChatEncoder(make_chat_tokenizer(template=CHATML_PLAIN), "plain")
    assert tagged.generation_tags and not plain.generation_tags
    for c in conversations(30, seed=2):
        ids, mask = tagged.encode(c, "x")
        assert plain.encode(c, "x") == (ids, mask)
        answers = "".join(m["content"] + "<|im_end|>" for m in c if m["role"] == "assistant")
        assert tagged.tok.decode([t for t, m in zip(ids, mask) if m]) == answers
    everything = ChatEncoder(make_chat_tokenizer(), "all", ChatOptions(train_on_prompt=True))
    ids, mask = everything.encode(conversations(1)[0], "x")
    assert all(mask) and ids == tagged.encode(conversations(1)[0], "x")[0]
    assert tagged.separator == tagged.tok.pad_token_id  # <|endoftext|>: ChatML never writes it


def test_packing_keeps_each_conversation_whole_and_apart():
    tok = make_chat_tokenizer()
    encoder = ChatEncoder(tok, "t")
    from hybrid.data.chat.template import Tokenized
    convs = conversations(25, seed=4, long_every=6)
    encoded = [encoder.encode(c, "x") for c in convs]
    offsets = np.cumsum([0] + [len(i) for i, _ in encoded])
    data = Tokenized(np.concatenate([i for i, _ in encoded]).astype(np.int32),
                     np.concatenate([m for _, m in encoded]).astype(bool), offsets, Counts())
    for truncation in ("truncate", "drop"):
        counts = Counts()
        tokens, mask = pack(data, range(len(convs)), SEQ + 1, encoder.separator, ChatOptions(truncation=truncation),
                            counts)
        pieces = [p for row in tokens for p in np.split(row, np.flatnonzero(row == encoder.separator)) if len(p)]
        pieces = [p[1:] if p[0] == encoder.separator else p for p in pieces]
        kept = [(i[:SEQ + 1], m) for i, m in encoded if truncation == "truncate" or len(i) <= SEQ + 1]
        assert [p.tolist() for p in pieces if len(p)] == [i for i, _ in kept]
        long = sum(len(i) > SEQ + 1 for i, _ in encoded)
        assert long and (counts.truncated, counts.dropped) == ((long, 0) if truncation == "truncate" else (0, long))
        assert not mask[tokens == encoder.separator].any()


@pytest.mark.parametrize("row,message", [
    ('{"messages": [{"role": "user", "content": "hi"}', "bad.jsonl line 2: not valid JSON"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "bad.jsonl line 2: turn 0 has the unknown role 'wizard'"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "bad.jsonl line 2: the conversation has no assistant turn"),
    ({"text": "hi"}, "bad.jsonl line 2: no conversation in the row"),
    ({"input_ids": [1, 2], "labels": [5, -100]}, "'labels' must hold each input id or -100"),
    ({"messages": [{"role": "user", "content": "a<|endoftext|>"}, {"role": "assistant", "content": "b"}]},
     "holds token 0 ('<|endoftext|>'), which separates packed conversations"),
])
def test_a_bad_row_is_one_message_naming_file_and_line_or_counted_with_skip_bad(tmp_path, row, message):
    good = as_row(conversations(1)[0], "messages")
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n" + (row if isinstance(row, str) else json.dumps(row)) + "\n")
    tok = make_chat_tokenizer()
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tokenize_file(str(path), ChatEncoder(tok, "t"))
    data = tokenize_file(str(path), ChatEncoder(tok, "t", ChatOptions(skip_bad=True)))
    assert (data.counts.conversations, data.counts.skipped_bad) == (1, 1)


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path):
    tok = make_chat_tokenizer()
    tok.chat_template = None
    with pytest.raises(ConfigError, match="--tokenizer-model X: the tokenizer has no chat template"):
        ChatEncoder(tok, "--tokenizer-model X")


def test_packed_conversations_give_transformers_loss_over_the_assistant_tokens(chat):
    """One rank, in process: the packed windows through the model built from the HF weights (no attention
    across conversations, positions from 0 in each) = transformers on each conversation alone."""
    from hybrid.conversion.hf import hf_parts, read_hf_config
    from hybrid.conversion.layout import load_parts
    from hybrid.data.batches import Collator
    from hybrid.model.build import build_model
    from hybrid.model.naming import canonical_parameters
    from hybrid.parallel.groups import ParallelGroups
    import dataclasses
    encoder = ChatEncoder(chat["tok"], "t")
    tokens, mask, counts = evaluation_windows(chat["data"], SEQ, encoder)
    config = dataclasses.replace(read_hf_config(chat["hf"], "--load-hf"), reset_attention_mask=True,
                                 reset_position_ids=True, eod_token=encoder.separator)
    groups = ParallelGroups.single()
    model = build_model(config, groups).eval()
    load_parts(model, hf_parts(chat["hf"], config, set(canonical_parameters(model, config.num_layers))), config, groups)
    ids, labels = Collator()([{"text": torch.from_numpy(t.astype(np.int64)), "loss_mask": torch.from_numpy(m)}
                              for t, m in zip(tokens, mask)])
    with torch.no_grad():
        total = model(ids, labels, token_scale=torch.ones(())).item()
    want, count = transformers_loss(chat["model"], chat["tok"], chat["convs"])
    assert count == int((labels != -100).sum()) and counts.truncated > 0
    assert abs(total / count - want) <= 1e-5 * want


@pytest.mark.slow
def test_evaluate_sft_at_tp2_equals_transformers_over_the_assistant_tokens(chat, tmp_path):
    from checks.launch_helpers import read_log, run
    log = tmp_path / "eval.jsonl"
    run("torchrun", 2, ["--load-hf", chat["hf"], "--sft", "--data-path", chat["data"], "--seq-length", SEQ,
                        "--micro-batch-size", 2, "--tensor-model-parallel-size", 2, "--sequence-parallel",
                        "--log-json", log], script="launch/evaluate.py")
    [result] = read_log(log)
    want, count = transformers_loss(chat["model"], chat["tok"], chat["convs"])
    assert result["loss_tokens"] == count and result["conversations"] == 40
    assert abs(result["lm_loss"] - want) <= 1e-5 * want


RUN = ["--sft", "--seq-length", SEQ, "--micro-batch-size", 2, "--global-batch-size", 8, "--train-iters", 8,
       "--lr", 1e-3, "--min-lr", 1e-4, "--lr-warmup-iters", 1, "--eval-iters", 0, "--log-interval", 1,
       "--no-progress-bar", "--split", "100,0,0"]
TRAIN = RUN + ["--hidden-dropout", 0, "--attention-dropout", 0]
LAYOUTS = {  # name: (ranks, flags)
    "tp2_sp": (2, ["--tensor-model-parallel-size", 2, "--sequence-parallel"]),
    "cp2": (2, ["--context-parallel-size", 2]),
    "pp2": (2, ["--pipeline-model-parallel-size", 2]),
    "dp2_zero3": (2, ["--deepspeed", "ds_configs/zero3.json"]),
    "ulysses2_zero2_recompute": (2, ["--ds-sequence-parallel-size", 2, "--deepspeed", "ds_configs/zero2.json",
                                     "--recompute-granularity", "full", "--recompute-method", "uniform"]),
    "pp2_zbv": (2, ["--pipeline-model-parallel-size", 2, "--pipeline-schedule", "zbv", "--deepspeed",
                    "ds_configs/zero1.json"]),
    # an MoE model from scratch with the chat tokenizer: experts split over the two DP ranks
    "ep2_moe": (2, ["--expert-model-parallel-size", 2, "--deepspeed", "ds_configs/zero1.json"]),
}


def _sft_base(chat, name: str) -> list:
    if not name.startswith("ep"):
        return TRAIN + ["--load-hf", chat["hf"], "--data-path", chat["data"]]
    from tests.test_moe import MOE_FLAGS
    return TRAIN + MOE_FLAGS + ["--tokenizer-type", "HFTokenizer", "--tokenizer-model", chat["hf"], "--data-path",
                                chat["data"], "--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4,
                                "--max-position-embeddings", SEQ]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sft_training_at_every_layout_gives_the_one_rank_losses(chat, tmp_path, name):
    from checks.launch_helpers import one_rank, read_log, run
    from tests.test_training import assert_same_losses
    base = _sft_base(chat, name)
    ranks, extra = LAYOUTS[name]
    want = [r["lm_loss"] for r in one_rank(base)]
    log = tmp_path / "log.jsonl"
    run("torchrun", ranks, base + extra + ["--log-json", log])
    assert_same_losses([r["lm_loss"] for r in read_log(log)], want)


@pytest.mark.slow
def test_sft_resume_mid_epoch_with_dropout_is_bitwise(chat, tmp_path):
    """30 windows, 8 a batch: the resumed run starts inside the first epoch and crosses into the second."""
    from checks.launch_helpers import read_log, run
    base = RUN + ["--hidden-dropout", 0.1, "--attention-dropout", 0.1, "--load-hf", chat["hf"], "--data-path",
                  chat["data"], "--train-iters", 6]
    straight, resumed, ckpt = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl", tmp_path / "ckpt"
    run("python", 1, base + ["--log-json", straight, "--save", ckpt, "--save-interval", 2])
    (ckpt / "latest").write_text("iter_0000002")
    run("python", 1, base + ["--log-json", resumed, "--save", ckpt, "--load", ckpt])
    a, b = read_log(straight), read_log(resumed)
    assert [r["iteration"] for r in b] == [3, 4, 5, 6]
    assert [r["lm_loss"] for r in b] == [r["lm_loss"] for r in a[2:]]


def test_weighted_paths_blend_and_split_gives_validation_windows(tmp_path):
    """`--data-path 0.75 A 0.25 B` blends the two files' windows by weight (megatron-core's blending), and
    --split gives each its validation conversations."""
    from hybrid.config import DataConfig, TrainingConfig
    from hybrid.data.batches import build_datasets
    from hybrid.data.chat.options import ChatOptions
    from hybrid.data.tokenizer import HFTokenizer
    make_chat_tokenizer(tmp_path / "tok")
    a = write_jsonl(tmp_path / "a.jsonl", [as_row(c, "messages") for c in conversations(60, seed=5)])
    b = write_jsonl(tmp_path / "b.jsonl", [as_row(c, "sharegpt") for c in conversations(60, seed=6)])
    data = DataConfig(data_path=["0.75", a, "0.25", b], split="80,20,0", chat=ChatOptions())
    training = TrainingConfig(micro_batch_size=2, global_batch_size=8, grad_acc_steps=4, train_iters=10,
                              seq_length=64, precision="fp32", seed=1, eval_interval=5, eval_iters=1)
    train, valid, test = build_datasets(data, training, 0, HFTokenizer(str(tmp_path / "tok")))
    assert len(train) >= 80 and len(valid) >= 24 and test is None
    firsts = {k: {bytes(train.datasets[k].tokens[w]) for w in range(train.datasets[k].windows)} for k in (0, 1)}
    drawn = [0 if bytes(train[i]["text"].numpy().astype(np.int32)) in firsts[0] else 1 for i in range(80)]
    assert drawn.count(0) == 60 and drawn.count(1) == 20
    valid_windows = {bytes(d.tokens[w]) for d in valid.datasets for w in range(d.windows)}
    assert valid_windows and valid_windows.isdisjoint(firsts[0] | firsts[1])  # other conversations


@pytest.mark.slow
def test_readme_fine_tuning_blocks_run_as_written(tmp_path, deepspeed_on_a_free_port):
    import os
    import subprocess
    from checks.docs import page_with
    from checks.launch_helpers import BIN, ROOT, env
    readme = page_with("sft-tutorial")
    blocks = [part.split("```bash", 1)[1].split("```", 1)[0] for part in readme.split("<!-- sft-tutorial -->")[1:]]
    assert len(blocks) == 2, "the README's fine-tuning section has two blocks: the embedded tutorial, your model"
    for name in ("launch", "conversion", "ds_configs", "hybrid"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "tutorial").mkdir()
    environment = dict(env(), PATH=os.pathsep.join([deepspeed_on_a_free_port, os.path.abspath(BIN),
                                                    os.environ.get("PATH", "")]),
                       HYBRID_CACHE=str(tmp_path / "cache"))
    outputs = []
    for block in blocks:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=environment,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{block}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        outputs.append(proc.stdout + proc.stderr)
    assert "user: What is the `json` module for?" in outputs[0] and "assistant:" in outputs[0]
    assert (tmp_path / "tutorial" / "sft" / "hf" / "chat_template.jinja").exists()
    assert "TP=2" in outputs[1] and "loaded the qwen2 weights of tutorial/qwen-chat (--load-hf)" in outputs[1]
    [result] = [json.loads(line) for line in outputs[1].splitlines() if line.startswith('{"lm_loss"')]
    assert result["conversations"] == 790 and result["loss_tokens"] > 10_000
    assert re.search(r"answer: ['\"]", outputs[1])  # repr() of the generated text
    assert "rewards margin: " in outputs[1]
    assert (tmp_path / "tutorial" / "qwen-dpo" / "hf" / "chat_template.jinja").exists()


@pytest.mark.slow
def test_train_epochs_is_whole_batches_covering_every_window_that_many_times(chat, tmp_path):
    from hybrid.data.chat.dataset import train_windows
    from hybrid.config import DataConfig
    from checks.launch_helpers import read_log, run
    windows = train_windows(DataConfig(data_path=[chat["data"]], split="100,0,0", chat=ChatOptions()), SEQ, 1234,
                            ChatEncoder(chat["tok"], "t"))
    log = tmp_path / "log.jsonl"
    at = TRAIN.index("--train-iters")
    flags = TRAIN[:at] + TRAIN[at + 2:]
    proc = run("python", 1, flags + ["--load-hf", chat["hf"], "--data-path", chat["data"], "--train-epochs", 2,
                                     "--log-json", log])
    records = read_log(log)
    assert len(records) == -(-2 * windows // 8) and records[-1]["consumed_samples"] >= 2 * windows
    assert f"--train-epochs 2: {windows} training windows an epoch" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_preprocess_sft_files_serve_the_windows_the_jsonl_gives(chat, tmp_path):
    """launch/preprocess_data.py --sft (2 workers, chunks of 7 rows, a bad row counted) writes Megatron .bin/.idx
    files that the training split, the packed windows and evaluate.py's windows read exactly as from the file;
    with --dpo the pairs too."""
    import subprocess
    import sys
    from hybrid.config import DataConfig, TrainingConfig
    from hybrid.data.batches import build_datasets
    from hybrid.data.tokenizer import HFTokenizer
    from tests.chat_helpers import preference_rows
    from checks.launch_helpers import ROOT, env
    rows = [as_row(c, "sharegpt") for c in chat["convs"]]
    data = write_jsonl(tmp_path / "chat.jsonl", rows[:20] + [{"conversations": [{"from": "alien", "value": "x"}]}]
                       + rows[20:])
    pairs = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(9, seed=2))
    for source, extra in ((data, []), (pairs, ["--dpo"])):
        prefix = str(tmp_path / ("pairs" if extra else "chat"))
        proc = subprocess.run([sys.executable, "launch/preprocess_data.py", "--sft", "--input", source,
                               "--tokenizer-model",
                               chat["hf"], "--output-prefix", prefix, "--workers", "2", "--chunk-size", "7",
                               "--skip-bad-lines"] + extra, cwd=ROOT, env=env(), capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"--data-path {prefix}_text_document" in proc.stdout + proc.stderr
        options = ChatOptions(skip_bad=True, pairs=bool(extra))
        encoder = ChatEncoder(chat["tok"], "t", options)
        want, got = tokenize_file(source, encoder), load_tokenized(prefix + "_text_document", encoder)
        assert len(got) == len(want) == (9 if extra else 40) and got.counts.skipped_bad == (0 if extra else 1)
        assert all(np.array_equal(a, b) for a, b in ((got.ids, want.ids), (got.mask, want.mask),
                                                      (got.offsets, want.offsets)))
    training = TrainingConfig(micro_batch_size=2, global_batch_size=8, grad_acc_steps=4, train_iters=4,
                              seq_length=SEQ, precision="fp32", seed=1, eval_interval=2, eval_iters=1)
    built = [build_datasets(DataConfig(data_path=[path], split="80,20,0", chat=ChatOptions(skip_bad=True)), training,
                            0, HFTokenizer(chat["hf"])) for path in (data, str(tmp_path / "chat_text_document"))]
    for a, b in zip(built[0][:2], built[1][:2]):
        assert all(np.array_equal(a[i]["text"], b[i]["text"]) and np.array_equal(a[i]["loss_mask"], b[i]["loss_mask"])
                   for i in range(len(a)))
    encoder = ChatEncoder(chat["tok"], "t", ChatOptions(skip_bad=True))
    for x, y in zip(evaluation_windows(data, SEQ, encoder), evaluation_windows(str(tmp_path / "chat_text_document"),
                                                                                  SEQ, encoder)):
        assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x.conversations == y.conversations


def test_preprocessed_files_made_another_way_are_one_message(chat, tmp_path):
    from hybrid.data.preprocess import main
    prefix = str(tmp_path / "chat")
    assert main(["--sft", "--input", chat["data"], "--tokenizer-model", chat["hf"], "--output-prefix", prefix]) == 0
    with pytest.raises(ConfigError, match="made by launch/preprocess_data.py --sft with another tokenizer, chat "
                                          "template or --sft-train-on-prompt"):
        load_tokenized(prefix + "_text_document", ChatEncoder(chat["tok"], "t", ChatOptions(train_on_prompt=True)))
    with pytest.raises(ConfigError, match=r"holds conversations; this run \(--dpo\) trains on preference pairs"):
        load_tokenized(prefix + "_text_document", ChatEncoder(chat["tok"], "t", ChatOptions(pairs=True)))
    from hybrid.data.chat.stream import split_datasets
    with pytest.raises(ConfigError, match="preprocessed files are read memory-mapped already; drop --sft-streaming"):
        split_datasets(prefix + "_text_document", lambda n: [(0, n), (0, 0), (0, 0)], [8, 0, 0], SEQ, 1,
                       ChatEncoder(chat["tok"], "t", ChatOptions(stream_buffer=8)))
    make_chat_tokenizer(tmp_path / "plain", template=None)
    assert main(["--sft", "--input", chat["data"], "--tokenizer-model", str(tmp_path / "plain"),
                 "--output-prefix", str(tmp_path / "x")]) == 2
    assert not list(tmp_path.glob("x_*"))  # nothing half-written


@pytest.mark.parametrize("flags,message", [
    (["--vocab-file", "{V}", "--merge-file", "{M}"],
     "--tokenizer-type GPT2BPETokenizer: the tokenizer has no chat template"),
    (["--mock-data"], "--sft trains on conversations"),
    (["--train-epochs", 0], "--train-epochs 0: a positive number of epochs"),
    (["--train-epochs", 2, "--sft-streaming"], "--train-epochs with --sft-streaming: an epoch's windows are known"),
    (["--sft-streaming", "--sft-shuffle-buffer", 0], "--sft-shuffle-buffer 0: at least 1"),
])
def test_sft_flag_mistakes_are_one_message(chat, flags, message):
    from hybrid.training.run import run_training
    from checks.launch_helpers import MERGES, VOCAB
    flags = [str(f).replace("{V}", VOCAB).replace("{M}", MERGES) for f in flags]
    base = ["--sft"] + ([] if "--mock-data" in flags else ["--data-path", chat["data"]])
    if "--vocab-file" not in flags:
        base += ["--load-hf", chat["hf"]]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        run_training(base + flags)


# ------------------------------------------------------------------------------------------------------ DPO

def trl_config(tmp, **options):
    """TRL's DPOConfig for a CPU test (no logging, fp32, no processes)."""
    from trl import DPOConfig
    return DPOConfig(output_dir=str(tmp), report_to=[], use_cpu=True, bf16=False, fp16=False, dataset_num_proc=None,
                     gradient_checkpointing=False, **options)


def trl_pairs(tok, rows, tmp, max_length=None, truncation_mode="keep_start"):
    """TRL 1.16's own DPO data path: DPOTrainer._prepare_dataset (EOS on plain text, the tokenization, the filter of
    pairs whose prompt fills max_length) and its DataCollatorForPreference (the cut) -> per kept pair
    [(ids, completion mask) of prompt + chosen, (ids, completion mask) of prompt + rejected]."""
    import types

    import datasets
    from trl import DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    args = trl_config(tmp, max_length=max_length, truncation_mode=truncation_mode)
    data = DPOTrainer._prepare_dataset(types.SimpleNamespace(_tokenizer=tok), datasets.Dataset.from_list(rows), tok,
                                       args, "train")
    collate = DataCollatorForPreference(pad_token_id=-1, max_length=max_length, truncation_mode=truncation_mode)
    out = []
    for example in data:
        batch = collate([example])
        keep = batch["attention_mask"].bool()
        out.append([(batch["input_ids"][k][keep[k]].tolist(), batch["completion_mask"][k][keep[k]].bool().tolist())
                    for k in range(2)])
    return out


def packed_pairs(tokens, mask, separator: int) -> list:
    """Windows of packed pairs -> per pair [(ids, loss mask) chosen, (ids, loss mask) rejected], in packing order."""
    documents = []
    for row, loss in zip(tokens, mask):
        k = 0
        while k < len(row):
            if row[k] == separator:
                k += 1
                continue
            end = k
            while end < len(row) and row[end] != separator:
                end += 1
            documents.append((row[k:end].tolist(), loss[k:end].tolist()))
            k = end
    assert len(documents) % 2 == 0
    return [documents[k:k + 2] for k in range(0, len(documents), 2)]


def trl_dpo(policy, reference, tok, rows, tmp, beta, loss_type="sigmoid", smoothing=0.0):
    """TRL's own DPOTrainer (trl 1.16) on copies of the two models: its tokenization, collator and loss, one batch
    of every pair -> (the loss, with its graph; the policy copy whose gradients it gives). TRL 1.x's sigmoid loss
    has no label smoothing; conservative DPO (TRL 0.x's sigmoid with label_smoothing eps) is, per pair,
    (1 - eps) times the sigmoid loss plus eps times the sigmoid loss of the pair with its answers swapped: both
    computed by TRL."""
    import copy

    import datasets
    from trl import DPOTrainer

    def trainer(pairs, model):
        return DPOTrainer(model=model, ref_model=copy.deepcopy(reference),
                          args=trl_config(tmp, beta=beta, loss_type=[loss_type], per_device_train_batch_size=len(rows)),
                          train_dataset=datasets.Dataset.from_list(pairs), processing_class=tok)

    def loss(run, model):
        batch = run.data_collator(list(run.train_dataset))
        return run.compute_loss(model, batch)

    first = trainer(rows, copy.deepcopy(policy))
    total = loss(first, first.model)
    if smoothing:
        swapped = trainer([dict(r, chosen=r["rejected"], rejected=r["chosen"]) for r in rows], copy.deepcopy(policy))
        total = (1 - smoothing) * total + smoothing * loss(swapped, first.model)
    return total, first.model


@pytest.fixture(scope="module")
def pairs(chat):
    from tests.chat_helpers import preference_rows
    d = chat["dir"]
    reference, _ = make_chat_model(d / "ref", seed=1, max_position_embeddings=256)
    rows = preference_rows(24, seed=7)
    return {"rows": rows, "data": write_jsonl(d / "pairs.jsonl", rows), "reference": reference, "ref": str(d / "ref")}


def _ours(path, separator, options):
    import dataclasses
    from hybrid.conversion.hf import hf_parts, read_hf_config
    from hybrid.conversion.layout import load_parts
    from hybrid.model.build import build_model
    from hybrid.model.naming import canonical_parameters
    from hybrid.parallel.groups import ParallelGroups
    config = dataclasses.replace(read_hf_config(path, "--load-hf"), reset_attention_mask=True, reset_position_ids=True,
                                 eod_token=separator)
    groups = ParallelGroups.single()
    model = build_model(config, groups)
    load_parts(model, hf_parts(path, config, set(canonical_parameters(model, config.num_layers))), config, groups)
    return model


@pytest.mark.parametrize("loss_type,smoothing", [("sigmoid", 0.0), pytest.param("sigmoid", 0.1, marks=pytest.mark.slow),
                                                pytest.param("ipo", 0.0, marks=pytest.mark.slow)])
def test_dpo_loss_and_gradient_equal_trls(chat, pairs, loss_type, smoothing, tmp_path):
    """One rank: pairs packed side by side, the policy (the chat model) against a reference (another model, so
    the margins are not zero); loss and the gradients of the embedding, a layer's norm and the final norm equal
    TRL's own DPOTrainer's (its tokenization, collator and loss) on the same rows."""
    from hybrid.data.batches import Collator
    from hybrid.model.objectives import PreferencePairs
    from hybrid.model.preference import DPOOptions
    from hybrid.parallel.groups import ParallelGroups
    encoder = ChatEncoder(chat["tok"], "t", ChatOptions(pairs=True))
    tokens, mask, counts = evaluation_windows(pairs["data"], 2 * SEQ, encoder)
    assert counts.truncated == counts.dropped == 0  # every pair whole, as TRL sees it without max_length
    ids, labels = Collator()([{"text": torch.from_numpy(t.astype(np.int64)), "loss_mask": torch.from_numpy(m)}
                              for t, m in zip(tokens, mask)])
    options = DPOOptions(0.5, smoothing, loss_type, encoder.separator)
    policy, reference = _ours(chat["hf"], encoder.separator, options), _ours(pairs["ref"], encoder.separator, options)
    # the objective as the runtime runs it: the target (scored by the frozen reference), then the loss
    objective = PreferencePairs(ParallelGroups.single(), policy.config.vocab_size, options, reference)
    loss = objective.loss(policy(ids, stage=0), objective.target(ids, labels), None)
    loss.backward()
    want, hf = trl_dpo(chat["model"], pairs["reference"], chat["tok"], pairs["rows"], tmp_path, 0.5, loss_type,
                       smoothing)
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    vocab = hf.config.vocab_size
    # both fp32 (TRL's fused head takes log-probabilities in fp32): elementwise 1e-4, or 1e-5 of the largest entry
    for ours, theirs in [(policy.embedding.word_embeddings.weight.grad[:vocab], hf.model.embed_tokens.weight.grad),
                         (policy.final_norm.weight.grad, hf.model.norm.weight.grad),
                         (policy.layers[1].input_norm.weight.grad, hf.model.layers[1].input_layernorm.weight.grad)]:
        torch.testing.assert_close(ours, theirs.float(), rtol=1e-4, atol=1e-5 * theirs.abs().max().item())
    stats = objective.metrics()
    assert stats["rewards_accuracy"] in [k / 24 for k in range(25)] and len(stats) == 4


@pytest.mark.parametrize("family", ["qwen25", "llama3", "mistral", "gemma", "deepseek"])
def test_dpo_pairs_are_tokenized_cut_and_dropped_as_trl_does(family, tmp_path):
    """TRL 1.16's own _prepare_dataset and DataCollatorForPreference are the reference, for conversational and
    plain-text pairs (EOS added), both truncation modes, at a max_length that cuts most pairs and leaves some
    prompts longer than it (TRL drops those under keep_start): the same pairs kept, in order, each side's tokens and
    the tokens scored (everything after the prompt's shared prefix, the template's turn end included) equal; and
    --dpo-max-prompt-length keeps a prompt's last tokens (before: each side got half the window, a long prompt
    dropped its pair, and only the assistant's text was scored)."""
    from hybrid.data.chat.rows import preference_pair_of
    from tests.chat_helpers import preference_rows
    from tests.chat_templates import family_tokenizer
    tok = family_tokenizer(family)
    rows = {"messages": preference_rows(16, seed=5), "strings": preference_rows(16, seed=5, style="strings")}
    for k in (2, 9):  # two long prompts: kept whole below, dropped or cut at the max_length that cuts the others
        rows["messages"][k]["prompt"][-1]["content"] += " and" + " the python language" * 12
        rows["strings"][k]["prompt"] += " and" + " the python language" * 12
    whole = ChatEncoder(tok, family, ChatOptions(pairs=True))
    prompts = {style: [whole.encode_pair(*preference_pair_of(row, "x"), "x")[0][1].index(True) for row in rows[style]]
               for style in rows}
    # a side of the middle prompt's length and 2 more tokens: the longer prompts fill it, the shorter keep some
    # answer tokens, most of them cut (Mistral's prompt ends where its renderings part: before a last user turn
    # that takes the system prompt when it ends the conversation, so that turn is in the answer, as in TRL)
    limits = {style: sorted(lengths)[len(lengths) // 2] + 2 for style, lengths in prompts.items()}
    long = {style: sum(n >= limits[style] for n in lengths) for style, lengths in prompts.items()}
    assert all(2 <= n <= 12 for n in long.values()), long
    for style, mode, limit in [("messages", "keep_start", limits["messages"]),
                               ("messages", "keep_end", limits["messages"]),
                               ("strings", "keep_start", limits["strings"]), ("strings", "keep_end", limits["strings"]),
                               ("messages", "keep_start", 0)]:
        path = write_jsonl(tmp_path / f"{style}.jsonl", rows[style])
        encoder = ChatEncoder(tok, family, ChatOptions(pairs=True, dpo_max_length=limit, dpo_truncation_mode=mode))
        seq = 2 * limit if limit else 4 * SEQ
        tokens, mask, counts = evaluation_windows(path, seq, encoder)
        ours = packed_pairs(tokens, mask, encoder.separator)
        want = trl_pairs(tok, rows[style], tmp_path / "trl", limit or None, mode)
        assert len(ours) == len(want) == 16 - counts.dropped, (style, mode, counts)
        if limit:  # keep_start drops the pairs whose prompt fills a side, keep_end keeps every pair
            assert counts.dropped == (long[style] if mode == "keep_start" else 0) and counts.truncated >= 2, counts
        for n, (pair, theirs) in enumerate(zip(ours, want)):
            for (ids, loss), (trl_ids, completion) in zip(pair, theirs):
                assert ids == trl_ids, (style, mode, n, tok.decode(ids), tok.decode(trl_ids))
                assert loss == [False] + completion[1:], (style, mode, n)  # TRL scores completion_mask[1:]
        if not limit:  # the whole pairs: --dpo-max-prompt-length 12 keeps each prompt's last 12 tokens
            cut = ChatEncoder(tok, family, ChatOptions(pairs=True, dpo_max_prompt_length=12))
            short = packed_pairs(*evaluation_windows(path, seq, cut)[:2], cut.separator)
            for pair, theirs in zip(short, want):
                for (ids, _), (trl_ids, completion) in zip(pair, theirs):
                    prompt = completion.index(True)
                    assert ids == trl_ids[max(0, prompt - 12):]


def test_dpo_flag_mistakes_are_one_message(chat, pairs):
    from hybrid.training.run import run_training
    base = ["--dpo", "--data-path", pairs["data"], "--load-hf", chat["hf"]]
    for flags, message in [(["--pipeline-model-parallel-size", 2], "add --dpo-reference-logps FILE"),
                           (["--sft"], "--sft and --dpo are two trainings"),
                           (["--sft-streaming", "--dpo-reference-logps", "r.npz"], "drop --sft-streaming"),
                           (["--dpo-loss-type", "ipo", "--dpo-label-smoothing", 0.1],
                            "applies to --dpo-loss-type sigmoid"),
                           (["--dpo-max-length", 65, "--seq-length", 128], "each side holds at most 64"),
                           (["--sft-truncation", "drop"], "use --dpo-max-length")]:
        with pytest.raises(ConfigError, match=message):
            run_training([str(f) for f in base + flags + ["--dry-run-world-size", 2]])
    with pytest.raises(ConfigError, match="--dpo-truncation-mode set DPO: add --dpo"):
        run_training(["--sft", "--data-path", chat["data"], "--load-hf", chat["hf"], "--dpo-truncation-mode",
                      "keep_end"])
    with pytest.raises(ConfigError, match="--dpo needs --load-hf DIR"):
        run_training(["--dpo", "--data-path", pairs["data"], "--tokenizer-model", chat["hf"]])
    bad = write_jsonl(chat["dir"] / "bad_pairs.jsonl", [{"prompt": "hi", "chosen": "yes", "rejected": ""}])
    with pytest.raises(ConfigError, match="bad_pairs.jsonl line 1: the pair's 'rejected' is empty"):
        tokenize_file(bad, ChatEncoder(chat["tok"], "t", ChatOptions(pairs=True)))


DPO_RUN = ["--dpo", "--dpo-beta", 0.5, "--seq-length", 2 * SEQ, "--micro-batch-size", 2, "--global-batch-size", 8,
           "--train-iters", 8, "--lr", 1e-3, "--min-lr", 1e-4, "--lr-warmup-iters", 1, "--eval-iters", 0,
           "--log-interval", 1, "--no-progress-bar", "--split", "100,0,0", "--hidden-dropout", 0,
           "--attention-dropout", 0]
REFERENCE_FILE = "{reference_logps}"  # a layout's placeholder for a file of its own test
DPO_LAYOUTS = {"tp2_sp": LAYOUTS["tp2_sp"], "cp2": LAYOUTS["cp2"], "dp2_zero3": LAYOUTS["dp2_zero3"],
               # the pipeline scores the reference values itself (from the starting weights), then trains with them
               "pp2_1f1b": (2, LAYOUTS["pp2"][1] + ["--dpo-reference-logps", REFERENCE_FILE]),
               "pp2_zbv": (2, LAYOUTS["pp2_zbv"][1] + ["--dpo-reference-logps", REFERENCE_FILE])}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DPO_LAYOUTS))
def test_dpo_training_at_every_layout_gives_the_one_rank_losses_and_rewards(chat, pairs, tmp_path, name):
    from checks.launch_helpers import one_rank, read_log, run
    from tests.test_training import assert_same_losses
    base = DPO_RUN + ["--load-hf", chat["hf"], "--data-path", pairs["data"]]
    want = one_rank(base)
    ranks, extra = DPO_LAYOUTS[name]
    ckpt, restarts = tmp_path / "ckpt", name == "pp2_1f1b"  # a restart that scores the reference values again
    extra = [tmp_path / "reference.npz" if f == REFERENCE_FILE else f for f in extra]
    extra += ["--save", ckpt, "--save-interval", 4] if restarts else []
    log = tmp_path / "log.jsonl"
    run("torchrun", ranks, base + extra + ["--log-json", log])
    got = read_log(log)
    assert_same_losses([r["lm_loss"] for r in got], [r["lm_loss"] for r in want])
    assert abs(want[0]["lm_loss"] - 0.6931471805599453) < 1e-6  # the policy starts as the reference
    for key in ("rewards_margin", "rewards_chosen"):
        assert all(abs(a[key] - b[key]) <= 1e-4 * max(1e-3, abs(b[key])) for a, b in zip(got, want)), key
    assert [r["rewards_accuracy"] for r in got] == [r["rewards_accuracy"] for r in want]
    if restarts:
        # a restart at iteration 4 whose file is gone: the pipeline scores the --load-hf weights again, then loads
        # the checkpoint over them
        written = (tmp_path / "reference.npz").read_bytes()
        (tmp_path / "reference.npz").unlink()
        (ckpt / "latest").write_text("iter_0000004")
        resumed = tmp_path / "resumed.jsonl"
        run("torchrun", ranks, base + extra + ["--load", ckpt, "--log-json", resumed])
        again = read_log(resumed)
        assert [r["iteration"] for r in again] == [5, 6, 7, 8]
        assert [r["lm_loss"] for r in again] == [r["lm_loss"] for r in got[4:]]  # the straight run's, bitwise
        assert (tmp_path / "reference.npz").read_bytes() == written


@pytest.mark.slow
def test_dry_run_counts_the_dpo_reference_model_unless_its_values_are_precomputed(chat, pairs, tmp_path):
    from tests.test_memory import _train
    flags = ["--dry-run", "--dpo", "--load-hf", chat["hf"], "--data-path", pairs["data"], "--seq-length", SEQ,
             "--micro-batch-size", 2]
    rows, outputs = [], []
    for extra in ([], ["--dpo-reference-logps", tmp_path / "ref.npz"]):
        proc = _train(*map(str, flags + extra))
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1])["dry_run"]["stages"][0])
        outputs.append(proc.stdout)
    with_reference, precomputed = rows
    # the reference model's weights in fp32: those of the model --load-hf builds
    built = _ours(chat["hf"], 0, None)
    assert with_reference["reference"] == 4 * sum(p.numel() for p in built.parameters())
    assert precomputed["reference"] == 0
    assert with_reference["total"] - precomputed["total"] == with_reference["reference"]
    assert "--dpo reference model:" in outputs[0] and "--dpo reference model:" not in outputs[1]
    # a device between the two: the advisor's first proposal is to compute the reference values once
    gib = (with_reference["total"] + precomputed["total"]) / 2 / 0.9 / 2 ** 30
    proc = _train(*map(str, flags + ["--gpu-memory-gb", gib]))
    advice = json.loads(proc.stdout.strip().splitlines()[-1])["dry_run"]["advice"]
    assert not advice["fits"] and advice["change"] == "--dpo-reference-logps FILE", advice


def test_the_reference_cache_key_changes_with_one_row_of_the_last_layer(tmp_path):
    """The DPO reference file's key hashes every byte of the reference's weights: two models that differ in one
    number of their last layer have other keys, also where that number lies between the places a sampled key read
    (16 x 64 KiB spread over the file: it reused the cached values with exit 0), and a copy of the same files has
    the same key."""
    import shutil
    import struct

    from safetensors.torch import load_file, save_file

    from hybrid.conversion.hf import weights_hash
    from tests.hf_families import make_family
    make_family("llama3", tmp_path / "a", tokenizer=False, hidden_size=64, intermediate_size=256)
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    path = tmp_path / "b" / "model.safetensors"
    size, raw = os.path.getsize(path), path.read_bytes()
    header_size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + header_size])
    sampled = [(size * k // 16, size * k // 16 + (1 << 16)) for k in range(16)]
    layer = max(int(k.split(".")[2]) for k in header if k.startswith("model.layers."))

    def unsampled(name):  # the first of the tensor's numbers outside every sampled range
        begin, end = header[name]["data_offsets"]
        for at in range(8 + header_size + begin, 8 + header_size + end, 4):
            if not any(lo <= at + b < hi for lo, hi in sampled for b in range(4)):
                return (at - 8 - header_size - begin) // 4
    name, index = next((n, unsampled(n)) for n in sorted(header) if n.startswith(f"model.layers.{layer}.")
                       and unsampled(n) is not None)
    weights = load_file(path)
    weights[name].view(-1)[index] += 1e-3
    save_file(weights, path, metadata={"format": "pt"})
    a, hashed = weights_hash(str(tmp_path / "a"))
    assert hashed == size
    assert weights_hash(str(tmp_path / "copy"))[0] == a
    assert weights_hash(str(tmp_path / "b"))[0] != a


@pytest.mark.slow
def test_dpo_reference_logps_computed_once_at_dp2_then_read_gives_the_reference_models_losses(chat, pairs, tmp_path):
    """--dpo-reference-logps FILE: scored at DP 2 before training (each rank every other window), written, the
    model freed; read by a one-rank run that builds no reference model; both = the run that scores every batch."""
    from checks.launch_helpers import one_rank, read_log, run
    from tests.test_training import assert_same_losses
    base = DPO_RUN + ["--load-hf", chat["hf"], "--data-path", pairs["data"]]
    want = [r["lm_loss"] for r in one_rank(base)]
    logps = tmp_path / "ref_logps.npz"
    for ranks, log, said in ((2, tmp_path / "dp2.jsonl", "scored"), (1, tmp_path / "read.jsonl", "read; no reference")):
        proc = run("torchrun", ranks, base + ["--dpo-reference-logps", logps, "--log-json", log])
        assert_same_losses([r["lm_loss"] for r in read_log(log)], want)
        assert f"--dpo-reference-logps {logps}" in proc.stdout + proc.stderr and said in proc.stdout + proc.stderr
    # keyed by everything the values depend on: other windows, another reference model (a fine-tune of it:
    # every weight moved a little, same files and sizes) or another precision are refused, naming which
    from hybrid.conversion.hf import hf_fingerprint
    from hybrid.training.reference_logps import _read
    key = {"key": "the key of other windows", "model": hf_fingerprint(chat["hf"]), "precision": "fp32"}
    with pytest.raises(ConfigError, match="holds the reference log-probabilities of other windows"):
        _read(str(logps), key, 1)
    import shutil

    from safetensors.torch import load_file, save_file
    other = tmp_path / "fine_tuned"
    shutil.copytree(chat["hf"], other)
    torch.manual_seed(0)
    weights = {k: v + 1e-3 * torch.randn_like(v) for k, v in load_file(other / "model.safetensors").items()}
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    assert hf_fingerprint(str(other)) != hf_fingerprint(chat["hf"])
    for flags, what in ((["--load-hf", other], "another reference model"), (["--load-hf", chat["hf"], "--bf16"],
                                                                            "another precision")):
        proc = run("python", 1, DPO_RUN + ["--data-path", pairs["data"], "--dpo-reference-logps", logps, *flags],
                   check=False)
        assert proc.returncode == 2 and what in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


# ------------------------------------------------------------------------------------------- --sft-streaming

def _stream(path, encoder, rows, seed=1, buffer=64, cache=None, writer=True):
    from hybrid.data.chat import stream as chat_stream
    cache = cache or chat_stream.stream_cache(path, encoder, rows, None)
    return chat_stream.StreamingChatDataset(path, rows, encoder, SEQ + 1, seed, buffer, 10 ** 6, cache, writer)


def _documents(windows, separator):
    """The token sequences packed in windows (split at the separator)."""
    out = []
    for tokens in windows:
        cut = np.flatnonzero(tokens == separator)
        for lo, hi in zip(np.concatenate([[-1], cut]), np.concatenate([cut, [len(tokens)]])):
            if hi - lo > 1:
                out.append(tuple(tokens[lo + 1:hi].tolist()))
    return out


@pytest.mark.slow
def test_streamed_windows_hold_every_conversation_once_an_epoch_the_same_way_from_any_start(chat, tmp_path):
    """--sft-streaming: the background process's windows are a function of the file and the seed: an epoch
    holds every conversation once; a stream started at window k (a resumed run) sends what a stream from 0
    sends from k; a second reader takes the cached blocks and tokenizes nothing; a buffer of 1 is the file's
    order packed; and the worker stays a bounded number of windows ahead of the run."""
    from hybrid.data.chat import stream as chat_stream
    convs = conversations(2600, seed=5)
    path = write_jsonl(tmp_path / "many.jsonl", [as_row(c, "messages") for c in convs])
    encoder = ChatEncoder(chat["tok"], "t", ChatOptions())
    whole = tokenize_file(path, encoder)
    rows = (0, len(convs))
    first = _stream(path, encoder, rows)
    first[0]
    shards = lambda: len([f for f in os.listdir(first.arguments["cache"]) if f.startswith("shard_")])  # noqa: E731
    assert shards() <= 1  # 3 blocks of 1024 rows in the file: the worker waits for the run
    epochs = [[], []]
    index = 0
    while True:
        epoch, tokens, _ = first._window(index)
        if epoch == 2:
            break
        epochs[epoch].append(tokens)
        index += 1
    first.close()
    assert shards() == 3
    want = sorted(tuple(whole.conversation(k)[0].tolist()) for k in range(len(whole)))
    for windows in epochs:
        assert sorted(_documents(windows, encoder.separator)) == want
    assert _documents(epochs[0], encoder.separator) != _documents(epochs[1], encoder.separator)  # reshuffled
    counts = Counts()
    resumed = _stream(path, encoder, rows, writer=False)
    k = len(epochs[0]) - 3  # across the epoch boundary
    assert [resumed[i]["text"].numpy().astype(np.int32).tolist() for i in range(k, k + 6)] == \
        [t.tolist() for t in (epochs[0] + epochs[1])[k:k + 6]]
    resumed.close()
    cached = list(chat_stream._tokenized_rows(path, rows, encoder, first.arguments["cache"], False, counts))
    assert counts.conversations == 0 and len(cached) == len(whole)
    in_order = _stream(path, encoder, rows, buffer=1, cache=str(tmp_path / "other"), writer=False)
    tokens, _ = pack(whole, range(len(whole)), SEQ + 1, encoder.separator, ChatOptions(), Counts())
    assert all((in_order[i]["text"].numpy() == tokens[i]).all() for i in range(len(tokens)))
    in_order.close()


@pytest.mark.slow
def test_streamed_training_at_dp2_equals_one_rank_and_resumes_at_the_next_window(chat, tmp_path):
    """--sft-streaming in training: DP 2 (each rank's worker makes the same stream, each rank keeps its windows)
    gives the one-rank losses, and a run resumed at iteration 4 (its worker makes the stream again from the
    cache and sends from the next window) continues with the straight run's losses, bitwise."""
    from checks.launch_helpers import read_log, run
    from tests.test_training import assert_same_losses
    data = write_jsonl(tmp_path / "chat.jsonl", [as_row(c, "messages") for c in chat["convs"]])
    base = TRAIN + ["--load-hf", chat["hf"], "--data-path", data, "--sft-streaming", "--sft-shuffle-buffer", 16]
    straight, ckpt = tmp_path / "straight.jsonl", tmp_path / "ckpt"
    proc = run("python", 1, base + ["--log-json", straight, "--save", ckpt, "--save-interval", 4])
    assert "streamed (tokenized as the batches need them" in proc.stdout + proc.stderr
    want = [r["lm_loss"] for r in read_log(straight)]
    dp2 = tmp_path / "dp2.jsonl"
    run("torchrun", 2, base + ["--log-json", dp2, "--deepspeed", "ds_configs/zero1.json"])
    assert_same_losses([r["lm_loss"] for r in read_log(dp2)], want)
    (ckpt / "latest").write_text("iter_0000004")
    resumed = tmp_path / "resumed.jsonl"
    run("python", 1, base + ["--log-json", resumed, "--load", ckpt])
    assert [r["lm_loss"] for r in read_log(resumed)] == want[4:]


def test_a_bad_row_met_by_the_stream_is_one_message_naming_file_and_line_or_counted(chat, tmp_path):
    rows = [as_row(c, "messages") for c in conversations(30, seed=2)]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows[:20]) + "\n{not json\n" +
                    "\n".join(json.dumps(r) for r in rows[20:]) + "\n")
    strict = _stream(str(path), ChatEncoder(chat["tok"], "t", ChatOptions()), (0, 31), buffer=4)
    with pytest.raises(ConfigError, match=r"bad.jsonl line 21: not valid JSON .*\(--sft-skip-bad counts"):
        for index in range(31):  # when the stream reaches the row
            strict[index]
    strict.close()
    encoder = ChatEncoder(chat["tok"], "t", ChatOptions(skip_bad=True))
    lenient = _stream(str(path), encoder, (0, 31), buffer=4, cache=str(tmp_path / "lenient"))
    windows = []
    while not windows or lenient._window(len(windows) - 1)[0] == 0:
        windows.append(lenient[len(windows)]["text"].numpy())
    lenient.close()
    assert len(_documents(windows[:-1], encoder.separator)) == 30  # the epoch: every good row, the bad one skipped


@pytest.mark.parametrize("family", ["llama3", "mistral", "gemma", "qwen25", "deepseek"])
def test_todays_chat_templates_mask_what_their_tagged_twins_mark_and_find_a_separator(family):
    """Llama 3.x (bos and eos only, no pad, both written by the template), Mistral v0.3 (the system prompt moved
    into the last user turn, or dropped), Gemma 3 (no system role: folded into the first user turn, contents
    trimmed), Qwen2.5 (its own default system prompt), DeepSeek: without generation markers the assistant tokens
    are found in the conversation rendered once and equal what transformers marks with the same template's
    tagged twin; a special token the template never writes separates packed conversations (before: Llama 3 was
    refused, and every Mistral conversation with a system prompt was a bad row)."""
    from tests.chat_templates import family_tokenizer
    plain = ChatEncoder(family_tokenizer(family), family)
    twin = family_tokenizer(family, tagged=True)
    assert not plain.generation_tags
    convs = conversations(24, seed=3)
    convs[0][-1]["content"] = "  an answer with spaces around it  "  # templates that trim and that do not
    convs[1][0]["content"] = "say the python language"  # the assistant's words in the user's turn first
    convs[1][1]["content"] = "the python language"
    checked = 0
    for messages in convs:
        if family == "gemma" and messages[0]["role"] == "system":  # its own folding, above; twin alike
            pass
        want = twin.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = plain.encode(messages, "x")
        assert ids == list(want["input_ids"]) and mask == [bool(m) for m in want["assistant_masks"]], \
            (family, messages, plain.tok.decode([t for t, m in zip(ids, mask) if m]))
        assert any(mask)
        checked += 1
    assert checked == len(convs)
    rendered = set(plain.tok(plain._render(convs[2]), add_special_tokens=False)["input_ids"])
    assert plain.separator not in rendered and plain.tok.convert_ids_to_tokens(plain.separator) in \
        plain.tok.all_special_tokens + [t.content for t in plain.tok.added_tokens_decoder.values() if t.special]


@pytest.mark.slow
def test_dpo_with_lora_scores_its_reference_with_the_adapters_off_as_trl_with_peft_does(chat, pairs, tmp_path):
    """LoRA (adapters with A and B non-zero) under --dpo: the reference is the policy's own base (hybrid.model.lora
    .BaseModel: the adapters off, no second model); the loss and every adapter's gradient equal TRL's DPOTrainer on
    the PeftModel with the base transformers model as its ref_model, on the same rows. (Without a ref_model TRL 1.16
    would copy a pretrained adapter as the reference: the same values only for a fresh adapter, whose B is zero.)"""
    import dataclasses

    from peft import PeftModel

    from hybrid.conversion import peft as P
    from hybrid.conversion.layout import load_parts
    from hybrid.data.batches import Collator
    from hybrid.model import lora
    from hybrid.model.objectives import PreferencePairs
    from hybrid.model.preference import DPOOptions
    from hybrid.parallel.groups import ParallelGroups
    from tests.test_lora import TARGETS, peft_model
    peft_model(chat["hf"], targets=TARGETS[:4] + ["down_proj"], seed=2).save_pretrained(tmp_path / "adapter")
    encoder = ChatEncoder(chat["tok"], "t", ChatOptions(pairs=True))
    tokens, mask, _ = evaluation_windows(pairs["data"], 2 * SEQ, encoder)
    ids, labels = Collator()([{"text": torch.from_numpy(t.astype(np.int64)), "loss_mask": torch.from_numpy(m)}
                              for t, m in zip(tokens, mask)])
    options = DPOOptions(0.5, 0.0, "sigmoid", encoder.separator)
    base = _ours(chat["hf"], encoder.separator, options)
    config = dataclasses.replace(base.config, **P.flags_of(P.read_config(tmp_path / "adapter")))
    policy = __import__("hybrid.model.build", fromlist=["build_model"]).build_model(config, ParallelGroups.single())
    state = {**{n: p.detach() for n, p in base.named_parameters()}, **P.read_adapter(tmp_path / "adapter", config)}
    load_parts(policy, [state], config, ParallelGroups.single())
    lora.freeze_base(policy, config)
    objective = PreferencePairs(ParallelGroups.single(), config.vocab_size, options, lora.BaseModel(policy))
    loss = objective.loss(policy(ids, stage=0), objective.target(ids, labels), None)
    loss.backward()
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(chat["hf"], dtype=torch.float32)
    peft_policy = PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True)
    want, trained = trl_dpo_peft(peft_policy, AutoModelForCausalLM.from_pretrained(chat["hf"], dtype=torch.float32),
                                 chat["tok"], pairs["rows"], tmp_path)
    want.backward()
    assert abs(loss.item() - 0.6931471805599453) > 1e-3  # the policy is not its reference
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item()), (loss.item(), want.item())
    theirs = dict(trained.named_parameters())
    for name, param in policy.named_parameters():
        if lora.is_adapter(name):
            grad = theirs[P.peft_key(name).replace(".weight", ".default.weight")].grad
            torch.testing.assert_close(param.grad, grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item())
        else:
            assert param.grad is None, name


def trl_dpo_peft(policy, reference, tok, rows, tmp):
    """TRL's DPOTrainer on a PeftModel against `reference`: the loss (with its graph) and the model it trains."""
    import datasets
    from trl import DPOTrainer
    run = DPOTrainer(model=policy, ref_model=reference, args=trl_config(tmp, beta=0.5, loss_type=["sigmoid"],
                                                                     per_device_train_batch_size=len(rows)),
                     train_dataset=datasets.Dataset.from_list(rows), processing_class=tok)
    batch = run.data_collator(list(run.train_dataset))
    return run.compute_loss(run.model, batch), run.model


@pytest.mark.slow
def test_dpo_with_lora_holds_one_model_and_scores_the_reference_file_with_the_adapters_off(chat, pairs, tmp_path):
    """--dpo --load-lora (a PEFT adapter with A and B non-zero, so the policy is not its reference): no second model;
    the same run with --dpo-reference-logps at DP 2 under ZeRO-3 (the file scored by the model itself with its
    adapters off: scored with them on, the first loss would be ln 2) gives the one-rank losses; PEFT's fresh adapters
    (--lora-rank: B zero) start at ln 2, the policy equal to its reference."""
    from checks.launch_helpers import read_log, run
    from tests.test_lora import TARGETS, peft_model
    from tests.test_training import assert_same_losses
    peft_model(chat["hf"], targets=TARGETS, seed=4).save_pretrained(tmp_path / "adapter")
    base = DPO_RUN + ["--load-hf", chat["hf"], "--data-path", pairs["data"], "--load-lora", tmp_path / "adapter"]
    one, two, fresh = tmp_path / "one.jsonl", tmp_path / "two.jsonl", tmp_path / "fresh.jsonl"
    proc = run("python", 1, base + ["--log-json", one])
    assert "the reference is the model itself with its adapters off" in proc.stdout + proc.stderr
    run("torchrun", 2, base + ["--deepspeed", "ds_configs/zero3.json", "--dpo-reference-logps",
                               tmp_path / "reference.npz", "--log-json", two])
    want, got = read_log(one), read_log(two)
    assert abs(want[0]["lm_loss"] - 0.6931471805599453) > 1e-3, want[0]
    assert_same_losses([r["lm_loss"] for r in got], [r["lm_loss"] for r in want])
    run("python", 1, DPO_RUN + ["--load-hf", chat["hf"], "--data-path", pairs["data"], "--lora-rank", 4,
                                "--lora-target-modules", "all-linear", "--train-iters", 1, "--log-json", fresh])
    assert abs(read_log(fresh)[0]["lm_loss"] - 0.6931471805599453) < 1e-6
