"""Input embedding (vocab-parallel words + learned positions) and the output head (untied, or the tied table)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.model.init import normal_init, vocab_rows_init
from hybrid.model.per_layer import PerLayerInputs
from hybrid.parallel import mappings as M
from hybrid.parallel.groups import as_groups
from hybrid.parallel.layers import (ColumnParallelLinear, VocabParallelEmbedding, column_parallel_matmul,
                                    local_rows_lookup, make_table_blocks)
from hybrid.parallel.random import fork_tp_rng


def word_init(config):
    return vocab_rows_init(normal_init(config.seed, "embedding.word_embeddings.weight", config.init_method_std),
                           config.vocab_size)


class Embedding(nn.Module):
    """token ids [b, s] -> hidden [s, b, h] (with SP: this rank's sequence shard [s/tp, b, h])."""

    def __init__(self, config, groups):
        super().__init__()
        groups = as_groups(groups)
        self.config, self.groups, self.tp_group = config, groups, groups.tp_group
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size(groups.tp_size), config.hidden_size, groups, word_init(config),
            block_rows=config.vocab_block_rows)
        if config.position_embedding_type == "learned_absolute":
            # initialised before the module exists (ZeRO-3's zero.Init partitions it on construction)
            full = torch.empty(config.max_position_embeddings, config.hidden_size, dtype=torch.float32)
            normal_init(config.seed, "embedding.position_embeddings.weight", config.init_method_std)(full)
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                    _weight=full)
        else:
            self.position_embeddings = None
        # --per-layer-input-size (Gemma 4): the per-layer inputs' table and projection (hybrid.model.per_layer)
        self.per_layer = PerLayerInputs(config, groups) if config.per_layer_input_size else None

    def with_per_layer(self, input_ids, layout=None):
        """(hidden [s(/tp), b, h], per-layer inputs [s(/tp), b, layers, P]) of input_ids [b, s] (this rank's tokens;
        rope models)."""
        ids = input_ids.t()
        embedded = _scaled(self.word_embeddings(ids), self.config)  # [s, b, h], all-reduced over TP
        per_layer = self.per_layer(ids, embedded)
        if self.config.sequence_parallel:
            per_layer = M.scatter_to_sequence_parallel_region(per_layer, self.tp_group)
        return _embedding_out(embedded, self.config, self.tp_group, self.training), per_layer

    def forward(self, input_ids, layout=None):
        """input_ids [b, s] (this rank's tokens) -> hidden [s(/tp), b, h]. `layout`
        (hybrid.model.sequence.SequenceLayout): the tokens' positions within their documents and in the
        whole sequence, where they are not 0 .. s-1."""
        ids = input_ids.t()  # [b, s] -> [s, b]
        hidden = _scaled(self.word_embeddings(ids), self.config)  # [s, b, h], all-reduced over TP
        if self.position_embeddings is not None:
            if layout is not None and layout.positions is not None:
                hidden = hidden + self.position_embeddings(layout.positions)  # [s, b, h]
            else:
                positions = torch.arange(ids.size(0), device=ids.device)
                hidden = hidden + self.position_embeddings(positions).unsqueeze(1)
        return _embedding_out(hidden, self.config, self.tp_group, self.training)


def _scaled(hidden, config):
    """Gemma's word embeddings x sqrt(h), the factor rounded to the embeddings' dtype."""
    if not config.scale_embeddings:
        return hidden
    return hidden * torch.tensor(config.hidden_size ** 0.5, dtype=hidden.dtype, device=hidden.device)


def _embedding_out(hidden, config, tp_group, training: bool):
    """The embedding's output: under SP this rank's sequence shard, then the hidden dropout."""
    p = config.hidden_dropout if training else 0.0
    if config.sequence_parallel:
        hidden = M.scatter_to_sequence_parallel_region(hidden, tp_group)  # -> [s/tp, b, h]
        if p == 0.0:
            return hidden
        with fork_tp_rng():
            return F.dropout(hidden, p)
    return F.dropout(hidden, p) if p > 0.0 else hidden


