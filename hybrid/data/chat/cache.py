"""Tokenized conversations kept: a file tokenized once per run (rank 0 writes, the others read) under a key of the
file, the tokenizer, the template and the options; and launch/preprocess_data.py --sft's Megatron .bin/.idx files
with their loss masks, refused when made with another tokenizer, template or option."""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Optional

import numpy as np
import torch.distributed as dist

from hybrid.data.chat.options import Counts
from hybrid.data.chat.rows import read_rows
from hybrid.data.chat.template import CACHE_VERSION, ChatEncoder, collect, encode_rows, Tokenized
from hybrid.data.indexed import IndexedDataset
from hybrid.errors import ConfigError


def tokenize_file(path: str, encoder: ChatEncoder) -> Tokenized:
    """Every conversation of `path`, tokenized in this process (bad rows stop the run, or are counted with
    --sft-skip-bad)."""
    ids, mask, offsets = [], [], [0]

    def add(sequences):
        for tokens, loss in sequences:
            ids.extend(tokens)
            mask.extend(loss)
            offsets.append(len(ids))

    counts = collect((encode_rows([item], encoder)[0] for item in read_rows(path)), encoder.options,
                     f"--data-path {path}", add)
    return Tokenized(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool),
                     np.asarray(offsets, dtype=np.int64), counts, 2 if encoder.options.pairs else 1)


PREPROCESSED_SUFFIX = ".sft.json"  # beside <prefix>_text_document.bin/.idx: what they hold and how they were made


def preprocessed_files(prefix: str) -> tuple[str, str, str]:
    """The files launch/preprocess_data.py --sft writes for `--output-prefix prefix`: the tokens' and the loss
    masks' .bin/.idx prefixes (Megatron's indexed format, one document a sequence) and the description."""
    text = f"{prefix}_text_document"
    return text, f"{prefix}_loss_mask_document", text + PREPROCESSED_SUFFIX


def is_preprocessed(path: str) -> bool:
    """`--data-path` names a `<prefix>_text_document` that preprocess_data.py --sft wrote."""
    return os.path.isfile(path + PREPROCESSED_SUFFIX)


def describe_preprocessed(encoder: ChatEncoder, counts: Counts, mask_prefix: str) -> dict:
    return {"format": "hybrid-sft", "version": CACHE_VERSION, "fingerprint": encoder.fingerprint(),
            "pairs": encoder.options.pairs, "train_on_prompt": encoder.options.train_on_prompt,
            "mask": os.path.basename(mask_prefix), "counts": counts.__dict__}


def load_preprocessed(path: str, encoder: ChatEncoder) -> Tokenized:
    """The conversations of `<prefix>_text_document` (tokens) and its loss masks, memory-mapped; refused when
    they were made with another tokenizer, chat template or option than the run's."""
    with open(path + PREPROCESSED_SUFFIX) as f:
        meta = json.load(f)
    made = "launch/preprocess_data.py --sft" + (" --dpo" if meta.get("pairs") else "") + (
        " --sft-train-on-prompt" if meta.get("train_on_prompt") else "")
    if meta.get("pairs") != encoder.options.pairs:
        wanted = "(--dpo) trains on preference pairs" if encoder.options.pairs else "(--sft) trains on conversations"
        raise ConfigError(f"--data-path {path}: made by {made}, which holds "
                          f"{'preference pairs' if meta.get('pairs') else 'conversations'}; this run {wanted}.")
    if meta.get("fingerprint") != encoder.fingerprint():
        raise ConfigError(f"--data-path {path}: made by {made} with another tokenizer, chat template or "
                          f"--sft-train-on-prompt than this run's {encoder.source}; preprocess it again with the "
                          f"run's tokenizer and options.")
    tokens = IndexedDataset(path)
    masks = IndexedDataset(os.path.join(os.path.dirname(path), meta["mask"]))
    if not np.array_equal(tokens.sizes, masks.sizes):
        raise ConfigError(f"--data-path {path}: its loss masks {masks.prefix} do not match its sequences; "
                          f"preprocess it again.")
    offsets = np.concatenate([[0], np.cumsum(tokens.sizes, dtype=np.int64)])
    ids, mask = tokens.flat(), masks.flat().view(bool)
    return Tokenized(ids, mask, offsets, Counts(**meta["counts"]), 2 if encoder.options.pairs else 1)


def load_tokenized(path: str, encoder: ChatEncoder) -> Tokenized:
    """`path`'s conversations: preprocessed files as they are, any other file tokenized here."""
    return load_preprocessed(path, encoder) if is_preprocessed(path) else tokenize_file(path, encoder)


def signature(path: str) -> list:
    """The files' names, sizes and modification times (a directory's every file)."""
    files = [path] if os.path.isfile(path) else sorted(os.path.join(root, name) for root, _, names in os.walk(path)
                                                       for name in names)
    return [(os.path.relpath(f, path), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]


def cached_tokenize(path: str, encoder: ChatEncoder, cache_dir: Optional[str] = None) -> Tokenized:
    """tokenize_file, once: rank 0 tokenizes and writes `<cache>/<name>.<fingerprint>.sft.npz` (beside the file
    or directory, or in --data-cache-path), the other ranks wait and read it; a changed file, tokenizer, template or
    option makes another key."""
    if is_preprocessed(path):  # launch/preprocess_data.py --sft's files: read as they are
        return load_preprocessed(path, encoder)
    key = hashlib.sha256(repr((os.path.abspath(path), signature(path),
                               encoder.fingerprint())).encode()).hexdigest()[:16]
    base = cache_dir or os.path.dirname(os.path.abspath(os.path.normpath(path)))
    cache = os.path.join(base, f"{os.path.basename(os.path.normpath(path))}.{key}.sft.npz")
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0 and not os.path.exists(cache):
        data = tokenize_file(path, encoder)
        os.makedirs(base, exist_ok=True)
        tmp = f"{cache}.{os.getpid()}.tmp.npz"
        np.savez(tmp, ids=data.ids, mask=data.mask, offsets=data.offsets,
                 counts=np.frombuffer(json.dumps(data.counts.__dict__).encode(), dtype=np.uint8))
        os.replace(tmp, cache)
    if dist.is_initialized():
        dist.barrier()
    else:  # before the process group exists (--train-epochs): wait for rank 0's file
        deadline = time.time() + float(os.environ.get("HYBRID_SFT_CACHE_WAIT_S", "3600"))
        while not os.path.exists(cache):
            if time.time() > deadline:
                raise ConfigError(f"--data-path {path}: rank 0 did not write the tokenized cache {cache} in time.")
            time.sleep(0.5)
    with np.load(cache, allow_pickle=False) as f:
        return Tokenized(f["ids"], f["mask"], f["offsets"], Counts(**json.loads(bytes(f["counts"]).decode())),
                         2 if encoder.options.pairs else 1)
