"""Megatron .bin/.idx format, preprocessing, GPT sample indices, blending, tokenizers, bad input."""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from hybrid.data import default as default_data
from hybrid.data.gpt_dataset import (BlendedDataset, GPTDataset, blending_indices, build_sample_idx,
                                     build_train_valid_test_datasets, split_ranges)
from hybrid.data.indexed import IndexedDataset, IndexedDatasetBuilder
from hybrid.data.tokenizer import GPT2BPETokenizer, HFTokenizer, NullTokenizer
from hybrid.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, MERGES = str(default_data.VOCAB), str(default_data.MERGES)


# --- an independent writer/reader following the published format (not the project's code) ---

def independent_write(prefix, documents, dtype=np.uint16, code=8):
    sizes = [len(d) for d in documents]
    with open(prefix + ".bin", "wb") as f:
        for d in documents:
            f.write(np.array(d, dtype=dtype).tobytes())
    pointers, pos = [], 0
    for s in sizes:
        pointers.append(pos)
        pos += s * np.dtype(dtype).itemsize
    doc_idx = list(range(len(documents) + 1))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def independent_read(prefix):
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, = struct.unpack_from("<Q", raw, 9)
    code, = struct.unpack_from("<B", raw, 17)
    n, ndoc = struct.unpack_from("<QQ", raw, 18)
    sizes = struct.unpack_from(f"<{n}i", raw, 34)
    pointers = struct.unpack_from(f"<{n}q", raw, 34 + 4 * n)
    doc_idx = struct.unpack_from(f"<{ndoc}q", raw, 34 + 12 * n)
    dtype = {4: np.int32, 8: np.uint16}[code]
    data = np.fromfile(prefix + ".bin", dtype=dtype)
    itemsize = np.dtype(dtype).itemsize
    docs = [data[p // itemsize: p // itemsize + s].tolist() for p, s in zip(pointers, sizes)]
    return version, code, docs, list(doc_idx)


DOCS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11], [12, 13, 14, 15]]


def test_reader_reads_files_written_by_an_independent_writer(tmp_path):
    prefix = str(tmp_path / "ind")
    independent_write(prefix, DOCS)
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == DOCS
    assert ds.dtype == np.uint16 and list(ds.doc_idx) == list(range(6))
    assert ds.get(2, offset=1, length=3).tolist() == [7, 8, 9]
    independent_write(prefix, [[70000, 1]], dtype=np.int32, code=4)
    assert IndexedDataset(prefix)[0].tolist() == [70000, 1]


def test_writer_output_is_read_by_an_independent_reader(tmp_path):
    prefix = str(tmp_path / "ours")
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    for d in DOCS[:2]:
        builder.add_document(d)
    builder.add_encoded_chunk(np.array(sum(DOCS[2:], []), np.uint16), np.array([len(d) for d in DOCS[2:]]))
    assert not os.path.exists(prefix + ".idx"), "nothing final before finalize()"
    builder.finalize()
    version, code, docs, doc_idx = independent_read(prefix)
    assert (version, code, docs, doc_idx) == (1, 8, DOCS, list(range(6)))


@pytest.mark.parametrize("damage, message", [
    (lambda raw: b"XXXXXXX\x00\x00" + raw[9:], "bad magic"),
    (lambda raw: raw[:9] + struct.pack("<Q", 2) + raw[17:], "version 2"),
    (lambda raw: raw[:17] + b"\x63" + raw[18:], "unknown dtype code 99"),
    (lambda raw: raw[:-5], "truncated or corrupt"),
])
def test_corrupt_index_is_named_with_what_mismatched(tmp_path, damage, message):
    prefix = str(tmp_path / "bad")
    independent_write(prefix, DOCS)
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    with open(prefix + ".idx", "wb") as f:
        f.write(damage(raw))
    with pytest.raises(ConfigError, match=message) as err:
        IndexedDataset(prefix)
    assert "bad.idx" in str(err.value)


def test_truncated_bin_and_missing_files_are_clear_errors(tmp_path):
    prefix = str(tmp_path / "trunc")
    independent_write(prefix, DOCS)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ConfigError, match=r"trunc.bin: size 10 bytes does not match"):
        IndexedDataset(prefix)
    with pytest.raises(ConfigError, match=r"nothere.idx does not exist"):
        IndexedDataset(str(tmp_path / "nothere"))