def embed_with(table, input_ids, config, groups, training: bool):
    """Embedding's word embeddings (rope models: no position table) through `table`, this TP rank's rows of the
    vocabulary (the last stage's copy of the word embeddings: hybrid.model.virtual_stages)."""
    groups = as_groups(groups)
    out = local_rows_lookup(input_ids.t(), table, groups.tp_rank * table.size(0), groups.tp_size == 1)
    hidden = _scaled(M.reduce_from_tp_region(out, groups.tp_group), config)
    return _embedding_out(hidden, config, groups.tp_group, training)


def parallel_logits(hidden, weight, groups, sequence_parallel: bool, vocab_size=None, overlap: bool = True):
    """hidden [s(/tp), b, h] x weight [V/tp, h] -> logits [s, b, V/tp] (the vocab stays split).

    With `vocab_size` at TP = 1 (logits that only feed the loss) the padding rows of the table
    are left out: logits [s, b, vocab_size], so the loss runs on whole-vocabulary logits with no
    masking (padding rows get no gradient either way).
    """
    groups = as_groups(groups)
    if vocab_size is not None and groups.tp_size == 1:  # the whole table, the logits cut (see OutputHead.loss_logits)
        return F.linear(hidden, weight)[..., :vocab_size].contiguous()
    return column_parallel_matmul(hidden, weight, None, groups, sequence_parallel, overlap)


def output_head(config, groups):
    """The untied output projection: OutputHead, or BlockedOutputHead in row blocks (ZeRO-3's vocab_block_rows)."""
    groups = as_groups(groups)
    if config.vocab_blocked(groups.tp_size):
        return BlockedOutputHead(config, groups)
    return OutputHead(config, groups)


def _head_init(config):
    return vocab_rows_init(normal_init(config.seed, "output_layer.weight", config.init_method_std), config.vocab_size)


class OutputHead(ColumnParallelLinear):
    """Untied output projection (Llama style: --untie-embeddings-and-output-weights): logits stay
    split over the vocabulary, [s(/tp), b, h] -> [s, b, V/tp]."""

    def __init__(self, config, groups):
        groups = as_groups(groups)
        super().__init__(config.hidden_size, config.padded_vocab_size(groups.tp_size), groups,
                         _head_init(config), bias=False,
                         sequence_parallel=config.sequence_parallel,
                         overlap=config.async_tensor_model_parallel_allreduce)
        self.weight.vocab_padded = True  # rows are the (padded) vocabulary, as the embedding's
        self.vocab_size = config.vocab_size

    def loss_logits(self, hidden):
        """Logits that only feed the loss (no padding columns at TP = 1; see parallel_logits). Through the module's
        call and over the whole table, the padding columns cut from the logits: a multiplication by a slice of the
        table would keep ZeRO-3's gathered table alive after its release (the slice is what backward saves) and
        give the table's gradient a second full-size tensor."""
        if self.groups.tp_size == 1:
            return self(hidden)[..., :self.vocab_size].contiguous()
        return self(hidden)


class BlockedOutputHead(nn.Module):
    """OutputHead with this TP rank's rows as TableBlocks (`blocks.{i}.weight`; ZeRO-3: ModelConfig.vocab_block_rows):
    the input gathered (SP) or entered into the TP region once, each block's logits through its own module
    (its weight gathered for it alone), concatenated: [s(/tp), b, h] -> [s, b, V/tp], the values of one matmul
    (each logit is one row's dot product)."""

    def __init__(self, config, groups):
        super().__init__()
        self.groups = groups = as_groups(groups)
        self.sequence_parallel, self.vocab_size = config.sequence_parallel, config.vocab_size
        self.blocks = make_table_blocks((config.padded_vocab_size(groups.tp_size), config.hidden_size),
                                        config.vocab_block_rows, groups, _head_init(config), torch.float32, None)

    def forward(self, hidden):
        if self.sequence_parallel:
            hidden = M.gather_from_sequence_parallel_region(hidden, self.groups.tp_group)  # [s/tp, b, h] -> [s, b, h]
        else:
            hidden = M.copy_to_tp_region(hidden, self.groups.tp_group)
        return torch.cat([block(hidden, lookup=False) for block in self.blocks], dim=-1)

    def loss_logits(self, hidden):
        """As OutputHead.loss_logits: no padding columns at TP = 1."""
        if self.groups.tp_size == 1:
            return self(hidden)[..., :self.vocab_size].contiguous()
        return self(hidden)
