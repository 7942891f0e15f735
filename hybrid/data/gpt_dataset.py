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


def _split_weights(splits: str) -> list[float]:
    try:
        weights = [float(s) for s in splits.replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"--split {splits!r}: expected comma-separated numbers such as 949,50,1.") from None
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--split {splits!r}: up to three non-negative weights (train,valid,test) "
                          f"with a positive sum, e.g. 949,50,1.")
    return (weights + [0.0, 0.0])[:3]


def split_ranges(splits: str, size: int, legacy: bool = False) -> list[tuple[int, int]]:
    """Document ranges for train/valid/test from "949,50,1".

    Default: megatron-core's rule (normalise the weights, round the cumulative fractions times
    `size`), with its float operations in its order so the boundaries are identical. `legacy`:
    the rule of Megatron-LM before megatron-core and of Megatron-DeepSpeed (round each share,
    then shift by the rounding remainder), for resuming runs that started there.
    """
    weights = _split_weights(splits)
    if legacy:
        total = sum(weights)
        bounds = [0]
        for w in weights:
            bounds.append(bounds[-1] + int(round(w / total * float(size))))
        diff = bounds[-1] - size
        bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
        return [(bounds[i], bounds[i + 1]) for i in range(3)]
    normalized = (np.array(weights, dtype=np.float64) / np.sum(np.array(weights, dtype=np.float64))).tolist()
    cumulative = [0.0]
    for w in normalized:
        cumulative.append(cumulative[-1] + w)
    out = []
    for lo, hi in zip(cumulative[:-1], cumulative[1:]):
        if hi <= lo:  # an empty share: megatron-core builds no dataset for it
            start = int(round(lo * float(size)))
            out.append((start, start))
        else:
            out.append((int(round(lo * float(size))), int(round(hi * float(size)))))
    return out


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


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int,
                     chunk: int = 1 << 20) -> np.ndarray:
    """Start (doc_idx position, offset) of each sample: sample i starts at token i * seq_length
    of the doc_idx-ordered stream. Vectorised equivalent of Megatron-LM's C++ build_sample_idx,
    int32 when the values fit (as megatron-core's helper returns). Documents are taken `chunk` at
    a time, so the extra memory is O(chunk) besides the result."""
    fits = max(len(doc_idx), int(sizes.max()) if len(sizes) else 0) <= np.iinfo(np.int32).max
    out = np.empty((num_samples + 1, 2), dtype=np.int32 if fits else np.int64)
    done, stream_start = 0, 0  # samples placed; stream position where this chunk begins
    for first in range(0, len(doc_idx), chunk):
        lengths = sizes[doc_idx[first:first + chunk]].astype(np.int64)
        ends = np.cumsum(lengths) + stream_start  # stream position just after each document
        stop = min(num_samples + 1, int((ends[-1] - 1) // seq_length) + 1)  # samples starting in here
        if stop > done:
            starts = np.arange(done, stop, dtype=np.int64) * seq_length
            position = np.searchsorted(ends, starts, side="right")
            out[done:stop, 0] = position + first
            out[done:stop, 1] = starts - (ends[position] - lengths[position])
            done = stop
        stream_start = int(ends[-1])
        if done > num_samples:
            break
    return out


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
                 seq_length: int, seed: int, cache: bool = True, cache_dir: Optional[str] = None):
        self.name, self.indexed, self.seq_length = name, indexed, seq_length
        self.cache_dir = cache_dir
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
        """Beside the data, or in --data-cache-path; None (build in memory) if not writable."""
        directory = self.cache_dir or os.path.dirname(os.path.abspath(self.indexed.prefix))
        if self.cache_dir:
            os.makedirs(directory, exist_ok=True)
        if not os.access(directory, os.W_OK):
            return None
        base = os.path.join(directory, f"{os.path.basename(self.indexed.prefix)}_{self.name}_indexmap_{key}")
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


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum, in float64 (megatron-core's `normalize`, bit for bit)."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Which dataset, and which of its samples, serves each blended sample.

    Megatron's greedy rule (megatron-core's C++ `build_blending_indices`, as in every Megatron
    version): sample i goes to the first dataset with the largest `w * max(i, 1) - count`.
    """
    weights = [float(w) for w in weights]
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    counts = [0] * len(weights)
    choices = range(len(weights))
    for i in range(size):  # sequential by nature; plain Python is ~1 s per million samples
        scale = float(max(i, 1))
        chosen = max(choices, key=lambda d: weights[d] * scale - counts[d])
        dataset_index[i], sample_index[i] = chosen, counts[chosen]
        counts[chosen] += 1
    return dataset_index, sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """Several datasets mixed by weight (megatron-core's BlendedDataset with a given size)."""

    def __init__(self, datasets: list, weights: Sequence[float], size: int):
        self.datasets, self.weights, self.size = datasets, normalize(weights), size
        self.dataset_index, self.sample_index = blending_indices(self.weights, size)
        for d, dataset in enumerate(datasets):
            wanted = int((self.dataset_index == d).sum())
            if wanted > len(dataset):
                raise ConfigError(f"the blend asks {wanted} samples of {getattr(dataset, 'name', d)} "
                                  f"which has {len(dataset)}; this is a bug in the sample counts.")

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.datasets[int(self.dataset_index[index])][int(self.sample_index[index])]


def parse_data_path(data_path: Sequence[str], flag: str = "--data-path") -> tuple[list[str], Optional[list[float]]]:
    """`a` -> ([a], None); `0.7 a 0.3 b` (or `1.0 a`) -> prefixes and weights, as Megatron's
    `get_blend_from_list`. Several prefixes without weights are refused (give the weights)."""
    data_path = list(data_path)
    if len(data_path) == 1:
        return data_path, None
    example = f"e.g. {flag} 0.7 a_text_document 0.3 b_text_document"
    if len(data_path) % 2:
        raise ConfigError(f"{flag} {' '.join(data_path)}: with several datasets give weight/prefix pairs, "
                          f"{example}.")
    try:
        weights = [float(w) for w in data_path[0::2]]
    except ValueError:
        raise ConfigError(f"{flag} {' '.join(data_path)}: weights must be numbers, {example}.") from None
    if any(w <= 0 for w in weights):
        raise ConfigError(f"{flag} {' '.join(data_path)}: weights must be positive, {example}.")
    return data_path[1::2], weights


SURPLUS = 0.005  # megatron-core's mid_level_dataset_surplus: extra samples per blended dataset


def blended_sample_counts(weights: Sequence[float], wanted: int, legacy: bool = False) -> tuple[list[int], int]:
    """(samples to build per dataset, size of the blend) for `wanted` samples.

    megatron-core: each dataset builds ceil(ceil(n w) x 1.005) samples and the blend serves
    sum(ceil(n w)); legacy Megatron-LM/Megatron-DeepSpeed: ceil(n w 1.005) and exactly n.
    """
    if legacy:
        return [int(math.ceil(wanted * w * 1.005)) for w in weights], wanted
    targets = [int(math.ceil(wanted * w)) for w in weights]
    return [int(math.ceil(t * (1 + SURPLUS))) for t in targets], sum(targets)


def _split_datasets(prefix, ranges_of, counts, seq_length, seed, cache_dir):
    """One GPTDataset per split of one prefix (document ranges from `ranges_of(num_documents)`);
    None where a split is empty or asks no samples."""
    indexed = IndexedDataset(prefix)
    out = []
    for name, (start, stop), wanted in zip(_NAMES, ranges_of(len(indexed.sizes)), counts):
        if stop <= start or wanted <= 0:
            out.append(None)
            continue
        docs = np.arange(start, stop, dtype=np.int32)
        out.append(GPTDataset(name, indexed, docs, wanted, seq_length, seed, cache_dir=cache_dir))
    return out


def build_blend(data_path, ranges_of, num_samples, seq_length, seed, cache_dir=None, legacy=False,
                flag="--data-path", split_datasets=None):
    """The datasets of each split from one blend (`a` or `w a w b ...`), as megatron-core's builder
    (`split_datasets(path, ranges_of, counts, seq_length, seed, cache_dir)`: one path's datasets per split;
    default: GPT samples of a .bin/.idx prefix)."""
    split_datasets = split_datasets or _split_datasets
    prefixes, weights = parse_data_path(data_path, flag)
    if weights is None:
        return split_datasets(prefixes[0], ranges_of, num_samples, seq_length, seed, cache_dir)
    weights = normalize(weights)
    per_split = [blended_sample_counts(weights, n, legacy) for n in num_samples]
    per_prefix = [split_datasets(prefix, ranges_of, [counts[k] for counts, _ in per_split], seq_length, seed,
                                 cache_dir) for k, prefix in enumerate(prefixes)]
    out = []
    for split, (_, size) in enumerate(per_split):
        parts = [d[split] for d in per_prefix]
        out.append(None if any(p is None for p in parts) or num_samples[split] <= 0
                   else BlendedDataset(parts, weights, size))
    return out


_NAMES = ("train", "valid", "test")


def build_train_valid_test_datasets(data_path: Optional[Sequence[str]], splits: str, num_samples: Sequence[int],
                                    seq_length: int, seed: int, cache_dir: Optional[str] = None,
                                    legacy: bool = False,
                                    split_paths: Optional[Sequence[Optional[Sequence[str]]]] = None,
                                    split_datasets=None) -> list[Optional[torch.utils.data.Dataset]]:
    """Train/valid/test datasets (None for an empty split or zero samples), blended if weighted.

    `data_path` with `splits` divides every dataset's documents by --split; `split_paths`
    (--train-data-path, --valid-data-path, --test-data-path) gives each split its own blend,
    all of whose documents it uses (megatron-core's `blend_per_split`). `legacy`: split
    rounding and blended sample counts of Megatron-DeepSpeed (see --legacy-data-rules).
    `split_datasets`: how one path becomes its splits' datasets (build_blend's; chat data passes its own).
    """
    if split_paths is None:
        return build_blend(data_path, lambda n: split_ranges(splits, n, legacy), num_samples, seq_length, seed,
                           cache_dir, legacy, split_datasets=split_datasets)
    out = []
    for k, (name, path) in enumerate(zip(_NAMES, split_paths)):
        if not path or num_samples[k] <= 0:
            out.append(None)
            continue
        counts = [n if j == k else 0 for j, n in enumerate(num_samples)]
        whole = lambda n, k=k: [(0, n) if j == k else (0, 0) for j in range(3)]  # noqa: E731
        out.append(build_blend(path, whole, counts, seq_length, seed, cache_dir, legacy,
                               f"--{name}-data-path", split_datasets)[k])
    return out
