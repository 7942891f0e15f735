"""Data parity with the real megatron-core package: every served sample of train/valid/test equals
megatron-core's, for splits (one with a single document), seeds, sequence lengths, multi-epoch
runs, a 3-way blend, split-specific data paths and the EOD loss mask; and megatron-core reads
what our preprocessing writes.

megatron-core is a test-only dependency (installed by .ci/run through the `dev` extra); without
it these tests skip with a message.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hybrid.parallel.cross_entropy import IGNORE_INDEX

mcore = pytest.importorskip("megatron.core.datasets.gpt_dataset",
                            reason="megatron-core is not installed (pip install megatron-core)")
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset as CoreGPTDataset  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset as CoreIndexedDataset  # noqa: E402

from hybrid.data import default as default_data  # noqa: E402
from hybrid.data.gpt_dataset import BlendedDataset, build_train_valid_test_datasets, split_ranges  # noqa: E402
from hybrid.data.indexed import IndexedDataset, IndexedDatasetBuilder  # noqa: E402
from hybrid.data.batches import Collator  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOD = 0
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    """megatron-core's BlendedDataset asks torch.distributed for its rank: a 1-rank gloo group."""
    import torch.distributed as dist
    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


class _Tokenizer:
    """What megatron-core's GPTDataset reads from a tokenizer."""
    vocab_size, eod, pad = 1000, EOD, -1
    unique_identifiers = {"class": "TestTokenizer"}


def _corpus(path, num_docs, seed, max_len=60):
    """Random documents ending in EOD (as preprocess_data --append-eod writes them)."""
    rng = np.random.RandomState(seed)
    builder = IndexedDatasetBuilder(str(path), np.uint16)
    for _ in range(num_docs):
        n = int(rng.randint(1, max_len))
        builder.add_document(list(rng.randint(1, 1000, size=n)) + [EOD])
    builder.finalize()
    return str(path)


def _core_datasets(tmp_path, seq, seed, sizes, blend=None, split=None, blend_per_split=None, eod_mask_loss=False):
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq, blend=blend, blend_per_split=blend_per_split, split=split,
        path_to_cache=str(tmp_path / "core_cache"), tokenizer=_Tokenizer(), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=eod_mask_loss, create_attention_mask=False)
    return BlendedMegatronDatasetBuilder(CoreGPTDataset, sizes, lambda: True, config).build()


def _core_text(dataset, index):
    sample = dataset[index]
    return torch.cat([sample["tokens"], sample["labels"][-1:]]).numpy()


def _assert_same(ours, core, label):
    assert (ours is None) == (core is None), f"{label}: one side built no dataset"
    if ours is None:
        return
    if isinstance(core, CoreGPTDataset):  # megatron-core's length counts the whole last epoch
        assert len(core) >= len(ours) == core.num_samples, f"{label}: {len(ours)} vs {core.num_samples}"
    else:
        assert len(ours) == len(core), f"{label}: {len(ours)} samples vs megatron-core's {len(core)}"
    for i in range(len(ours)):
        mine = ours[i]["text"].numpy()
        theirs = _core_text(core, i)
        assert np.array_equal(mine, theirs), f"{label}: sample {i} differs"


@pytest.mark.parametrize("num_docs", [1217, 997, 50])
@pytest.mark.parametrize("split", ["80,10,10", "949,50,1", "98,2,0", "1"])
def test_split_document_ranges_equal_megatron_core(num_docs, split):
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                        parse_and_normalize_split)
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    core = [(int(round(m[0] * float(num_docs))), int(round(m[1] * float(num_docs)))) if m else None for m in matrix]
    for ours, theirs in zip(split_ranges(split, num_docs), core):
        if theirs is None:
            assert ours[0] == ours[1]
        else:
            assert ours == theirs


def test_split_rounding_differs_from_legacy_where_megatron_core_does():
    assert split_ranges("80,10,10", 1217)[0] == (0, 974)  # megatron-core
    assert split_ranges("80,10,10", 1217, legacy=True)[0] == (0, 973)  # Megatron-DeepSpeed


