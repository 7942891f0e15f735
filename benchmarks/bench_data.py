"""Data pipeline throughput, printed as JSON (ratios are against baselines measured in this run).

    python benchmarks/bench_data.py [--mb 50] [--workers 2]

1. preprocessing: launch/preprocess_data.py's end-to-end throughput on a generated corpus,
   against the same tokenizer's raw `encode_batch` throughput on the same texts (target >= 0.7);
2. sample reads: GPTDataset samples of seq-length 1024 per second, index look-ups only and full
   token reads (target >= 100k/s for look-ups).
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=256)
    args = parser.parse_args()
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
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
