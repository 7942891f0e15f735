"""Datasets for a run and the order in which samples reach each data-parallel rank.

Samples are served as Megatron-LM's MegatronPretrainingSampler serves them: iteration i uses
samples [i x G, (i + 1) x G) of the dataset (G = global batch); micro-step k of it gives DP rank r
samples k x mb x DP + r x mb ... + mb. So the global batch does not depend on the layout, and a
resumed run continues with exactly the next samples (only `consumed_samples` is needed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid.data.gpt_dataset import MockGPTDataset, build_train_valid_test_datasets


def num_samples(train) -> list[int]:
    """Train, valid and test sample counts, as Megatron-LM computes them."""
    evals = (train.train_iters // train.eval_interval + 1) * train.eval_iters if train.eval_interval else 0
    return [train.train_iters * train.global_batch_size, evals * train.global_batch_size,
            train.eval_iters * train.global_batch_size]


def build_datasets(train, vocab_size: int):
    """(train, valid, test) datasets: mock tokens, the given --data-path, or the embedded corpus."""
    counts = num_samples(train)
    if train.mock_data:
        return [MockGPTDataset(n, train.seq_length, vocab_size, train.seed + i) if n else None
                for i, n in enumerate(counts)]
    data_path = train.data_path
    if not data_path:
        from hybrid.data.default import default_data_prefix
        if not dist.is_initialized() or dist.get_rank() == 0:
            default_data_prefix()  # tokenize the embedded corpus once, on rank 0
        if dist.is_initialized():
            dist.barrier()
        data_path = [default_data_prefix()]
    return build_train_valid_test_datasets(data_path, train.split, counts, train.seq_length, train.seed)


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


def collate(samples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> input ids [b, s], labels [b, s] (next tokens), loss mask [b, s]."""
    tokens = torch.stack([s["text"] for s in samples])
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), torch.ones(tokens.size(0), tokens.size(1) - 1)


def micro_batches(dataset, consumed: int, micro: int, dp_rank: int, dp_size: int, num_workers: int,
                  wrap: bool = False):
    """An iterator of (ids, labels, loss_mask) micro-batches for this DP rank."""
    sampler = MegatronSampler(len(dataset), consumed, micro, dp_rank, dp_size, wrap)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         collate_fn=collate, persistent_workers=num_workers > 0)
    return iter(loader)