# (megatron-core loops forever on a split of 0 documents, so every case gives each split one or more)
@pytest.mark.parametrize("seq,seed,split,num_docs,sizes", [
    (16, 1234, "80,10,10", 50, [900, 120, 40]),     # several epochs of valid/test
    (7, 5, "98,2,0", 50, [300, 45, 0]),              # a 1-document valid split, no test split
    (64, 99, "949,50,1", 1200, [2000, 64, 8]),       # 1-document test split; multi-epoch valid
])
def test_single_dataset_samples_equal_megatron_core(tmp_path, seq, seed, split, num_docs, sizes):
    prefix = _corpus(tmp_path / "one", num_docs, seed=seed)
    ours = build_train_valid_test_datasets([prefix], split, sizes, seq, seed, cache_dir=str(tmp_path / "c"))
    core = _core_datasets(tmp_path, seq, seed, sizes, blend=([prefix], None), split=split)
    for name, mine, theirs, n in zip(("train", "valid", "test"), ours, core, sizes):
        _assert_same(mine if n else None, theirs if n else None, f"{name} seq={seq} seed={seed}")


@pytest.mark.parametrize("seq,seed", [(16, 1234), (33, 7)])
def test_three_way_blend_equals_megatron_core(tmp_path, seq, seed):
    prefixes = [_corpus(tmp_path / f"b{k}", n, seed=k + seed) for k, n in enumerate((120, 60, 300))]
    weights = [0.5, 0.2, 0.3]
    sizes = [701, 93, 31]  # n x w not whole: the blend serves sum(ceil(n w)) samples
    data_path = [x for w, p in zip(weights, prefixes) for x in (str(w), p)]
    ours = build_train_valid_test_datasets(data_path, "90,8,2", sizes, seq, seed, cache_dir=str(tmp_path / "c"))
    core = _core_datasets(tmp_path, seq, seed, sizes, blend=(prefixes, weights), split="90,8,2")
    for name, mine, theirs in zip(("train", "valid", "test"), ours, core):
        assert isinstance(mine, BlendedDataset)
        assert np.array_equal(mine.dataset_index, theirs.dataset_index), f"{name}: blending order"
        assert np.array_equal(mine.sample_index, theirs.dataset_sample_index), f"{name}: per-dataset samples"
        assert [len(d) for d in mine.datasets] == [d.num_samples for d in theirs.datasets], f"{name}: counts"
        _assert_same(mine, theirs, f"blend {name}")


def test_split_specific_data_paths_equal_megatron_core_blend_per_split(tmp_path):
    a, b, c = (_corpus(tmp_path / n, k, seed=k) for n, k in (("a", 80), ("b", 30), ("c", 12)))
    sizes = [400, 60, 20]
    split_paths = [["0.6", a, "0.4", b], [c], [b]]
    ours = build_train_valid_test_datasets(None, "", sizes, 16, 3, cache_dir=str(tmp_path / "c"),
                                           split_paths=split_paths)
    core = _core_datasets(tmp_path, 16, 3, sizes, blend_per_split=[([a, b], [0.6, 0.4]), ([c], None), ([b], None)])
    for name, mine, theirs in zip(("train", "valid", "test"), ours, core):
        _assert_same(mine, theirs, f"{name} (split-specific path)")


def test_eod_mask_loss_equals_megatron_core(tmp_path):
    prefix = _corpus(tmp_path / "eod", 40, seed=3, max_len=12)
    ours = build_train_valid_test_datasets([prefix], "1", [50, 0, 0], 16, 1, cache_dir=str(tmp_path / "c"))[0]
    core = _core_datasets(tmp_path, 16, 1, [50, 0, 0], blend=([prefix], None), split="1", eod_mask_loss=True)[0]
    collate = Collator(eod_token=EOD, eod_mask_loss=True)
    ids, labels = collate([ours[i] for i in range(8)])
    theirs = [core[i] for i in range(8)]
    assert torch.equal(ids, torch.stack([t["tokens"] for t in theirs]))
    # megatron-core's loss mask is ours as IGNORE_INDEX in the labels; the other labels are theirs
    mask = torch.stack([t["loss_mask"] for t in theirs])
    assert torch.equal(labels, torch.stack([t["labels"] for t in theirs]).masked_fill(mask == 0, IGNORE_INDEX))
    assert (mask == 0).any(), "the corpus has EOD tokens inside samples"
    plain_ids, plain_labels = Collator()([ours[0]])
    assert not (plain_labels == IGNORE_INDEX).any(), "without --eod-mask-loss every position takes loss"


