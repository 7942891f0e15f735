"""Datasets for a run and the order in which samples reach each data-parallel rank.

Samples are served as Megatron-LM's MegatronPretrainingSampler serves them: iteration i uses
samples [i x G, (i + 1) x G) of the dataset (G = global batch); micro-step k of it gives DP rank r
samples k x mb x DP + r x mb ... + mb. So the global batch does not depend on the layout, and a
resumed run continues with exactly the next samples (only `consumed_samples` is needed).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from hybrid.data.chat import dataset as chat_dataset, stream as chat_stream
from hybrid.data.chat.template import ChatEncoder
from hybrid.data.default import default_data_prefix
from hybrid.data.gpt_dataset import MockGPTDataset, build_train_valid_test_datasets
from hybrid.errors import ConfigError
from hybrid.parallel.cross_entropy import IGNORE_INDEX


def num_samples(training) -> list[int]:
    """Train, valid and test sample counts, as Megatron-LM computes them (`training`: the run's
    hybrid.config.TrainingConfig)."""
    t = training
    evals = (t.train_iters // t.eval_interval + 1) * t.eval_iters if t.eval_interval else 0
    return [t.train_samples or t.train_iters * t.global_batch_size, evals * t.global_batch_size,
            t.eval_iters * t.global_batch_size]


def build_datasets(data, training, vocab_size: int, tokenizer=None):
    """(train, valid, test) datasets: mock tokens, the given --data-path, the embedded corpus, or with --sft
    conversations through the tokenizer's chat template (`data`, `training`: the run's
    hybrid.config.DataConfig and TrainingConfig)."""
    counts = num_samples(training)
    if data.chat is not None:
        return _chat_datasets(data, training, counts, tokenizer)
    if data.mock_data:
        return [MockGPTDataset(n, training.seq_length, vocab_size, training.seed + i) if n else None
                for i, n in enumerate(counts)]
    data_path = data.data_path
    if not data_path and not any(data.split_data_paths or ()):
        if not dist.is_initialized() or dist.get_rank() == 0:
            default_data_prefix()  # tokenize the embedded corpus once, on rank 0
        if dist.is_initialized():
            dist.barrier()
        data_path = [default_data_prefix()]
    split_paths = None
    if data.split_data_paths and any(data.split_data_paths):
        split_paths = data.split_data_paths
    return build_train_valid_test_datasets(data_path, data.split, counts, training.seq_length, training.seed,
                                           cache_dir=data.data_cache_path, legacy=data.legacy_data_rules,
                                           split_paths=split_paths)


def _chat_datasets(data, training, counts, tokenizer):
    """--sft: each file's conversations split by --split (or each split's own files), blended by weight."""
    encoder = ChatEncoder(tokenizer.to_transformers(), "--tokenizer-model", data.chat)

    def split_datasets(path, ranges_of, wanted, seq_length, seed, cache_dir):
        split = chat_stream.split_datasets if data.chat.stream_buffer else chat_dataset.split_datasets
        return split(path, ranges_of, wanted, seq_length, seed, encoder, cache_dir)
    split_paths = data.split_data_paths if any(data.split_data_paths or ()) else None
    return build_train_valid_test_datasets(data.data_path, data.split, counts, training.seq_length, training.seed,
                                           cache_dir=data.data_cache_path, legacy=data.legacy_data_rules,
                                           split_paths=split_paths, split_datasets=split_datasets)


class MegatronSampler:
    """Index lists of this DP rank's micro-batches, from `consumed_samples` on (wrapping for eval)."""

    def __init__(self, total: int, consumed: int, micro: int, dp_rank: int, dp_size: int, wrap: bool = False):
        self.total, self.consumed, self.micro = total, consumed, micro
        self.dp_rank, self.dp_size, self.wrap = dp_rank, dp_size, wrap

    def __iter__(self):
        step = self.micro * self.dp_size
        start = self.consumed
        while self.wrap or start + step <= self.total:
            first = start + self.dp_rank * self.micro
            yield [(first + j) % self.total for j in range(self.micro)]
            start += step


class Collator:
    """Samples -> (input ids [b, s], labels [b, s]): the one batch encoding of every step.

    Positions that take no loss hold IGNORE_INDEX in the labels: with `eod_mask_loss` (Megatron's
    --eod-mask-loss) those whose input token is EOD, exactly as megatron-core's GPTDataset masks them;
    with chat samples (a "loss_mask" beside the tokens) those whose target token is not the assistant's.
    """

    def __init__(self, eod_token: Optional[int] = None, eod_mask_loss: bool = False):
        if eod_mask_loss and eod_token is None:
            raise ConfigError("--eod-mask-loss needs a tokenizer with an end-of-document token.")
        self.eod_token, self.eod_mask_loss = eod_token, eod_mask_loss

    def __call__(self, samples):
        tokens = torch.stack([s["text"] for s in samples])
        ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        if "loss_mask" in samples[0]:  # chat data (hybrid.data.chat): the tokens that take loss
            labels = labels.masked_fill(~torch.stack([s["loss_mask"] for s in samples])[:, 1:], IGNORE_INDEX)
        if self.eod_mask_loss:
            labels = labels.masked_fill(ids == self.eod_token, IGNORE_INDEX)
        if "reference_logps" in samples[0]:  # --dpo-reference-logps: each document's reference sum, padded to s
            reference = torch.stack([s["reference_logps"] for s in samples])
            return ids, labels, torch.nn.functional.pad(reference, (0, ids.size(1) - reference.size(1)))
        return ids, labels


def to_device(batch, device: torch.device):
    """The one place batches move to the model's device: host tensors (pinned by the loader when
    the device is an accelerator) are copied with non_blocking=True."""
    return tuple(t.to(device, non_blocking=True) for t in batch)


def micro_batches(dataset, consumed: int, micro: int, dp_rank: int, dp_size: int, num_workers: int,
                  device: torch.device, wrap: bool = False, collator: Optional[Collator] = None):
    """An iterator of (ids, labels) micro-batches for this DP rank, on `device`."""
    sampler = MegatronSampler(len(dataset), consumed, micro, dp_rank, dp_size, wrap)
    # The loader gets its own generator: making an iterator draws a base seed from it, which from
    # the global generator would shift every later dropout mask of a resumed run by one draw.
    if any(getattr(part, "streams", False) for part in getattr(dataset, "datasets", [dataset])):
        num_workers = 0  # --sft-streaming: the stream has its own worker process (hybrid.data.chat.stream)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         collate_fn=collator or Collator(), persistent_workers=num_workers > 0,
                                         pin_memory=torch.device(device).type == "cuda",
                                         generator=torch.Generator().manual_seed(consumed))
    return (to_device(batch, device) for batch in loader)
