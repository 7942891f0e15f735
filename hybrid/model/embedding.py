"""Input embedding (vocab-parallel words + learned positions) and the output head and LM loss."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.model.init import normal_init, vocab_rows_init
from hybrid.parallel import mappings as M
from hybrid.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from hybrid.parallel.groups import as_groups
from hybrid.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding, column_parallel_matmul
from hybrid.parallel.random import fork_tp_rng


def _word_init(config):
    return vocab_rows_init(normal_init(config.seed, "embedding.word_embeddings.weight", config.init_method_std),
                           config.vocab_size)


class Embedding(nn.Module):
    """token ids [b, s] -> hidden [s, b, h] (with SP: this rank's sequence shard [s/tp, b, h])."""

    def __init__(self, config, groups):
        super().__init__()
        groups = as_groups(groups)
        self.config, self.groups, self.tp_group = config, groups, groups.tp_group
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size(groups.tp_size), config.hidden_size, groups, _word_init(config))
        if config.position_embedding_type == "learned_absolute":
            # initialised before the module exists (ZeRO-3's zero.Init partitions it on construction)
            full = torch.empty(config.max_position_embeddings, config.hidden_size, dtype=torch.float32)
            normal_init(config.seed, "embedding.position_embeddings.weight", config.init_method_std)(full)
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                    _weight=full)
        else:
            self.position_embeddings = None

    def forward(self, input_ids, layout=None):
        """`layout` (hybrid.model.sequence.SequenceLayout): the tokens' positions within their documents
        (GPTModel passes this rank's ids and their layout). A pipeline's first stage gets whole sequences
        and takes its part itself; with packed documents it also hands the whole ids to the next stages,
        (hidden, ids), so each stage finds the documents (hybrid.model.sequence)."""
        if layout is None and (self.groups.sequence_split > 1 or self.config.splits_documents):
            from hybrid.model.sequence import sequence_layout
            layout = sequence_layout(input_ids, self.config, self.groups)
            hidden = self._embed(layout.local(input_ids), layout)
            return (hidden, input_ids) if self.config.splits_documents else hidden
        return self._embed(input_ids, layout)

    def _embed(self, input_ids, layout):
        ids = input_ids.t()  # [b, s] -> [s, b]
        hidden = self.word_embeddings(ids)  # [s, b, h], all-reduced over TP
        if self.config.scale_embeddings:  # Gemma: x sqrt(h), the factor rounded to the embeddings' dtype
            hidden = hidden * torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden.dtype, device=hidden.device)
        if self.position_embeddings is not None:
            if layout is not None and layout.positions is not None:
                hidden = hidden + self.position_embeddings(layout.positions)  # [s, b, h]
            else:
                positions = torch.arange(ids.size(0), device=ids.device)
                hidden = hidden + self.position_embeddings(positions).unsqueeze(1)
        p = self.config.hidden_dropout if self.training else 0.0
        if self.config.sequence_parallel:
            hidden = M.scatter_to_sequence_parallel_region(hidden, self.tp_group)  # -> [s/tp, b, h]
            if p == 0.0:
                return hidden
            with fork_tp_rng():
                return F.dropout(hidden, p)
        return F.dropout(hidden, p) if p > 0.0 else hidden


def parallel_logits(hidden, weight, groups, sequence_parallel: bool, vocab_size=None, overlap: bool = True):
    """hidden [s(/tp), b, h] x weight [V/tp, h] -> logits [s, b, V/tp] (the vocab stays split).

    With `vocab_size` at TP = 1 (logits that only feed the loss) the padding rows of the table
    are left out: logits [s, b, vocab_size], so the loss runs on whole-vocabulary logits with no
    masking (padding rows get no gradient either way).
    """
    groups = as_groups(groups)
    if vocab_size is not None and groups.tp_size == 1:
        return F.linear(hidden, weight[:vocab_size])
    return column_parallel_matmul(hidden, weight, None, groups, sequence_parallel, overlap)


class OutputHead(ColumnParallelLinear):
    """Untied output projection (Llama style: --untie-embeddings-and-output-weights): logits stay
    split over the vocabulary, [s(/tp), b, h] -> [s, b, V/tp]."""

    def __init__(self, config, groups):
        groups = as_groups(groups)
        super().__init__(config.hidden_size, config.padded_vocab_size(groups.tp_size), groups,
                         vocab_rows_init(normal_init(config.seed, "output_layer.weight", config.init_method_std),
                                         config.vocab_size), bias=False,
                         sequence_parallel=config.sequence_parallel,
                         overlap=config.async_tensor_model_parallel_allreduce)
        self.weight.vocab_padded = True  # rows are the (padded) vocabulary, as the embedding's
        self.vocab_size = config.vocab_size

    def loss_logits(self, hidden):
        """Logits that only feed the loss (no padding columns at TP = 1; see parallel_logits)."""
        if self.groups.tp_size == 1:
            return F.linear(hidden, self.weight[:self.vocab_size])
        return self(hidden)


class TiedOutputEmbedding(nn.Module):
    """The last pipeline stage's copy of the word embeddings, used as the output head.

    DeepSpeed's TiedLayerSpec keeps it equal to stage 0's table and sums their gradients.
    """

    def __init__(self, config, groups):
        super().__init__()
        self.config, self.groups = config, as_groups(groups)
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size(self.groups.tp_size), config.hidden_size, self.groups, _word_init(config))

    def forward(self, hidden):  # feeds the pipeline's loss_fn only
        return parallel_logits(hidden, self.word_embeddings.weight, self.groups, self.config.sequence_parallel,
                               self.config.vocab_size, self.config.async_tensor_model_parallel_allreduce)


class LMLoss:
    """Next-token loss of one micro-batch from TP-split logits [s, b, V/tp] and labels [b, s], in which
    positions that take no loss hold IGNORE_INDEX: the sum over valid tokens / their count (the mean
    over the micro-batch's valid tokens). Every step (plain engine, DeepSpeed's pipeline as its
    loss_fn, the torch schedules) calls it with the same two arguments."""

    def __init__(self, groups, vocab_size: int):
        self.groups, self.vocab_size = as_groups(groups), vocab_size
        self.token_scale = None  # --calculate-per-token-loss: set per iteration (hybrid.training.steps)
        self.__name__ = "LMLoss"

    def __call__(self, logits, labels, valid=None):
        """`valid`: with context parallelism (or Ulysses) the valid tokens of the whole sequences (this
        rank holds 1/CP of them, and DeepSpeed averages gradients over DP x CP, hence the factor CP).
        A pipeline's last stage passes whole-sequence labels and no count: this rank's part is taken here."""
        if valid is None and self.groups.sequence_split > 1 and labels.size(1) != logits.size(0):
            from hybrid.model.sequence import local_index
            valid = (labels != IGNORE_INDEX).sum()
            labels = labels.index_select(1, local_index(labels.size(1), self.groups, labels.device))
        labels = labels.t()  # [b, s] -> [s, b], as the logits
        per_token = vocab_parallel_cross_entropy(logits, labels, self.groups.tp_group, vocab_size=self.vocab_size)
        if self.token_scale is not None:  # the token sum, scaled to the iteration's token count
            return per_token.sum() * self.token_scale
        if valid is None:
            valid = (labels != IGNORE_INDEX).sum()  # on the device: no host sync
        return per_token.sum() * self.groups.sequence_split / valid.clamp(min=1)