def test_megatron_core_reads_what_preprocess_data_writes(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    texts = ["The quick brown fox jumps over the lazy dog.", "Hello world.", "Megatron data, parity test."] * 4
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    subprocess.run([sys.executable, os.path.join(ROOT, "launch", "preprocess_data.py"), "--input", str(corpus),
                    "--output-prefix", str(tmp_path / "pp"), "--vocab-file", str(default_data.VOCAB),
                    "--merge-file", str(default_data.MERGES), "--tokenizer-type", "GPT2BPETokenizer",
                    "--append-eod", "--workers", "1"], check=True, capture_output=True)
    prefix = str(tmp_path / "pp_text_document")
    ours, theirs = IndexedDataset(prefix), CoreIndexedDataset(prefix)
    assert len(ours) == len(theirs) == len(texts)
    for i in range(len(texts)):
        assert np.array_equal(ours[i], theirs[i])
    assert np.array_equal(np.asarray(ours.doc_idx), np.asarray(theirs.document_indices))


def test_split_sentences_writes_one_sequence_per_sentence_grouped_by_document(tmp_path):
    pytest.importorskip("nltk", reason="--split-sentences needs nltk")
    from hybrid.data.preprocess import sentence_splitter
    from hybrid.data.tokenizer import GPT2BPETokenizer
    corpus = tmp_path / "corpus.jsonl"
    texts = ["First sentence here. Second one follows! And a third?", "Only one sentence", "Two of them. Yes."]
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    subprocess.run([sys.executable, os.path.join(ROOT, "launch", "preprocess_data.py"), "--input", str(corpus),
                    "--output-prefix", str(tmp_path / "s"), "--vocab-file", str(default_data.VOCAB),
                    "--merge-file", str(default_data.MERGES), "--append-eod", "--split-sentences"],
                   check=True, capture_output=True)
    prefix = str(tmp_path / "s_text_sentence")
    ours, theirs = IndexedDataset(prefix), CoreIndexedDataset(prefix)
    assert list(ours.doc_idx) == [0, 3, 4, 6] == list(theirs.document_indices)
    tok = GPT2BPETokenizer(str(default_data.VOCAB), str(default_data.MERGES))
    splitter = sentence_splitter()
    sentences = [s for t in texts for s in splitter.tokenize(t)]
    assert len(sentences) == len(ours) == 6
    last_of_doc = {2, 3, 5}
    for i, sentence in enumerate(sentences):
        want = tok.tokenize(sentence) + ([tok.eod] if i in last_of_doc else [])
        assert ours[i].tolist() == want == theirs[i].tolist()


@pytest.mark.slow
def test_split_data_paths_cache_path_and_eod_mask_loss_reach_training(tmp_path):
    from checks.launch_helpers import copy_default_corpus, read_log, run
    data = copy_default_corpus(str(tmp_path))
    cache = tmp_path / "index_cache"
    flags = ["--num-layers", 1, "--hidden-size", 32, "--num-attention-heads", 2, "--seq-length", 16,
             "--micro-batch-size", 2, "--global-batch-size", 2, "--train-iters", 2, "--eval-interval", 2,
             "--eval-iters", 1, "--log-interval", 1, "--no-progress-bar", "--vocab-file", default_data.VOCAB,
             "--merge-file", default_data.MERGES, "--train-data-path", "0.5", data, "0.5", data,
             "--valid-data-path", data, "--data-cache-path", cache, "--eod-mask-loss", "--log-json",
             tmp_path / "log.jsonl"]
    run("python", 1, flags)
    records = read_log(tmp_path / "log.jsonl")
    assert [r["iteration"] for r in records if "consumed_samples" in r] == [1, 2]
    assert any(r.get("split") == "valid" for r in records)
    cached = os.listdir(cache)
    assert any("_train_indexmap_" in f for f in cached) and any("_valid_indexmap_" in f for f in cached)