def _megatron_sample_idx(sizes, doc_idx, seq_length, num_samples):
    """Direct port of Megatron-LM's C++ build_sample_idx loop, as the reference."""
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    sample, doc_i, offset = 1, 0, 0
    while sample <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_len = sizes[doc_idx[doc_i]] - offset
            remaining -= doc_len
            if remaining <= 0:
                offset += remaining + doc_len - 1
                remaining = 0
            else:
                doc_i += 1
                offset = 0
        out[sample] = (doc_i, offset)
        sample += 1
    return out


def test_sample_index_matches_megatron_loop():
    rng = np.random.RandomState(0)
    sizes = rng.randint(1, 40, size=50).astype(np.int32)
    doc_idx = np.concatenate([rng.permutation(50), rng.permutation(50)]).astype(np.int32)
    for seq in (1, 7, 16, 64):
        num = (int(sizes.sum()) * 2 - 1) // seq
        assert np.array_equal(build_sample_idx(sizes, doc_idx, seq, num),
                              _megatron_sample_idx(sizes, doc_idx, seq, num))
        for chunk in (1, 3, 17):  # documents taken a few at a time: samples straddle chunk boundaries
            assert np.array_equal(build_sample_idx(sizes, doc_idx, seq, num, chunk=chunk),
                                  _megatron_sample_idx(sizes, doc_idx, seq, num))


def test_split_ranges_as_megatron():
    assert split_ranges("949,50,1", 1000) == [(0, 949), (949, 999), (999, 1000)]
    assert split_ranges("98,2,0", 10) == [(0, 10), (10, 10), (10, 10)]
    assert split_ranges("1", 7) == [(0, 7), (7, 7), (7, 7)]
    with pytest.raises(ConfigError, match="--split"):
        split_ranges("a,b", 10)


