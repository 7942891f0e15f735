"""Megatron-LM's memory-mapped indexed dataset (`.bin` tokens + `.idx` index), read and written.

Index layout (little-endian), as Megatron-LM's MMapIndexedDataset:
  magic b"MMIDIDX\\x00\\x00" | version <Q = 1 | dtype code <B | sequence count <Q | document count <Q
  | sizes int32[sequences] | pointers int64[sequences] (byte offsets into .bin)
  | document index int64[documents] (sequence index where each document starts, then the end)
The `.bin` holds every sequence's tokens back to back in that dtype.
"""

from __future__ import annotations

import os
import struct
from functools import cached_property
from typing import Optional

import numpy as np

from hybrid.errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8


def dtype_code(dtype) -> int:
    for code, candidate in DTYPES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {dtype} has no Megatron code")


def best_dtype(vocab_size: int):
    """uint16 when every token id fits (as Megatron-LM), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_paths(prefix: str) -> tuple[str, str]:
    return prefix + ".bin", prefix + ".idx"


class IndexedDatasetBuilder:
    """Append sequences to `<prefix>.bin` and write the `.idx` at the end.

    Writes go to `<file>.tmp` names that are renamed only in `finalize()`, so an interrupted run
    never leaves a pair that looks complete.
    """

    def __init__(self, prefix: str, dtype=np.uint16):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        self.bin_path, self.idx_path = data_file_paths(prefix)
        self._bin = open(self.bin_path + ".tmp", "wb")
        self.sizes: list[int] = []
        self.doc_idx: list[int] = [0]

    def add_document(self, tokens) -> None:
        """One document made of one sequence."""
        self.add_sequences([tokens])

    def add_sequences(self, sequences) -> None:
        for tokens in sequences:
            array = np.asarray(tokens, dtype=self.dtype)
            self._bin.write(array.tobytes(order="C"))
            self.sizes.append(array.size)
        self.doc_idx.append(len(self.sizes))

    def add_encoded_chunk(self, flat_tokens: np.ndarray, sizes: np.ndarray,
                          sequences_per_document: Optional[np.ndarray] = None) -> None:
        """Many documents at once: tokens back to back, each sequence's length, and how many
        sequences each document has (default: one each)."""
        self._bin.write(np.ascontiguousarray(flat_tokens, dtype=self.dtype).tobytes())
        start = len(self.sizes)
        self.sizes.extend(int(s) for s in sizes)
        if sequences_per_document is None:
            self.doc_idx.extend(range(start + 1, len(self.sizes) + 1))
        else:
            self.doc_idx.extend(int(x) for x in start + np.cumsum(sequences_per_document))

    def finalize(self) -> None:
        self._bin.close()
        sizes = np.asarray(self.sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(self.idx_path + ".tmp", "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", dtype_code(self.dtype)))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(struct.pack("<Q", len(self.doc_idx)))
            f.write(sizes.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self.doc_idx, dtype=np.int64).tobytes(order="C"))
        os.replace(self.bin_path + ".tmp", self.bin_path)
        os.replace(self.idx_path + ".tmp", self.idx_path)

    def abort(self) -> None:
        """Remove the temporary files (after an error)."""
        self._bin.close()
        for path in (self.bin_path + ".tmp", self.idx_path + ".tmp"):
            if os.path.exists(path):
                os.remove(path)


class IndexedDataset:
    """Read-only view over a `.bin/.idx` pair; nothing is loaded beyond the index arrays' mmap."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.bin_path, self.idx_path = data_file_paths(prefix)
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise ConfigError(f"data file {path} does not exist; --data-path takes the prefix "
                                  f"(e.g. my-corpus_text_document) of a .bin/.idx pair made by "
                                  f"launch/preprocess_data.py.")
        self._read_index()
        self._bin = np.memmap(self.bin_path, dtype=np.uint8, mode="r") if os.path.getsize(self.bin_path) else \
            np.zeros(0, dtype=np.uint8)
        expected = int(self.sizes.astype(np.int64).sum()) * self.dtype.itemsize
        if self._bin.size != expected:
            raise ConfigError(f"{self.bin_path}: size {self._bin.size} bytes does not match its index "
                              f"({expected} bytes expected from {self.idx_path}); the pair is truncated or "
                              f"from different runs: re-run launch/preprocess_data.py.")

    def _read_index(self) -> None:
        path = self.idx_path
        file_size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = f.read(_HEADER)
        if len(header) < _HEADER or header[: len(MAGIC)] != MAGIC:
            raise ConfigError(f"{path}: bad magic {header[:len(MAGIC)]!r}, expected {MAGIC!r}: not a "
                              f"Megatron mmap index (made with --dataset-impl mmap?).")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            raise ConfigError(f"{path}: index version {version}, only version {VERSION} is supported.")
        (code,) = struct.unpack("<B", header[17:18])
        if code not in DTYPES:
            raise ConfigError(f"{path}: unknown dtype code {code}; known codes are {sorted(DTYPES)}.")
        self.dtype = np.dtype(DTYPES[code])
        seq_count, doc_count = struct.unpack("<QQ", header[18:34])
        expected = _HEADER + seq_count * (4 + 8) + doc_count * 8
        if file_size != expected:
            raise ConfigError(f"{path}: {file_size} bytes, but its header declares {seq_count} sequences and "
                              f"{doc_count} document entries ({expected} bytes): truncated or corrupt.")
        index = np.memmap(path, dtype=np.uint8, mode="r")
        offset = _HEADER
        self.sizes = np.frombuffer(index, dtype=np.int32, count=seq_count, offset=offset)
        offset += seq_count * 4
        self.pointers = np.frombuffer(index, dtype=np.int64, count=seq_count, offset=offset)
        offset += seq_count * 8
        self.doc_idx = np.frombuffer(index, dtype=np.int64, count=doc_count, offset=offset)
        if seq_count and (self.sizes.min() < 0 or self.pointers[0] != 0):
            raise ConfigError(f"{path}: corrupt sizes/pointers.")

    def __len__(self) -> int:
        return len(self.sizes)

    @cached_property
    def num_tokens(self) -> int:
        return int(self.sizes.astype(np.int64).sum())

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of sequence `index` from `offset`, `length` of them (all by default)."""
        size = int(self.sizes[index])
        if length is None:
            length = size - offset
        start = int(self.pointers[index]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def flat(self) -> np.ndarray:
        """Every sequence's tokens back to back, in order (memory-mapped, nothing read yet)."""
        return np.frombuffer(self._bin, dtype=self.dtype, count=self.num_tokens)
