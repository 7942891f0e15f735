"""Data pipeline throughput, printed as JSON (ratios are against baselines measured in this run).

    python benchmarks/bench_data.py [--mb 50] [--workers 2]

1. preprocessing: launch/preprocess_data.py's end-to-end throughput on a generated corpus,
   against the same tokenizer's raw `encode_batch` throughput on the same texts (target >= 0.7);
2. sample reads: GPTDataset samples of seq-length 1024 per second, index look-ups only and full
   token reads (target >= 100k/s for look-ups);
3. sample-index build: our vectorised build_sample_idx against megatron-core's C++ helper on the
   same synthetic index (10M documents, ~1B tokens, seq 1024 by default): seconds and peak extra
   memory of each, each measured in a forked child (skipped when megatron-core is absent).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.data import default as default_data  # noqa: E402
from hybrid.data.gpt_dataset import GPTDataset  # noqa: E402
from hybrid.data.indexed import IndexedDataset  # noqa: E402
from hybrid.data.preprocess import build_parser, preprocess  # noqa: E402
from hybrid.data.tokenizer import GPT2BPETokenizer  # noqa: E402


def make_corpus(path: str, megabytes: float) -> list[str]:
    """Documents shuffled from the default corpus's paragraphs until `megabytes` of JSON lines."""
    paragraphs = [p for d in default_data.read_corpus() for p in d.split("\n\n") if p.strip()]
    rng = random.Random(0)
    texts, size = [], 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * 1e6:
            text = "\n\n".join(rng.sample(paragraphs, rng.randint(2, 8)))
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            texts.append(text)
            size += len(line)
    return texts


def bench_raw_tokenizer(texts: list[str], batch: int) -> float:
    tok = GPT2BPETokenizer(str(default_data.VOCAB), str(default_data.MERGES))
    start = time.perf_counter()
    for i in range(0, len(texts), batch):
        tok.tokenize_batch(texts[i:i + batch])
    return time.perf_counter() - start


def bench_reads(prefix: str, seq_length: int = 1024, reads: int = 200_000) -> dict:
    indexed = IndexedDataset(prefix)
    ds = GPTDataset("bench", indexed, np.arange(len(indexed.sizes)), 50_000, seq_length, seed=1, cache=False)
    order = np.random.default_rng(0).integers(0, len(ds), reads)
    start = time.perf_counter()
    for i in order:
        j = int(ds.shuffle_idx[i])
        ds.sample_idx[j]
        ds.sample_idx[j + 1]
    lookups = reads / (time.perf_counter() - start)
    n = reads // 10
    start = time.perf_counter()
    for i in order[:n]:
        ds.tokens(int(i))
    full = n / (time.perf_counter() - start)
    return {"index_lookups_per_s": lookups, "samples_read_per_s": full}


def _measure_in_child(fn, *args) -> dict:
    """Run fn(*args) in a forked child: its seconds and peak resident memory above its start."""
    import multiprocessing as mp

    def child(queue):
        def rss_kb(field):
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith(field))
        before = rss_kb("VmRSS:")
        start = time.perf_counter()
        out = fn(*args)
        seconds = time.perf_counter() - start
        queue.put({"seconds": seconds, "peak_extra_mb": (rss_kb("VmHWM:") - before) / 1024,
                   "checksum": int(np.asarray(out, dtype=np.int64).sum())})

    queue = mp.get_context("fork").Queue()
    proc = mp.get_context("fork").Process(target=child, args=(queue,))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def bench_index_build(num_docs: int, seq_length: int) -> dict:
    from hybrid.data.gpt_dataset import build_sample_idx
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 200, num_docs, dtype=np.int32)  # mean ~100 tokens: ~1B tokens for 10M docs
    doc_idx = rng.permutation(num_docs).astype(np.int32)
    tokens = int(sizes.sum(dtype=np.int64))
    num_samples = (tokens - 1) // seq_length
    ours = _measure_in_child(build_sample_idx, sizes, doc_idx, seq_length, num_samples)
    result = {"index_documents": num_docs, "index_tokens": tokens, "index_samples": num_samples,
              "ours_build_s": ours["seconds"], "ours_peak_extra_mb": ours["peak_extra_mb"]}
    try:
        from megatron.core.datasets import helpers
    except ImportError:
        result["megatron_core"] = "not installed (pip install megatron-core)"
        return result
    theirs = _measure_in_child(helpers.build_sample_idx, sizes, doc_idx, seq_length, 1, tokens, True, True)
    result.update(megatron_core_build_s=theirs["seconds"], megatron_core_peak_extra_mb=theirs["peak_extra_mb"],
                  build_time_vs_megatron_core=ours["seconds"] / theirs["seconds"],
                  identical_to_megatron_core=ours["checksum"] == theirs["checksum"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--index-documents", type=int, default=10_000_000)
    args = parser.parse_args()
    index = bench_index_build(args.index_documents, 1024)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        texts = make_corpus(corpus, args.mb)
        corpus_mb = os.path.getsize(corpus) / 1e6
        raw_seconds = bench_raw_tokenizer(texts, args.chunk_size)
        text_mb = sum(len(t.encode()) for t in texts) / 1e6
        flags = ["--input", corpus, "--output-prefix", os.path.join(tmp, "bench"),
                 "--vocab-file", str(default_data.VOCAB), "--merge-file", str(default_data.MERGES),
                 "--append-eod", "--workers", str(args.workers), "--chunk-size", str(args.chunk_size),
                 "--log-interval", str(10**9)]
        stats = preprocess(build_parser().parse_args(flags), log=lambda _: None)
        reads = bench_reads(os.path.join(tmp, "bench_text_document"))
    result = {
        "corpus_mb": round(corpus_mb, 1),
        "documents": stats["documents"],
        "raw_tokenizer_mb_per_s": text_mb / raw_seconds,
        "preprocess_mb_per_s": text_mb / stats["seconds"],
        "preprocess_vs_raw_tokenizer": raw_seconds / stats["seconds"],
        "workers": args.workers,
        **reads,
        **index,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