def test_gpt_samples_cross_documents_wrap_epochs_and_are_deterministic(tmp_path):
    prefix = str(tmp_path / "d")
    docs = [list(range(100 * i, 100 * i + n)) for i, n in enumerate([5, 9, 3, 12, 7, 4])]
    independent_write(prefix, docs)
    indexed = IndexedDataset(prefix)
    stream_tokens = sum(len(d) for d in docs)
    num_samples = 3 * stream_tokens // 8  # about 3 epochs
    ds = GPTDataset("train", indexed, np.arange(6), num_samples, 8, seed=5)
    samples = [ds.tokens(i) for i in range(len(ds))]
    assert all(s.shape == (9,) for s in samples)
    assert any(len({t // 100 for t in s}) > 1 for s in samples), "samples must cross documents"
    # every sample is a window of the doc_idx-ordered stream
    stream = np.concatenate([np.asarray(docs[d]) for d in ds.doc_idx])
    for i in range(len(ds)):
        j = int(ds.shuffle_idx[i])
        assert np.array_equal(samples[i], stream[j * 8: j * 8 + 9])
    assert len(ds.doc_idx) >= 3 * 6
    again = GPTDataset("train", indexed, np.arange(6), num_samples, 8, seed=5)
    assert all(np.array_equal(again.tokens(i), samples[i]) for i in range(len(ds)))
    other_seed = GPTDataset("train", indexed, np.arange(6), num_samples, 8, seed=6)
    assert not all(np.array_equal(other_seed.tokens(i), samples[i]) for i in range(len(ds)))


def test_index_cache_is_reused_and_rebuilt_when_data_changes(tmp_path):
    prefix = str(tmp_path / "c")
    independent_write(prefix, DOCS)
    GPTDataset("train", IndexedDataset(prefix), np.arange(5), 4, 3, seed=1)
    cached = sorted(p for p in os.listdir(tmp_path) if p.endswith(".npy"))
    assert len(cached) == 3
    mtimes = [os.stat(tmp_path / p).st_mtime_ns for p in cached]
    GPTDataset("train", IndexedDataset(prefix), np.arange(5), 4, 3, seed=1)
    assert [os.stat(tmp_path / p).st_mtime_ns for p in cached] == mtimes, "reused, not rebuilt"
    independent_write(prefix, [d[::-1] for d in DOCS] + [[1, 2, 3, 4, 5, 6]])  # data changed
    ds = GPTDataset("train", IndexedDataset(prefix), np.arange(6), 4, 3, seed=1)
    assert len([p for p in os.listdir(tmp_path) if p.endswith(".npy")]) == 6, "new index for new data"
    assert ds.sample_idx.shape == (int((sum(map(len, DOCS)) + 6 - 1) // 3) + 1, 2)


def test_blending_follows_weights_and_train_valid_test_build(tmp_path):
    ds_idx, sample_idx = blending_indices([0.7, 0.3], 1000)
    assert abs((ds_idx == 0).mean() - 0.7) < 0.002
    assert list(sample_idx[ds_idx == 1][:5]) == [0, 1, 2, 3, 4]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    independent_write(a, [[1] * 20] * 40)
    independent_write(b, [[2] * 20] * 40)
    train, valid, test = build_train_valid_test_datasets(["0.7", a, "0.3", b], "90,10,0", [200, 20, 0], 8, seed=3)
    assert isinstance(train, BlendedDataset) and len(train) == 200 and test is None
    ones = sum(int(train[i]["text"][0] == 1) for i in range(200))
    assert 135 <= ones <= 145
    assert valid[0]["text"].shape == (9,)
    with pytest.raises(ConfigError, match="weight/prefix pairs"):
        build_train_valid_test_datasets(["0.7", a, "0.3"], "1", [1, 0, 0], 8, seed=3)


def test_gpt2_bpe_tokenizer_encodes_to_tokens_and_round_trips():
    tok = GPT2BPETokenizer(VOCAB, MERGES)
    ids = tok.tokenize("The quick brown fox jumps over the lazy dog.")
    assert len(ids) > 3 and tok.detokenize(ids) == "The quick brown fox jumps over the lazy dog."
    assert tok.vocab_size == default_data.VOCAB_SIZE and tok.detokenize([tok.eod]) == "<|endoftext|>"
    hf = tok.to_transformers()
    assert hf("The quick brown fox")["input_ids"] == tok.tokenize("The quick brown fox")


def test_hf_tokenizer_from_local_directory(tmp_path):
    GPT2BPETokenizer(VOCAB, MERGES).to_transformers().save_pretrained(str(tmp_path / "tok"))
    tok = HFTokenizer(str(tmp_path / "tok"))
    assert tok.tokenize("hello world") == GPT2BPETokenizer(VOCAB, MERGES).tokenize("hello world")
    assert tok.eod == 0 and tok.vocab_size == default_data.VOCAB_SIZE
    with pytest.raises(ConfigError, match="--tokenizer-model"):
        HFTokenizer(str(tmp_path / "missing"))
    assert NullTokenizer(10).eod == 10 and NullTokenizer(10).tokenize("1 2 3") == [1, 2, 3]


def _run_preprocess(tmp_path, lines, *extra):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(lines))
    cmd = [sys.executable, os.path.join(ROOT, "launch", "preprocess_data.py"), "--input", str(path),
           "--output-prefix", str(tmp_path / "out"), "--vocab-file", VOCAB, "--merge-file", MERGES,
           "--tokenizer-type", "GPT2BPETokenizer", "--dataset-impl", "mmap", "--append-eod", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_preprocess_data_writes_megatron_files_equal_to_tokenizer_output(tmp_path):
    texts = [f"Document number {i}: the Python language reference, section {i}." for i in range(50)]
    lines = [json.dumps({"text": t, "other": "x"}) + "\n" for t in texts]
    lines.insert(7, json.dumps({"text": ""}) + "\n")  # empty: skipped and counted
    proc = _run_preprocess(tmp_path, lines, "--workers", "2", "--chunk-size", "8", "--log-interval", "10")
    assert proc.returncode == 0, proc.stderr
    assert "docs/s" in proc.stderr and "1 empty documents" in proc.stderr
    tok = GPT2BPETokenizer(VOCAB, MERGES)
    _, code, docs, _ = independent_read(str(tmp_path / "out_text_document"))
    assert code == 8 and docs == [tok.tokenize(t) + [tok.eod] for t in texts]


def test_preprocess_bad_json_names_file_and_line_and_writes_nothing(tmp_path):
    lines = [json.dumps({"text": "a"}) + "\n", "{not json\n", json.dumps({"text": "b"}) + "\n"]
    proc = _run_preprocess(tmp_path, lines)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "in.jsonl:2: malformed JSON" in proc.stderr
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")], "no partial output"
    proc = _run_preprocess(tmp_path, lines, "--skip-bad-lines")
    assert proc.returncode == 0 and "skipped 1 malformed lines" in proc.stderr
    proc = _run_preprocess(tmp_path, [json.dumps({"body": "a"}) + "\n"])
    assert proc.returncode != 0 and "no key 'text'" in proc.stderr and "--json-keys" in proc.stderr


def test_default_corpus_is_real_text_and_tokenizes():
    docs = default_data.read_corpus()
    assert 100 < len(docs) and 500_000 < sum(map(len, docs)) < 3_000_000
    assert any("function" in d for d in docs)
    ds = IndexedDataset(default_data.default_data_prefix())
    assert ds.num_tokens > 100_000 and ds.dtype == np.uint16
