"""The packed windows as datasets: a split's windows of tokens and loss masks, the training split (shuffled by the
seed, reshuffled each epoch) and the evaluation windows."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from hybrid.data.chat.cache import cached_tokenize, load_tokenized
from hybrid.data.chat.options import Counts
from hybrid.data.chat.packing import pack, truncation_rule
from hybrid.data.chat.template import ChatEncoder
from hybrid.data.gpt_dataset import parse_data_path, split_ranges
from hybrid.distributed import log
from hybrid.errors import ConfigError


class ChatDataset(torch.utils.data.Dataset):
    """Packed windows served `num_samples` times in all: epoch e is every window once, in an order drawn from
    the seed and e (so a run resumed at `consumed_samples` continues at exactly the next window)."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, num_samples: int, seed: int, shuffle: bool = True):
        self.tokens, self.mask, self.num_samples, self.seed, self.shuffle = tokens, mask, num_samples, seed, shuffle
        self._orders = {}
        self.reference_logps: Optional[np.ndarray] = None  # --dpo-reference-logps: [windows, documents] sums

    @property
    def windows(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return self.num_samples

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.RandomState(self.seed + 1 + epoch).permutation(self.windows)
                            if self.shuffle else np.arange(self.windows)}
        return self._orders[epoch]

    def __getitem__(self, index: int) -> dict:
        epoch, k = divmod(int(index), self.windows)
        w = self._order(epoch)[k]
        sample = {"text": torch.from_numpy(self.tokens[w].astype(np.int64)),
                  "loss_mask": torch.from_numpy(self.mask[w])}
        if self.reference_logps is not None:
            sample["reference_logps"] = torch.from_numpy(self.reference_logps[w])
        return sample


def split_datasets(path: str, ranges_of, num_samples, seq_length: int, seed: int, encoder: ChatEncoder,
                   cache_dir: Optional[str] = None) -> list[Optional[ChatDataset]]:
    """One ChatDataset per split of one file (conversation ranges from `ranges_of(n)`, as --split divides
    documents); each split's conversations shuffled by the seed, then packed. None where a split is empty."""
    data = cached_tokenize(path, encoder, cache_dir)
    out, counts = [], Counts(conversations=len(data), skipped_bad=data.counts.skipped_bad)
    for name, (start, stop), wanted in zip(("train", "valid", "test"), ranges_of(len(data)), num_samples):
        if stop <= start or wanted <= 0:
            out.append(None)
            continue
        order = start + np.random.RandomState(seed).permutation(stop - start)
        split_counts = Counts()
        tokens, mask = pack(data, order, seq_length + 1, encoder.separator, encoder.options, split_counts)
        counts.merge(Counts(truncated=split_counts.truncated, dropped=split_counts.dropped))
        if len(tokens) == 0:
            raise ConfigError(f"--data-path {path}: the {name} split has no conversation left after "
                              f"{truncation_rule(encoder.options, seq_length + 1)} at --seq-length {seq_length}.")
        fill = float((tokens != encoder.separator).mean())
        log(f"sft: {path} {name}: {stop - start} conversations -> {len(tokens)} windows of {seq_length + 1} tokens "
            f"({fill:.0%} filled, {split_counts.loss_tokens} loss tokens)")
        out.append(ChatDataset(tokens, mask, wanted, seed))
    log(f"sft: {path}: {counts.conversations} conversations, {counts.skipped_bad} bad rows skipped, "
        f"{counts.truncated} truncated, {counts.dropped} dropped ({truncation_rule(encoder.options, seq_length + 1)})")
    return out


def train_windows(data_config, seq_length: int, seed: int, encoder: ChatEncoder) -> int:
    """How many packed windows one epoch of the training conversations is (for --train-epochs): the train
    split of --data-path (one file) or all of --train-data-path, packed exactly as split_datasets packs it."""
    own = (data_config.split_data_paths or (None,))[0]
    paths, weights = parse_data_path(own or data_config.data_path, "--train-data-path" if own else "--data-path")
    if weights is not None and len(paths) > 1:
        raise ConfigError("--train-epochs counts the passes over one file's conversations; with a weighted blend "
                          "of several give --train-iters or --train-samples.")
    data = cached_tokenize(paths[0], encoder, data_config.data_cache_path)
    start, stop = ((0, len(data)) if own
                   else split_ranges(data_config.split, len(data), data_config.legacy_data_rules)[0])
    order = start + np.random.RandomState(seed).permutation(stop - start)
    tokens, _ = pack(data, order, seq_length + 1, encoder.separator, encoder.options, Counts())
    return len(tokens)


def evaluation_windows(path: str, seq_length: int, encoder: ChatEncoder) -> tuple[np.ndarray, np.ndarray, Counts]:
    """Every conversation of `path` once, in file order, packed (launch/evaluate.py --sft)."""
    data = load_tokenized(path, encoder)
    counts = Counts(conversations=len(data), skipped_bad=data.counts.skipped_bad)
    tokens, mask = pack(data, range(len(data)), seq_length + 1, encoder.separator, encoder.options, counts)
    return tokens, mask, counts
