"""GPT training samples from indexed datasets, with Megatron-LM's indices, splits and blending.

A sample is `seq_length + 1` consecutive tokens of the shuffled, epoch-repeated document stream
(it may cross document boundaries; consecutive samples share one token). Three index arrays,
built as Megatron-LM builds them from `numpy.random.RandomState(seed)`:
  doc_idx     the documents of every epoch, shuffled (the last epoch separately if it is small);
  sample_idx  [num_samples + 1, 2]: (position in doc_idx, token offset) where each sample starts;
  shuffle_idx the order in which samples are served.
They are cached as .npy files beside the data, keyed by every parameter they depend on.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hybrid.data.indexed import IndexedDataset
from hybrid.errors import ConfigError


def split_ranges(splits: str, size: int) -> list[tuple[int, int]]:
    """Document ranges for train/valid/test from "949,50,1" (Megatron's get_train_valid_test_split_)."""
    try:
        weights = [float(s) for s in splits.replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"--split {splits!r}: expected comma-separated numbers such as 949,50,1.") from None
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--split {splits!r}: weights must be non-negative with a positive sum.")
    weights = (weights + [0.0, 0.0])[:3]
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * float(size))))
    diff = bounds[-1] - size
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def _num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    epochs, tokens = 0, 0
    while True:
        epochs += 1
        tokens += tokens_per_epoch
        if (tokens - 1) // seq_length >= num_samples:
            return epochs


def _build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                   separate_last_epoch: bool) -> np.ndarray:
    if not separate_last_epoch or num_epochs == 1:
        doc_idx = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(doc_idx)
        return doc_idx
    first = _build_doc_idx(documents, num_epochs - 1, rng, False)
    last = _build_doc_idx(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """Start (doc_idx position, offset) of each sample: sample i starts at token i * seq_length
    of the doc_idx-ordered stream. Vectorised equivalent of Megatron-LM's C++ build_sample_idx."""
    doc_lengths = sizes[doc_idx].astype(np.int64)
    ends = np.cumsum(doc_lengths)  # stream position just after each document
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[position] - doc_lengths[position])
    return np.stack([position, offset], axis=1).astype(np.int64)


def _build_shuffle_idx(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class GPTDataset(torch.utils.data.Dataset):
    """`num_samples` samples of `seq_length + 1` tokens from `documents` of an indexed dataset."""

    def __init__(self, name: str, indexed: IndexedDataset, documents: np.ndarray, num_samples: int,
                 seq_length: int, seed: int, cache: bool = True):
        self.name, self.indexed, self.seq_length = name, indexed, seq_length
        if len(documents) == 0:
            raise ConfigError(f"{indexed.prefix}: the {name} split has no documents; change --split "
                              f"or add data.")
        tokens_per_epoch = int(indexed.sizes[documents].astype(np.int64).sum())
        if tokens_per_epoch <= 1:
            raise ConfigError(f"{indexed.prefix}: the {name} split holds {tokens_per_epoch} tokens; "
                              f"nothing to train on.")
        key = self._cache_key(documents, num_samples, seq_length, seed, tokens_per_epoch)
        paths = self._cache_paths(key) if cache else None
        if paths and _is_rank_zero() and not all(os.path.exists(p) for p in paths):
            self._write_cache(paths, *self._build(documents, num_samples, seq_length, seed, tokens_per_epoch))
        _barrier()  # every other rank waits for rank 0's files
        if paths and all(os.path.exists(p) for p in paths):
            self.doc_idx, self.sample_idx, self.shuffle_idx = (np.load(p, mmap_mode="r") for p in paths)
        else:
            self.doc_idx, self.sample_idx, self.shuffle_idx = self._build(
                documents, num_samples, seq_length, seed, tokens_per_epoch)
        self.num_samples = num_samples

    def _cache_key(self, documents, num_samples, seq_length, seed, tokens_per_epoch) -> str:
        """Every input the indices depend on, plus the data files' identity, so stale caches are
        never reused (a rebuilt .bin/.idx gets new indices)."""
        stat = os.stat(self.indexed.idx_path)
        ident = (f"{self.name}|{int(documents[0])}-{int(documents[-1])}|{len(documents)}|{num_samples}|"
                 f"{seq_length}|{seed}|{tokens_per_epoch}|{stat.st_size}|{stat.st_mtime_ns}|v1")
        return hashlib.sha256(ident.encode()).hexdigest()[:16]

    def _cache_paths(self, key):
        directory = os.path.dirname(os.path.abspath(self.indexed.prefix))
        if not os.access(directory, os.W_OK):
            return None
        base = f"{self.indexed.prefix}_{self.name}_indexmap_{key}"
        return [f"{base}_doc_idx.npy", f"{base}_sample_idx.npy", f"{base}_shuffle_idx.npy"]

    @staticmethod
    def _write_cache(paths, *arrays) -> None:
        for path, array in zip(paths, arrays):
            tmp = f"{path}.{os.getpid()}.tmp.npy"
            np.save(tmp, array)
            os.replace(tmp, path)

    def _build(self, documents, num_samples, seq_length, seed, tokens_per_epoch):
        rng = np.random.RandomState(seed=seed)
        num_epochs = _num_epochs(tokens_per_epoch, seq_length, num_samples)
        separate_last_epoch = False
        if num_epochs > 1:  # Megatron: shuffle a small last epoch on its own
            samples_before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
            last_epoch_samples = num_samples - samples_before_last
            samples_per_epoch = (tokens_per_epoch - 1) // seq_length
            separate_last_epoch = last_epoch_samples < int(0.80 * samples_per_epoch)
        doc_idx = _build_doc_idx(np.asarray(documents), num_epochs, rng, separate_last_epoch)
        total_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
        sample_idx = build_sample_idx(self.indexed.sizes, doc_idx, seq_length, total_samples)
        shuffle_size = samples_before_last if separate_last_epoch else total_samples
        shuffle_idx = _build_shuffle_idx(shuffle_size, total_samples, rng)
        return doc_idx, sample_idx, shuffle_idx

    def __len__(self) -> int:
        return self.num_samples

    def tokens(self, index: int) -> np.ndarray:
        """The `seq_length + 1` tokens of sample `index` (int64)."""
        i = int(self.shuffle_idx[index])
        (doc_f, off_f), (doc_l, off_l) = self.sample_idx[i], self.sample_idx[i + 1]
        if doc_f == doc_l:
            return self.indexed.get(int(self.doc_idx[doc_f]), int(off_f), int(off_l - off_f + 1)).astype(np.int64)
        parts = [self.indexed.get(int(self.doc_idx[doc_f]), int(off_f))]
        parts += [self.indexed.get(int(self.doc_idx[d])) for d in range(doc_f + 1, doc_l)]
        parts.append(self.indexed.get(int(self.doc_idx[doc_l]), 0, int(off_l + 1)))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, index: int) -> dict:
        return {"text": torch.from_numpy(self.tokens(index))}


