"""--sft-streaming: the training conversations tokenized while the batches are built, not before the first one.

A background process (forked, as DataLoader workers are) reads the training rows in file order, tokenizes them
(hybrid.data.chat: the model's chat template and its loss mask), passes them through a shuffle buffer of
--sft-shuffle-buffer conversations (datasets' `IterableDataset.shuffle`: each arriving conversation takes the
place of one drawn at random from the buffer, which leaves), packs what leaves into windows (the same
packing as the whole-file path, hybrid.data.chat.packing.pack_units) and sends them to the training process, a bounded
number ahead. Epoch e draws from `RandomState(seed + 1 + e)`, so the windows are a function of the file, the
tokenizer and its template, --seq-length and --seed alone, not of timing: every DP rank's worker makes the same
ones and each rank keeps the windows its sampler asks for, and a resumed run's worker makes them again up to
the next one the run needs (hybrid.training.resume restores consumed_samples) and sends from there.

The cache beside the data: rank 0's worker writes each block of ROWS_PER_SHARD tokenized rows as it goes
(`<name>.<key>.sft-stream/shard_<k>.npz`, a temporary name renamed when whole; the key covers the file's size
and time, the tokenizer, template and options), and every worker reads a block from there when it exists, so
the second epoch, a restart and later runs tokenize nothing again.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import queue
import sys
import time
from typing import Optional

import numpy as np
import torch

from hybrid.data.chat.cache import is_preprocessed, signature
from hybrid.data.chat.dataset import ChatDataset
from hybrid.data.chat.options import Counts
from hybrid.data.chat.packing import pack_units, truncation_rule
from hybrid.data.chat.rows import BadRow, read_rows
from hybrid.data.chat.template import ChatEncoder, encode_rows
from hybrid.distributed import log
from hybrid.errors import ConfigError

ROWS_PER_SHARD = 1024
AHEAD = 256  # windows the worker may have made that the run has not asked for yet
_VERSION = 1


def count_rows(path: str) -> int:
    """The rows of a file (what --split divides), read without tokenizing."""
    return sum(1 for _ in read_rows(path))


def stream_cache(path: str, encoder: ChatEncoder, rows: tuple[int, int], cache_dir: Optional[str]) -> str:
    """The directory of a file's tokenized blocks (beside the file, or in --data-cache-path)."""
    key = hashlib.sha256(repr((os.path.abspath(path), signature(path), encoder.fingerprint(), rows,
                               ROWS_PER_SHARD, _VERSION)).encode()).hexdigest()[:16]
    base = cache_dir or os.path.dirname(os.path.abspath(os.path.normpath(path)))
    return os.path.join(base, f"{os.path.basename(os.path.normpath(path))}.{key}.sft-stream")


def _shard_path(cache: str, k: int) -> str:
    return os.path.join(cache, f"shard_{k:06d}.npz")


def _write_shard(cache: str, k: int, encoded: list) -> None:
    """A block's rows: each usable one's sequences (flat ids, masks, offsets, sequences per row), bad ones' messages."""
    sizes, ids, masks, offsets, bad = [], [], [], [0], []
    for where, sequences in encoded:
        if isinstance(sequences, str):
            bad.append(sequences)
            sizes.append(0)
            continue
        sizes.append(len(sequences))
        for tokens, loss in sequences:
            ids.extend(tokens)
            masks.extend(loss)
            offsets.append(len(ids))
    os.makedirs(cache, exist_ok=True)
    tmp = os.path.join(cache, f".shard_{k:06d}.{os.getpid()}.tmp.npz")
    np.savez(tmp, ids=np.asarray(ids, dtype=np.int32), mask=np.asarray(masks, dtype=bool),
             offsets=np.asarray(offsets, dtype=np.int64), sizes=np.asarray(sizes, dtype=np.int32),
             bad=np.frombuffer(json.dumps(bad).encode(), dtype=np.uint8))
    os.replace(tmp, _shard_path(cache, k))


def _read_shard(cache: str, k: int) -> Optional[list]:
    """A cached block as encode_rows' (where, sequences or message) pairs; None if it is not there (or broken)."""
    try:
        with np.load(_shard_path(cache, k), allow_pickle=False) as f:
            ids, mask, offsets, sizes = f["ids"], f["mask"], f["offsets"], f["sizes"]
            bad = iter(json.loads(bytes(f["bad"]).decode()))
    except (OSError, KeyError, ValueError):
        return None
    out, seq = [], 0
    for size in sizes.tolist():
        if size == 0:
            out.append((None, next(bad)))
            continue
        out.append((None, [(ids[offsets[j]:offsets[j + 1]], mask[offsets[j]:offsets[j + 1]])
                           for j in range(seq, seq + size)]))
        seq += size
    return out


