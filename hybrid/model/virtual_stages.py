"""The one form of the model: the parameters one pipeline rank holds (`RankModel`) and its virtual stages, run by
every schedule of hybrid.training.runtime (PP = 1 is one stage holding everything: hybrid.model.gpt.GPTModel).

The stage plan (which layers, which rank, loop or V placement) is hybrid.pipeline_plan's. A rank's parameters
live under their canonical names (`embedding.*`, `layers.{i}.*`, `final_norm.*`, `output_layer.weight`), so
checkpoints, conversion and the optimizer's parameter names are the same at every layout; the stages are views
onto its submodules.

A tied embedding with the loop placement (the first and last stages on different ranks) is one parameter, the
first stage's; the last stage reads a copy of it, `tied_table`, a plain tensor the runtime keeps equal to the
parameter and whose gradient it adds to the parameter's (hybrid.training.runtime.TiedTable), so the table has
one gradient and one optimizer state. With the V placement rank 0 holds both ends: one parameter used twice.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig
from hybrid.model.embedding import Embedding, embed_with, output_head, parallel_logits, word_init
from hybrid.model.mtp import MTPLayer, shifted
from hybrid.model import lora
from hybrid.model.naming import mtp_prefix
from hybrid.model.norms import build_norm
from hybrid.model.recompute import checkpoint, full_recompute, run_layers
from hybrid.model.moe.moe_layer import MoELayer
from hybrid.model.sequence import sequence_layout, stage_layout_of, with_routes
from hybrid.model.transformer import TransformerLayer
from hybrid.parallel.groups import as_groups
from hybrid.pipeline_plan import StagePlan


class Layers(nn.ModuleDict):
    """A rank's transformer layers under their global index (parameter names `layers.{i}.*` at every layout):
    `layers[i]` by that index, iteration over the layers in order (as a ModuleList of all of them would)."""

    def __getitem__(self, index) -> nn.Module:
        return super().__getitem__(str(index))

    def __iter__(self):
        return iter(self._modules.values())


class RankModel(nn.Module):
    """Every parameter one pipeline rank holds, under canonical names, and its virtual stages.

    `forward(hidden, stage, batch_ids)` runs virtual stage `stage` (its index among this rank's stages): the
    first stage takes the micro-batch's whole-sequence ids [b, s], the others the previous stage's hidden
    states; the last returns the logits that feed the loss, [s(/cp), b, V/tp]. `batch_ids`: the whole-sequence
    ids, given to every stage when sequences are packed documents (each stage finds the documents itself)."""

    def __init__(self, config: ModelConfig, groups, plans: list[StagePlan], pp_rank: int = 0):
        super().__init__()
        self.groups = groups = as_groups(groups)
        config.validate(groups.tp_size)
        self.config = config
        self.all_plans = list(plans)  # every rank's stages (where each one runs)
        self.plans = [p for p in plans if p.rank == pp_rank]
        holds_first = any(p.first for p in self.plans)
        holds_last = any(p.last for p in self.plans)
        self.embedding = Embedding(config, groups) if holds_first else None
        self.layers = Layers({str(i): TransformerLayer(config, groups, i) for p in self.plans for i in p.layers})
        if config.lora_rank:  # low-rank adapters beside the layers' linears (--lora-rank)
            lora.attach({int(i): layer for i, layer in self.layers.items()}, config, groups)
        self.final_norm = build_norm(config, groups) if holds_last else None
        self.output_layer = output_head(config, groups) if holds_last and not config.tied_embeddings else None
        # multi-token prediction's layers (hybrid.model.mtp), on the last stage, named mtp.{depth}.*
        self.mtp = nn.ModuleList(MTPLayer(config, groups, i, mtp_prefix(config, i)) for i in config.mtp_layers) \
            if holds_last and config.mtp_num_layers else None
        # the last stage's copy of the word embeddings held by another rank, for a tied head or multi-token
        # prediction (see the module docstring): not a parameter, so neither DeepSpeed nor a checkpoint sees it
        self.tied_table: Optional[torch.Tensor] = None
        if holds_last and _last_stage_reads_table(config) and not holds_first:
            self.tied_table = _tied_table(config, groups)
        # plain list: the stages are views, not a second registration of the same parameters
        self.stages = [VirtualStage(self, plan) for plan in self.plans]
        _link_index_sharing(self, config)
        _link_kv_sharing(self, config)
        # each MoE layer's slot in --grpo's routing record of this rank's layers (SequenceLayout.routes)
        moe = [layer.mlp for _, layer in sorted(self.layers.items(), key=lambda item: int(item[0]))
               if isinstance(layer.mlp, MoELayer)]
        for slot, mlp in enumerate(moe):
            mlp.replay_slot = slot
        self.moe_slots = len(moe)

    @property
    def holds_tied_copy(self) -> bool:
        """This rank reads a tied table that another rank's first stage holds (loop placement)."""
        return self.tied_table is not None

    @property
    def holds_tied_parameter(self) -> bool:
        """This rank holds the word embeddings whose copy another rank's last stage reads."""
        return _last_stage_reads_table(self.config) and self.embedding is not None and self.final_norm is None

    def embed_table(self, ids, layout=None):
        """The word embeddings of `ids` [b, s] (this rank's tokens) on the last stage, from the table or its copy."""
        if self.embedding is not None:
            return self.embedding(ids, layout)
        return embed_with(self.tied_table, ids, self.config, self.groups, self.training)

    def forward(self, hidden, stage: int = 0, batch_ids=None, decode=None, routes=None, record_routes=False):
        """`decode` (hybrid.model.kv_cache.DecodeLayout): a decoding step of stage `stage` (VirtualStage.decode),
        through this module's call so that ZeRO-3's hooks fetch what the step reads, as in training. `routes`
        [b, s, moe_slots, k]: --grpo's recorded routing of the micro-batch (hybrid.model.sequence.SequenceLayout), to
        replay, or with `record_routes` to write this forward's own."""
        if decode is not None:
            return self.stages[stage].decode(hidden, decode)
        return self.stages[stage](hidden, batch_ids, routes=routes, record_routes=record_routes)

    def head_weight(self):
        """The table the output head multiplies by: the untied head's, the tied parameter, or its copy."""
        if self.output_layer is not None:
            return self.output_layer.weight
        return self.tied_table if self.tied_table is not None else self.embedding.word_embeddings.weight

    def logits(self, hidden, for_loss: bool = True):
        """final-normed hidden -> logits split over the vocabulary over TP, [s, b, V/tp]; `for_loss` leaves out
        the vocabulary's padding rows at TP = 1 (see parallel_logits)."""
        if self.output_layer is not None:
            logits = self.output_layer.loss_logits(hidden) if for_loss else self.output_layer(hidden)
        else:
            logits = parallel_logits(hidden, self.head_weight(), self.groups, self.config.sequence_parallel,
                                     self.config.vocab_size if for_loss else None,
                                     self.config.async_tensor_model_parallel_allreduce)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap  # (transformers' order of operations)


def _link_readers(model: RankModel, num_layers: int, source_of, link: str, count: str, refusal) -> None:
    """Link each layer whose attention reads what an earlier layer's computed in the same pass (`source_of(i)`: that
    layer, or None) to the source's attention as `link` (not a child module: its parameters are the source's), count
    its readers in the source's `count`, and mark the last reader of each source (it releases what it read). The
    source must run in the same virtual stage (one message otherwise, `refusal(reader, source, stage layers)`)."""
    for plan in model.plans:
        for i in plan.layers:
            source = source_of(i)
            if source is None:
                continue
            if source not in plan.layers:
                raise ConfigError(refusal(i, source, list(plan.layers)))
            reader, source_attention = model.layers[str(i)].attention, model.layers[str(source)].attention
            object.__setattr__(reader, link, source_attention)
            setattr(source_attention, count, getattr(source_attention, count) + 1)
            reader.last_reader = all(source_of(j) != source for j in range(i + 1, num_layers))


def _link_index_sharing(model: RankModel, config: ModelConfig) -> None:
    """GLM-5's DSA index sharing: each sharing layer's attention reads its source layer's choice in the same pass."""
    _link_readers(model, config.num_layers, config.dsa_source, "index_source", "index_readers",
                  lambda i, source, layers: (
        f"layer {i} reuses the keys layer {source}'s DSA indexer chose (the model's index sharing), and the pipeline "
        f"puts them in different stages ({layers} here); choose --pipeline-partition / "
        f"--num-virtual-stages-per-pipeline-rank so that each sharing layer sits with the layer before it that runs an "
        f"indexer."))


def _link_kv_sharing(model: RankModel, config: ModelConfig) -> None:
    """Gemma 4's KV sharing (--num-kv-shared-layers): each sharing layer's attention reads the keys and values its
    source layer computed in the same pass."""
    _link_readers(model, config.num_layers, config.kv_source, "kv_source", "kv_readers",
                  lambda i, source, layers: (
        f"layer {i} attends with the keys and values layer {source} computes (the model's --num-kv-shared-layers "
        f"{config.kv_shared_layers}), and the pipeline puts them in different stages ({layers} here); a pipeline would "
        f"send them between stages, which is not built: use --pipeline-model-parallel-size 1."))


def _last_stage_reads_table(config: ModelConfig) -> bool:
    """The last stage reads the word embeddings: a tied head, or multi-token prediction's embeddings."""
    return config.tied_embeddings or bool(config.mtp_num_layers)


def _tied_table(config: ModelConfig, groups) -> torch.Tensor:
    """This TP rank's rows of the word embeddings, initialised as the embedding initialises them (the runtime
    copies the parameter over it before it is used)."""
    rows = config.padded_vocab_size(groups.tp_size) // groups.tp_size
    full = torch.empty(config.padded_vocab_size(groups.tp_size), config.hidden_size)
    word_init(config)(full)
    return full[groups.tp_rank * rows:(groups.tp_rank + 1) * rows].clone()


class VirtualStage(nn.Module):
    """One virtual stage: the first takes whole-sequence ids and embeds this rank's part of them; the last
    ends in the final norm and the logits. Its children are the owner's modules it runs, so `parameters()`
    are this stage's (what a zero-bubble schedule's weight-gradient step differentiates); the owner is not
    a child of it, nor it of the owner."""

    def __init__(self, owner: RankModel, plan: StagePlan):
        super().__init__()
        self.plan = plan
        self.first, self.last = plan.first, plan.last
        object.__setattr__(self, "_owner", owner)
        self.embedding = owner.embedding if plan.first else None
        self.layers = nn.ModuleList(owner.layers[str(i)] for i in plan.layers)
        self.final_norm = owner.final_norm if plan.last else None
        # the head's table: the untied head, or (V placement) the embedding used a second time
        self.head = (owner.output_layer if owner.output_layer is not None else owner.embedding) if plan.last else None


    def decode(self, inputs, layout):
        """A decoding step over the new positions only: ids [b, s] (first stage) or hidden [s, b, h] in; hidden
        out, or at the last stage the newest position's logits [1, b, V/tp] (hybrid.model.generate)."""
        owner = self._owner
        per_layer = None
        if self.first and owner.config.per_layer_input_size:
            hidden, per_layer = owner.embedding.with_per_layer(inputs, layout)
        else:
            hidden = owner.embedding(inputs, layout) if self.first else inputs
        for layer in self.layers:
            hidden = layer(hidden, layout, per_layer)
        if self.last:
            return owner.logits(owner.final_norm(hidden[-1:]), for_loss=False)
        return hidden

    def forward(self, hidden, batch_ids=None, for_loss: bool = True, routes=None, record_routes=False):
        owner = self._owner
        ids = hidden if self.first else batch_ids  # whole-sequence ids, where this stage has them
        per_layer = None  # Gemma 4's per-layer inputs (hybrid.model.per_layer)
        if self.first:
            layout = sequence_layout(hidden, owner.config, owner.groups)
            local = hidden if layout is None else layout.local(hidden)
            if owner.config.per_layer_input_size:
                hidden, per_layer = owner.embedding.with_per_layer(local, layout)
            else:
                hidden = owner.embedding(local, layout)
        else:
            layout = stage_layout_of(hidden, batch_ids, owner.config, owner.groups)
        layout = with_routes(layout, routes, record_routes)
        hidden = run_layers(list(self.layers), hidden, owner.config, owner.training, layout, per_layer)
        if self.last:
            hidden = owner.final_norm(hidden)
            logits = owner.logits(hidden, for_loss)
            if owner.mtp is not None and owner.training and torch.is_grad_enabled() and ids is not None:
                # each depth's logits after the decoder's, along the sequence (the objective splits them)
                depths = [logits]
                for k, layer in enumerate(owner.mtp, start=1):
                    ahead = shifted(ids, k, 0)
                    embedded = owner.embed_table(ahead if layout is None else layout.local(ahead), layout)
                    if full_recompute(owner.config, owner.training):  # each depth a unit, as megatron-core's
                        hidden = checkpoint(layer, hidden, embedded, layout)
                    else:
                        hidden = layer(hidden, embedded, layout)
                    depths.append(owner.logits(hidden, for_loss))
                logits = torch.cat(depths, dim=0)
            return logits
        return hidden
