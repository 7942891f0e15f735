"""Real Megatron-LM / Megatron-DeepSpeed / BigScience run scripts (tests/data/megatron_run_scripts.json,
flags with their sources) parse with only the script name changed, or stop at once naming the flag
they need that hybrid refuses; scaled-down versions train; sample-, token- and iteration-based
schedules agree; the batch ramp-up follows megatron-core's calculator and is layout-independent."""

import json
import os
import shutil
from unittest import mock

import numpy as np
import pytest

from hybrid.config import build_run_config
from hybrid.flags import build_parser
from hybrid.errors import ConfigError
from hybrid.megatron_compat import COMPAT_FLAGS
from checks.launch_helpers import MERGES, ROOT, VOCAB, copy_default_corpus, read_log, run

CORPUS = json.load(open(os.path.join(ROOT, "tests", "data", "megatron_run_scripts.json")))["scripts"]
# what each script does on a GPU machine: None = runs; else the flag its refusal names
EXPECTED_REFUSAL = {
    "megatron_lm_llama3_8b_fp8": "--decoupled-lr",  # its FP8 flags run (--fp8-param-gather aside: the table's)
    "megatron_lm_gpt3_175b_samples": "--rampup-batch-size",  # ramp-up with pipeline parallelism
    "megatron_deepspeed_gpt_1.3b_tokens": "--log-optimizer-states-to-tensorboard",
    "megatron_deepspeed_gpt_1.3b_rope": "--log-optimizer-states-to-tensorboard",  # (its --rotary-percent 0.25 is read)
    "bigscience_bloom_176b": "--embed-layernorm",
    "bigscience_tr1_13b": "--codecarbon-dir",
    "megatron_deepspeed_moe_gpt_1.3b_moe128": "--moe-expert-parallel-size",  # DeepSpeed-MoE's spelling
    "megatron_deepspeed_zbh1_gpt_1.3b": "--enable-zbh1-pipeline",
    "megatron_deepspeed_ulysses_gpt_1.3b_32k": "--use-flash-attn-triton",  # Ulysses itself runs
    "llm_jp_v3_megatron_sakura_1.8b": "--use-z-loss",
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Files the scripts' placeholders stand for: data, a SentencePiece model, a DeepSpeed config."""
    tmp = tmp_path_factory.mktemp("assets")
    data = copy_default_corpus(str(tmp))
    import sentencepiece
    from hybrid.data import default as default_data
    text = tmp / "corpus.txt"
    text.write_text("\n".join(default_data.read_corpus())[:300_000])
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp / "spm"), vocab_size=600,
                                             model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
                                             minloglevel=2)
    ds_config = tmp / "ds.json"
    ds_config.write_text("{}")
    from tests.hf_families import save_embedded_tokenizer
    save_embedded_tokenizer(tmp / "hf_tok")  # the data's tokenizer, as a HuggingFace tokenizer directory
    from hybrid.data.preprocess import build_parser as preprocess_parser
    from hybrid.data.preprocess import preprocess
    jsonl = tmp / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in default_data.read_corpus()[:400]))
    preprocess(preprocess_parser().parse_args(["--input", str(jsonl), "--output-prefix", str(tmp / "spm_data"),
                                               "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                                               str(tmp / "spm.model"), "--append-eod"]), log=lambda _: None)
    return {"DATA_SPM": str(tmp / "spm_data_text_document"), "DATA": data, "DATA2": data, "DATA3": data, "VOCAB": VOCAB,
            "MERGES": MERGES,
            "SPM": str(tmp / "spm.model"), "CKPT": str(tmp / "ckpt"), "TB": str(tmp / "tb"),
            "DS_CONFIG": str(ds_config),
            "CACHE": str(tmp / "cache"), "HF_TOKENIZER": str(tmp / "hf_tok"), "KILL": str(tmp / "kill"),
            "SPLITS": str(tmp / "splits.txt")}


def argv_of(name, assets):
    out = []
    for arg in CORPUS[name]["argv"]:
        for key, value in assets.items():
            arg = arg.replace("{" + key + "}", value)
        out.append(arg)
    return out


def _world(argv):
    def value(flag, default):
        return int(argv[argv.index(flag) + 1]) if flag in argv else default
    return (value("--tensor-model-parallel-size", 1) * value("--pipeline-model-parallel-size", 1)
            * value("--expert-model-parallel-size", 1))


def test_the_corpus_has_at_least_25_real_scripts_with_sources():
    assert len(CORPUS) >= 25
    for entry in CORPUS.values():
        assert entry["repo"] and entry["path"] and len(entry["commit"]) == 40 and len(entry["argv"]) > 20


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_real_run_script_parses_or_names_the_refused_flag(name, assets):
    """With a GPU assumed (fp16 is only refused on CPU), every flag is handled or refused on purpose:
    an unknown flag fails this test."""
    argv = argv_of(name, assets)
    with mock.patch("torch.cuda.is_available", return_value=True):
        try:
            args = build_parser().parse_args(argv)
        except ConfigError as error:
            pytest.fail(f"{name}: a flag is neither handled nor refused on purpose: {error}")
        try:
            run_config = build_run_config(args, _world(argv), 50257)
            outcome = None
        except ConfigError as error:
            outcome = str(error)
    want = EXPECTED_REFUSAL.get(name)
    if want is None:
        assert outcome is None, f"{name} should run but stopped: {outcome}"
        assert run_config.training.train_iters > 0
    else:
        assert outcome is not None and want in outcome, f"{name}: expected a refusal naming {want}, got {outcome}"


def test_every_refused_flag_is_one_clear_message_from_the_script(assets):
    proc = run("python", 1, argv_of("bigscience_bloom_176b", assets)[:0] + ["--decoupled-lr", "1e-4"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert ("--decoupled-lr is not supported: a separate embedding/output learning rate is not implemented"
            in proc.stderr)
    assert all(f.why for f in COMPAT_FLAGS.values())


SHRINK = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--ffn-hidden-size": "128",
          "--seq-length": "32", "--max-position-embeddings": "32", "--micro-batch-size": "2",
          "--global-batch-size": "8",
          "--train-iters": "3", "--eval-iters": "1", "--eval-interval": "3", "--log-interval": "1",
          "--save-interval": "3", "--num-key-value-heads": "2", "--lr-warmup-iters": "1", "--lr-decay-iters": "3",
          "--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "1", "--lr-warmup-fraction": "0.1",
          "--num-query-groups": "2", "--kv-channels": "16", "--padded-vocab-size": "8192", "--train-samples": "6",
          "--lr-decay-samples": "6"}
DROP = {"--fp16", "--bf16", "--distributed-timeout-minutes"}  # no fp16/bf16 on DeepSpeed's CPU accelerator: fp32


def scaled_down(argv, log):
    """The script's flags with sizes shrunk to a 2-rank CPU run; every other flag kept."""
    out, i = [], 0
    while i < len(argv):
        flag = argv[i]
        values = []
        while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            values.append(argv[i + 1])
            i += 1
        i += 1
        if flag in DROP:
            continue
        out += [flag] + ([SHRINK[flag]] if flag in SHRINK and values else values)
    return out + ["--log-json", str(log), "--no-progress-bar", "--make-vocab-size-divisible-by", "8"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["megatron_lm_gpt2_345m_tp2_pp2", "megatron_deepspeed_llama2",
                                  "megatron_deepspeed_universal_ckpt_gpt", "megatron_lm_qwen3_0.6b",
                                  "megatron_lm_qwen2.5_0.5b", "megatron_lm_llama3.2_1b"])
def test_scaled_down_real_script_trains(name, assets, tmp_path):
    local = dict(assets, CKPT=str(tmp_path / "ckpt"), TB=str(tmp_path / "tb"))
    if "{SPM}" in CORPUS[name]["argv"]:  # data tokenized by the script's own SentencePiece model
        local["DATA"] = assets["DATA_SPM"]
    log = tmp_path / "log.jsonl"
    argv = scaled_down(argv_of(name, local), log)
    launcher = "deepspeed" if CORPUS[name]["launcher"] == "deepspeed" else "torchrun"
    run(launcher, 2, argv)
    records = [r for r in read_log(log) if "consumed_samples" in r]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(np.isfinite(r["lm_loss"]) for r in records)
    assert os.path.isfile(tmp_path / "ckpt" / "latest")
    if CORPUS[name].get("family"):  # Megatron-LM's own definition of a family: the checkpoint records that family
        from hybrid.checkpoint.client_state import read_client_state
        from hybrid.checkpoint.files import read_tag
        config = read_client_state(str(tmp_path / "ckpt"), read_tag(str(tmp_path / "ckpt"))).model_config()
        assert config.family == {"megatron_lm_qwen3_0.6b": "qwen3", "megatron_lm_qwen2.5_0.5b": "qwen2",
                                     "megatron_lm_llama3.2_1b": "llama"}[name]
        assert (config.qk_layernorm, config.add_qkv_bias, bool(config.rope_scaling)) == {
            "megatron_lm_qwen3_0.6b": (True, False, False), "megatron_lm_qwen2.5_0.5b": (False, True, False),
            "megatron_lm_llama3.2_1b": (False, False, True)}[name]


TINY = ["--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 16,
        "--micro-batch-size", 2, "--global-batch-size", 4, "--lr", 1e-3, "--min-lr", 1e-4, "--lr-decay-style", "cosine",
        "--hidden-dropout", 0, "--attention-dropout", 0, "--vocab-file", VOCAB, "--merge-file", MERGES,
        "--split", "98,2,0", "--make-vocab-size-divisible-by", 8, "--seed", 7, "--log-interval", 1, "--eval-iters", 0,
        "--no-progress-bar"]


def _records(tmp_path, name, flags, launcher="python", nproc=1, data=None):
    log = tmp_path / f"{name}.jsonl"
    run(launcher, nproc, TINY + ["--data-path", data] + flags + ["--log-json", log])
    return [r for r in read_log(log) if "consumed_samples" in r]


@pytest.mark.slow
def test_sample_and_token_schedules_equal_the_iteration_schedule(tmp_path, data):
    iters = _records(tmp_path, "iters", ["--train-iters", 6, "--lr-warmup-iters", 2, "--lr-decay-iters", 5], data=data)
    samples = _records(tmp_path, "samples", ["--train-samples", 24, "--lr-warmup-samples", 8,
                                             "--lr-decay-samples", 20], data=data)
    tokens = _records(tmp_path, "tokens", ["--train-tokens", 24 * 16, "--lr-warmup-tokens", 8 * 16,
                                           "--lr-decay-tokens", 20 * 16], data=data)
    assert len(iters) == len(samples) == len(tokens) == 6
    for a, b, c in zip(iters, samples, tokens):
        assert a["lr"] == b["lr"] == c["lr"] and a["lm_loss"] == b["lm_loss"] == c["lm_loss"]
    assert iters[0]["lr"] == 0.0 and iters[2]["lr"] == 1e-3 and iters[-1]["lr"] == 1e-4


@pytest.mark.slow
def test_rampup_follows_megatron_core_and_is_the_same_at_dp2(tmp_path, data):
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator
    flags = ["--train-samples", 40, "--rampup-batch-size", 2, 2, 12, "--global-batch-size", 8,
             "--micro-batch-size", 1, "--lr-warmup-samples", 4]
    one = _records(tmp_path, "ramp_dp1", flags, data=data)
    two = _records(tmp_path, "ramp_dp2", flags + ["--deepspeed", "ds_configs/zero1.json"], "torchrun", 2, data)
    calc = RampupBatchsizeNumMicroBatchesCalculator(8, 1, 1, False, 0, 2, 2, 12)
    consumed, want = 0, []
    for _ in one:
        calc.update(consumed, consistency_check=True)
        want.append(calc.get_current_global_batch_size())
        consumed += want[-1]
    assert [r["global_batch_size"] for r in one] == want
    assert want[0] == 2 and want[-1] == 8 and len(set(want)) == 4
    assert [r["consumed_samples"] for r in one][-1] <= 40
    for a, b in zip(one, two):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 1e-5 * abs(a["lm_loss"]) and a["lr"] == b["lr"]


@pytest.mark.slow
def test_exit_duration_saves_and_stops_and_checkpoint_args_are_reused(tmp_path, data):
    ckpt = tmp_path / "ckpt"
    proc = run("python", 1, TINY + ["--data-path", data, "--train-iters", 50, "--exit-duration-in-mins", 1e-6,
                                    "--save", ckpt])
    assert "exiting at iteration 1 (--exit-duration-in-mins" in proc.stdout
    assert (ckpt / "latest").read_text().strip() == "iter_0000001"
    # the saved run's architecture wins over the flags with --use-checkpoint-args
    other = [str(x) for x in TINY]
    other[other.index("--num-layers") + 1] = "3"
    wrong = run("python", 1, other + ["--data-path", data, "--train-iters", 2, "--load", ckpt], check=False)
    assert wrong.returncode != 0
    proc = run("python", 1, other + ["--data-path", data, "--train-iters", 2, "--load", ckpt, "--use-checkpoint-args"])
    assert "loaded checkpoint" in proc.stdout


def test_sentencepiece_tokenizer_in_preprocessing_matches_sentencepiece(assets, tmp_path):
    import sentencepiece
    from hybrid.data.indexed import IndexedDataset
    corpus = tmp_path / "c.jsonl"
    texts = ["Hello world, this is SentencePiece.", "A second document."]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    run("python", 1, ["--input", corpus, "--output-prefix", tmp_path / "sp", "--tokenizer-type",
                      "GPTSentencePieceTokenizer", "--tokenizer-model", assets["SPM"], "--append-eod"],
        script="launch/preprocess_data.py")
    sp = sentencepiece.SentencePieceProcessor(model_file=assets["SPM"])
    ds = IndexedDataset(str(tmp_path / "sp_text_document"))
    assert [ds[i].tolist() for i in range(2)] == [sp.encode(t) + [sp.eos_id()] for t in texts]


def test_megatron_conversion_flags_are_accepted(tmp_path):
    from hybrid.conversion.checkpoint_util import build_parser as convert_parser
    args = convert_parser().parse_args(["--model-type", "GPT", "--loader", "llama_mistral", "--saver", "mcore",
                                        "--checkpoint-type", "hf", "--model-size", "llama2-7B", "--load-dir", "a",
                                        "--save-dir", "b", "--target-tensor-parallel-size", "2", "--bf16",
                                        "--megatron-path", "/x", "--loader-transformer-impl", "local"])
    assert args.loader == "hf" and args.saver == "megatron"  # mcore: Megatron-LM's own format
    proc = run("python", 1, ["--loader", "llama_mistral", "--checkpoint-type", "meta", "--load-dir", tmp_path,
                             "--save-dir", tmp_path / "out"], script="conversion/checkpoint_util.py", check=False)
    assert proc.returncode == 2 and "--checkpoint-type meta" in proc.stderr
    shutil.rmtree(tmp_path / "out", ignore_errors=True)


COMMANDS = json.load(open(os.path.join(ROOT, "tests", "data", "megatron_run_scripts.json")))["commands"]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_real_preprocessing_and_conversion_commands_parse(name, tmp_path):
    from hybrid.conversion.checkpoint_util import build_parser as convert_parser
    from hybrid.data.preprocess import build_parser as preprocess_parser
    entry = COMMANDS[name]
    values = {"JSONL": str(tmp_path / "c.jsonl"), "OUT": str(tmp_path / "out"), "HF_TOKENIZER": str(tmp_path),
              "VOCAB": VOCAB, "MERGES": MERGES, "HF_DIR": str(tmp_path)}
    argv = [a.format(**values) if "{" in a else a for a in entry["argv"]]
    parser = preprocess_parser() if entry["tool"] == "preprocess" else convert_parser()
    args = parser.parse_args(argv)
    assert args.output_prefix if entry["tool"] == "preprocess" else args.loader == "hf"