def _tokenized_rows(path: str, rows: tuple[int, int], encoder: ChatEncoder, cache: str, writer: bool, counts: Counts):
    """The rows [start, stop) of `path` in file order, each as its sequences (bad rows: counted with
    --sft-skip-bad, else BadRow), from the cache's blocks or tokenized here (and written when `writer`)."""
    start, stop = rows
    reader, position = None, start
    for k in range(-(-(stop - start) // ROWS_PER_SHARD)):
        lo = start + k * ROWS_PER_SHARD
        hi = min(stop, lo + ROWS_PER_SHARD)
        encoded = _read_shard(cache, k)
        if encoded is None:
            if reader is None or position != lo:
                reader, position = itertools.islice(read_rows(path), lo, stop), lo
            encoded = encode_rows(itertools.islice(reader, hi - lo), encoder)
            position = hi
            counts.conversations += len(encoded)  # tokenized here (the log's rate)
            if writer:
                _write_shard(cache, k, encoded)
        for _, sequences in encoded:
            if isinstance(sequences, str):
                if not encoder.options.skip_bad:
                    raise BadRow(f"{sequences} (--sft-skip-bad counts and skips such rows)")
                counts.skipped_bad += 1
                continue
            yield [(np.asarray(t, dtype=np.int32), np.asarray(m, dtype=bool)) for t, m in sequences]


def stream_windows(path: str, rows: tuple[int, int], encoder: ChatEncoder, width: int, seed: int, buffer: int,
                   cache: str, writer: bool = False, log_every: float = 10.0):
    """Every window of the stream, epoch after epoch: (epoch, tokens [width], loss mask [width])."""
    for epoch in itertools.count():
        rng = np.random.RandomState(seed + 1 + epoch)
        counts, pool, started, last = Counts(), [], time.time(), time.time()

        def shuffled():
            nonlocal last
            for unit in _tokenized_rows(path, rows, encoder, cache, writer, counts):
                if len(pool) < buffer:
                    pool.append(unit)
                    continue
                k = rng.randint(buffer)
                pool[k], unit = unit, pool[k]
                yield unit
                if writer and time.time() - last > log_every:
                    last = time.time()
                    log(f"sft stream: {path}: {counts.conversations} conversations tokenized "
                        f"({counts.conversations / (last - started):.0f}/s)")
            for k in rng.permutation(len(pool)):
                yield pool[k]

        made = 0
        for tokens, mask in pack_units(shuffled(), width, encoder.separator, encoder.options, counts):
            made += 1
            yield epoch, tokens, mask
        if made == 0:
            raise BadRow(f"--data-path {path}: no usable conversation in rows {rows[0]}-{rows[1]} "
                         f"({counts.skipped_bad} bad rows skipped).")
        if writer:
            log(f"sft stream: {path} epoch {epoch}: {made} windows of {width} tokens; {counts.skipped_bad} bad rows "
                f"skipped, {counts.truncated} truncated, {counts.dropped} dropped ("
                f"{truncation_rule(encoder.options, width)}); {counts.conversations} tokenized in "
                f"{time.time() - started:.1f}s")


def _produce(out, first: int, arguments: dict, parent: int) -> None:
    """The background process: windows `first`, `first + 1`, ... into `out` (a bounded queue), each as
    (index, epoch, tokens, mask); a bad row ends the stream with ("error", message). It ends itself when the
    training process `parent` is gone (killed, so it never closed the stream)."""
    torch.set_num_threads(1)

    def put(item):
        while True:
            try:
                out.put(item, timeout=5.0)
                return
            except queue.Full:
                if os.getppid() != parent:
                    raise SystemExit(0) from None

    try:
        for index, (epoch, tokens, mask) in enumerate(stream_windows(**arguments)):
            if index >= first:
                put((index, epoch, tokens, mask))
    except (BadRow, ConfigError) as e:
        put(("error", str(e)))


class StreamingChatDataset(torch.utils.data.Dataset):
    """The training windows of one file as the background process makes them (module docstring). Indices are
    asked for in increasing order (the run's sampler); `dataset[i]` waits for window i. Read in the training
    process itself (the loader takes no worker processes for it: the stream is its worker)."""

    streams = True

    def __init__(self, path: str, rows: tuple[int, int], encoder: ChatEncoder, width: int, seed: int, buffer: int,
                 num_samples: int, cache: str, writer: bool):
        self.num_samples = num_samples
        self.arguments = dict(path=path, rows=rows, encoder=encoder, width=width, seed=seed, buffer=buffer,
                              cache=cache, writer=writer)
        self._process, self._queue, self._windows, self._next = None, None, {}, None

    def __len__(self) -> int:
        return self.num_samples

    def _start(self, first: int) -> None:
        context = multiprocessing.get_context("fork")
        self._queue = context.Queue(maxsize=AHEAD)
        self._process = context.Process(target=_produce, args=(self._queue, first, self.arguments, os.getpid()),
                                        daemon=True, name="hybrid-sft-stream")
        self._process.start()
        self._next = first

    def close(self) -> None:
        if self._process is not None and self._process.pid is not None:  # started (a failed start has no pid)
            self._process.kill()
            self._process.join()
        self._process = None

    def __del__(self):
        if not sys.is_finalizing():  # at exit the daemon process is ended by multiprocessing itself
            self.close()

    def _window(self, index: int):
        if self._process is None or (index < self._next and index not in self._windows):
            self.close()  # the first, or one already dropped: the stream made again from there
            self._windows = {}
            self._start(index)
        while index not in self._windows:
            try:
                item = self._queue.get(timeout=5.0)
            except queue.Empty:
                if not self._process.is_alive():
                    raise ConfigError(f"--sft-streaming: the tokenizing process for {self.arguments['path']} ended "
                                      f"(exit code {self._process.exitcode}) before window {index}.") from None
                continue
            if item[0] == "error":
                raise ConfigError(item[1])
            self._windows[item[0]] = item[1:]
            self._next = item[0] + 1
        for old in [k for k in self._windows if k < index]:
            del self._windows[old]
        return self._windows[index]

    def __getitem__(self, index: int) -> dict:
        _, tokens, mask = self._window(int(index))
        return {"text": torch.from_numpy(tokens.astype(np.int64)), "loss_mask": torch.from_numpy(mask)}


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", "0"))


def split_datasets(path: str, ranges_of, num_samples, seq_length: int, seed: int, encoder: ChatEncoder,
                   cache_dir: Optional[str] = None) -> list:
    """hybrid.data.chat.dataset.split_datasets with the training split streamed: its rows (--split divides the file's
    rows, counted without tokenizing) go to a StreamingChatDataset; a validation or test split, a small part,
    is tokenized here (through the same cache) and packed as the whole-file path packs it."""
    if is_preprocessed(path):
        raise ConfigError(f"--sft-streaming with --data-path {path}: preprocessed files are read memory-mapped "
                          f"already; drop --sft-streaming.")
    writer = _rank() == 0
    out = []
    for split, ((start, stop), wanted) in enumerate(zip(ranges_of(count_rows(path)), num_samples)):
        if stop <= start or wanted <= 0:
            out.append(None)
            continue
        cache = stream_cache(path, encoder, (start, stop), cache_dir)
        if split == 0:
            out.append(StreamingChatDataset(path, (start, stop), encoder, seq_length + 1, seed,
                                            encoder.options.stream_buffer,
                                            wanted, cache, writer))
            log(f"sft: {path} train: rows {start}-{stop} streamed (tokenized as the batches need them, shuffle buffer "
                f"{encoder.options.stream_buffer}; cache {cache})")
            continue
        counts = Counts()
        try:
            units = list(_tokenized_rows(path, (start, stop), encoder, cache, writer, counts))
        except BadRow as e:
            raise ConfigError(str(e)) from None
        order = np.random.RandomState(seed).permutation(len(units))
        windows = list(pack_units((units[k] for k in order), seq_length + 1, encoder.separator, encoder.options,
                                  counts))
        if not windows:
            raise ConfigError(f"--data-path {path}: rows {start}-{stop} hold no usable conversation.")
        out.append(ChatDataset(np.stack([t for t, _ in windows]), np.stack([m for _, m in windows]), wanted, seed))
    return out
