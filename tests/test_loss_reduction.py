"""--calculate-per-token-loss: the iteration's loss is the mean over all its valid tokens, on every step
(plain engine with DP, DeepSpeed's pipeline, a torch schedule), when --eod-mask-loss leaves micro-batches
with different token counts.

The reference shares no reduction code: one rank with the whole global batch in one micro-batch, whose
loss (the mean over that micro-batch's valid tokens) is the per-token mean by definition.
"""

import json

import pytest

from checks.launch_helpers import MERGES, VOCAB, read_log, run

TINY = ["--num-layers", 4, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 16,
        "--max-position-embeddings", 16, "--global-batch-size", 8, "--train-iters", 4,
        "--lr", 1e-3, "--min-lr", 1e-4, "--lr-decay-style", "cosine", "--lr-warmup-iters", 1,
        "--clip-grad", 1.0, "--hidden-dropout", 0, "--attention-dropout", 0, "--vocab-file", VOCAB,
        "--merge-file", MERGES, "--split", "100,0,0", "--make-vocab-size-divisible-by", 8, "--seed", 5,
        "--log-interval", 1, "--eval-iters", 0, "--no-progress-bar", "--eod-mask-loss",
        "--init-method-std", 0.3]  # large weights: per-token losses far apart, so the reduction rule shows


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """A corpus of short documents, so 16-token samples hold several EODs (token counts differ per micro-batch)."""
    from hybrid.data.default import read_corpus
    directory = tmp_path_factory.mktemp("short_docs")
    words = " ".join(read_corpus()[:40]).split()
    texts = [" ".join(words[i:i + 3 + i % 5]) for i in range(0, 4000, 6)]
    corpus = directory / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    run("python", 1, ["--input", corpus, "--output-prefix", directory / "docs", "--vocab-file", VOCAB,
                      "--merge-file", MERGES, "--tokenizer-type", "GPT2BPETokenizer", "--append-eod",
                      "--workers", 1], script="launch/preprocess_data.py")
    return str(directory / "docs_text_document")


def _losses(data, tmp_path, name, launcher, nproc, extra):
    log = tmp_path / f"{name}.jsonl"
    run(launcher, nproc, TINY + ["--data-path", data, "--log-json", log, *extra])
    return [r["lm_loss"] for r in read_log(log) if "consumed_samples" in r]


@pytest.fixture(scope="module")
def whole_batch(short_documents, tmp_path_factory):
    """One rank, the global batch as one micro-batch: its loss is the per-token mean of the iteration."""
    return _losses(short_documents, tmp_path_factory.mktemp("ref"), "whole", "python", 1, ["--micro-batch-size", 8])


PER_TOKEN = ["--calculate-per-token-loss", "--micro-batch-size", 2]
LAYOUTS = {
    "dp2_zero1_gas2": ("torchrun", 2, PER_TOKEN + ["--deepspeed", "ds_configs/zero1.json"]),
    "pp2_deepspeed_1f1b": ("torchrun", 2, PER_TOKEN + ["--pipeline-model-parallel-size", 2]),
    "pp2_interleaved": ("torchrun", 2, PER_TOKEN + ["--pipeline-model-parallel-size", 2,
                                                   "--num-virtual-stages-per-pipeline-rank", 2]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_per_token_loss_equals_the_whole_batch_token_mean(short_documents, whole_batch, tmp_path, layout):
    launcher, nproc, extra = LAYOUTS[layout]
    got = _losses(short_documents, tmp_path, layout, launcher, nproc, extra)
    assert len(got) == len(whole_batch) == 4
    for i, (g, w) in enumerate(zip(got, whole_batch)):
        assert abs(g - w) <= 1e-5 * abs(w), f"iteration {i + 1}: {g!r} vs the whole batch's token mean {w!r}"


def test_without_the_flag_micro_batch_means_differ_from_the_token_mean(short_documents, whole_batch, tmp_path):
    """What makes the test above able to fail: with masked tokens the default rule (mean of micro-batch
    means) is another number."""
    got = _losses(short_documents, tmp_path, "default", "python", 1, ["--micro-batch-size", 2])
    assert max(abs(g - w) / abs(w) for g, w in zip(got, whole_batch)) > 1e-3