class MockGPTDataset(torch.utils.data.Dataset):
    """Deterministic random tokens by sample index (Megatron-LM's --mock-data), for benchmarks."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        rng = np.random.default_rng(self.seed * 1_000_003 + index)
        return {"text": torch.from_numpy(rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64))}


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Which dataset, and which of its samples, serves each blended sample (Megatron's greedy rule:
    pick the dataset furthest below its share so far)."""
    weights = [float(w) for w in weights]
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    counts = [0] * len(weights)
    choices = range(len(weights))
    for i in range(size):  # plain Python: a few datasets, up to millions of samples
        chosen = max(choices, key=lambda d: weights[d] * (i + 1) - counts[d])
        dataset_index[i], sample_index[i] = chosen, counts[chosen]
        counts[chosen] += 1
    return dataset_index, sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """Several datasets mixed by weight."""

    def __init__(self, datasets: list, weights: Sequence[float], size: int):
        total = float(sum(weights))
        self.datasets, self.weights, self.size = datasets, [w / total for w in weights], size
        self.dataset_index, self.sample_index = blending_indices(self.weights, size)

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.datasets[int(self.dataset_index[index])][int(self.sample_index[index])]


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float]]:
    """`a` or `0.7 a 0.3 b` -> prefixes and weights."""
    data_path = list(data_path)
    if len(data_path) == 1:
        return data_path, [1.0]
    if len(data_path) % 2:
        raise ConfigError(f"--data-path {' '.join(data_path)}: with several datasets give weight/prefix pairs, "
                          f"e.g. --data-path 0.7 a_text_document 0.3 b_text_document.")
    try:
        weights = [float(w) for w in data_path[0::2]]
    except ValueError:
        raise ConfigError(f"--data-path {' '.join(data_path)}: weights must be numbers, "
                          f"e.g. 0.7 a_text_document 0.3 b_text_document.") from None
    return data_path[1::2], weights


def build_train_valid_test_datasets(data_path: Sequence[str], splits: str, num_samples: Sequence[int],
                                    seq_length: int, seed: int) -> list[Optional[torch.utils.data.Dataset]]:
    """Train/valid/test datasets (None for an empty split or zero samples), blended if several."""
    prefixes, weights = parse_data_path(data_path)
    names = ("train", "valid", "test")
    per_prefix = []
    for prefix in prefixes:
        indexed = IndexedDataset(prefix)
        ranges = split_ranges(splits, len(indexed.sizes))  # one sequence per document, as Megatron
        total = sum(weights)
        datasets = []
        for name, (start, stop), wanted in zip(names, ranges, num_samples):
            wanted = int(math.ceil(wanted * weights[prefixes.index(prefix)] / total * 1.005)) if len(prefixes) > 1 \
                else wanted
            if stop <= start or wanted <= 0:
                datasets.append(None)
                continue
            docs = np.arange(start, stop, dtype=np.int32)
            datasets.append(GPTDataset(name, indexed, docs, wanted, seq_length, seed))
        per_prefix.append(datasets)
    if len(prefixes) == 1:
        return per_prefix[0]
    out = []
    for split, wanted in enumerate(num_samples):
        parts = [d[split] for d in per_prefix]
        if any(p is None for p in parts) or wanted <= 0:
            out.append(None)
        else:
            out.append(BlendedDataset(parts, weights, wanted))
    return out
