"""The decoder-only language model: one nn.Module (PP = 1) or DeepSpeed pipeline stages (PP > 1).

Canonical parameter names (shared by both forms, conversion and checkpoints):
  embedding.word_embeddings.weight, embedding.position_embeddings.weight,
  layers.{i}.{input_norm,post_attention_norm}.{weight,bias}, layers.{i}.attention.{qkv,dense}.{weight,bias},
  layers.{i}.mlp.{fc1,fc2}.{weight,bias}, final_norm.{weight,bias}, output_layer.weight (untied only).
"""

from __future__ import annotations


import torch
import torch.nn as nn
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig
from hybrid.model.embedding import Embedding, LMLoss, OutputHead, TiedOutputEmbedding, parallel_logits
from hybrid.model.norms import build_norm
from hybrid.model.transformer import TransformerLayer
from hybrid.parallel import collectives as C


def _checkpoint(fn, *args):
    import deepspeed
    return deepspeed.checkpointing.checkpoint(fn, *args)


class _LayerChunk:
    """Runs consecutive layers; the unit that full recompute checkpoints."""

    def __init__(self, layers):
        self.layers = layers

    def __call__(self, hidden):
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


def run_layers(layers, hidden, config: ModelConfig, training: bool):
    """Apply `layers`, with full activation recompute as `--recompute-*` asks (Megatron-LM):
    uniform: chunks of `recompute_num_layers` layers are recomputed as units;
    block: the first `recompute_num_layers` layers are recomputed, the rest are not."""
    if config.recompute_granularity != "full" or not (training and torch.is_grad_enabled()):
        return _LayerChunk(layers)(hidden)
    n = max(1, config.recompute_num_layers)
    if config.recompute_method == "uniform":
        for start in range(0, len(layers), n):
            hidden = _checkpoint(_LayerChunk(layers[start:start + n]), hidden)
        return hidden
    for index, layer in enumerate(layers):
        hidden = _checkpoint(layer, hidden) if index < n else layer(hidden)
    return hidden


class GPTModel(nn.Module):
    """The whole model on every rank of a TP group (PP = 1), so ZeRO-3 can partition it."""

    def __init__(self, config: ModelConfig, tp_group=None):
        super().__init__()
        config.validate(C.group_size(tp_group))
        self.config, self.tp_group = config, tp_group
        self.embedding = Embedding(config, tp_group)
        self.layers = nn.ModuleList(TransformerLayer(config, tp_group, i) for i in range(config.num_layers))
        self.final_norm = build_norm(config, tp_group)
        self.output_layer = OutputHead(config, tp_group) if config.untie_embeddings_and_output_weights else None
        self.loss_fn = LMLoss(tp_group, config.vocab_size)

    def forward(self, input_ids, labels=None, loss_mask=None):
        """input_ids [b, s] -> logits [b, s, V_padded/tp]; or, with labels [b, s], the mean LM loss."""
        hidden = self.embedding(input_ids)  # [s(/tp), b, h]
        hidden = run_layers(list(self.layers), hidden, self.config, self.training)
        hidden = self.final_norm(hidden)
        for_loss = labels is not None
        if self.output_layer is not None:
            logits = self.output_layer.loss_logits(hidden) if for_loss else self.output_layer(hidden)
        else:
            logits = parallel_logits(hidden, self.embedding.word_embeddings.weight, self.tp_group,
                                     self.config.sequence_parallel,
                                     self.config.vocab_size if for_loss else None)  # [s, b, V/tp]
        if not for_loss:
            return logits.transpose(0, 1)
        return self.loss_fn(logits, (labels, loss_mask))


class HybridPipelineModule(PipelineModule):
    """DeepSpeed's PipelineModule plus an explicit partition: `partition_method="list:3,5"`
    gives 3 transformer layers to stage 0 and 5 to stage 1 (embedding with the first stage,
    final norm and head with the last)."""

    def _partition_layers(self, method="uniform"):
        if not method.lower().startswith("list:"):
            return super()._partition_layers(method)
        counts = [int(x) for x in method.split(":", 1)[1].split(",")]
        bounds = [0]
        for count in counts:
            bounds.append(bounds[-1] + count + (1 if len(bounds) == 1 else 0))
        bounds[-1] = len(self._layer_specs)
        self.parts = bounds
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])


def _resolve_partition(method: str, num_layers: int, pp: int) -> str:
    if method in ("parameters", "uniform"):
        return method if method == "parameters" else "type:TransformerLayer"
    if method.startswith("type:"):
        return method
    counts = [int(x) for x in method.replace("list:", "").split(",")]
    if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
        raise ConfigError(f"--pipeline-partition {method!r}: expected {pp} positive layer counts "
                          f"summing to --num-layers {num_layers}, e.g. "
                          f"{','.join([str(num_layers // pp)] * pp)}.")
    return "list:" + ",".join(map(str, counts))


class FinalNormStage(nn.Module):
    """The final norm as a pipeline layer; named `final_norm` like GPTModel's."""

    def __init__(self, config: ModelConfig, tp_group):
        super().__init__()
        self.final_norm = build_norm(config, tp_group)

    def forward(self, hidden):
        return self.final_norm(hidden)


class OutputHeadStage(nn.Module):
    """The untied output head as a pipeline layer; named `output_layer` like GPTModel's."""

    def __init__(self, config: ModelConfig, tp_group):
        super().__init__()
        self.output_layer = OutputHead(config, tp_group)

    def forward(self, hidden):  # feeds the pipeline's loss_fn only
        return self.output_layer.loss_logits(hidden)


def pipeline_layers(config: ModelConfig, tp_group) -> list:
    """LayerSpecs: embedding, transformer layers, final norm, output head (tied via TiedLayerSpec)."""
    specs = []
    if config.tied_embeddings:
        specs.append(TiedLayerSpec("embed", Embedding, config, tp_group, tied_weight_attr="word_embeddings.weight"))
    else:
        specs.append(LayerSpec(Embedding, config, tp_group))
    specs += [LayerSpec(TransformerLayer, config, tp_group, i) for i in range(config.num_layers)]
    specs.append(LayerSpec(FinalNormStage, config, tp_group))
    if config.tied_embeddings:
        specs.append(TiedLayerSpec("embed", TiedOutputEmbedding, config, tp_group,
                                   tied_weight_attr="word_embeddings.weight"))
    else:
        specs.append(LayerSpec(OutputHeadStage, config, tp_group))
    return specs


def build_pipeline_model(config: ModelConfig, topology, partition_method: str = "parameters") -> PipelineModule:
    """The model as DeepSpeed pipeline stages over `topology` (PP > 1), run by its 1F1B schedule."""
    pp = topology.pp_world_size
    if pp < 2:
        raise ValueError("build_pipeline_model needs PP > 1; use GPTModel for PP = 1")
    if config.num_layers < pp:
        raise ConfigError(f"--pipeline-model-parallel-size {pp} is larger than --num-layers "
                          f"{config.num_layers}: every stage needs at least one layer.")
    config.validate(topology.tp_world_size)
    full_uniform = config.recompute_granularity == "full" and config.recompute_method == "uniform"
    module = HybridPipelineModule(
        layers=pipeline_layers(config, topology.tp_group),
        loss_fn=LMLoss(topology.tp_group, config.vocab_size),
        topology=topology.ds_topology,
        partition_method=_resolve_partition(partition_method, config.num_layers, pp),
        activation_checkpoint_interval=max(1, config.recompute_num_layers) if full_uniform else 0,
        checkpointable_layers=["TransformerLayer"],
    )
    if config.recompute_granularity == "full" and config.recompute_method == "block":
        stage_layers = [f for f in module.forward_funcs if isinstance(f, TransformerLayer)]
        for layer in stage_layers[: config.recompute_num_layers]:
            layer.forward = _recomputed(layer.forward)
    return module


def _recomputed(forward):
    def wrapped(hidden):
        if torch.is_grad_enabled():
            return _checkpoint(forward, hidden)
        return forward(hidden)
    return wrapped


def canonical_parameters(model: nn.Module, num_layers: int) -> dict[str, nn.Parameter]:
    """This rank's parameters under their canonical names, for GPTModel, a DeepSpeed pipeline stage
    or a rank's virtual stages (whose copy of a tied embedding is the embedding's)."""
    if not isinstance(model, PipelineModule):
        from hybrid.model.virtual_stages import TIED_COPY
        return {"embedding." + name[len(TIED_COPY) + 1:] if name.startswith(TIED_COPY + ".") else name: param
                for name, param in model.named_parameters()}
    from hybrid.checkpoint_format import canonical_name
    return {canonical_name(name, num_layers): param for name, param in model.named_parameters()}


def pipeline_ds_config(config: ModelConfig) -> dict:
    """The DeepSpeed "pipeline" settings this model needs.

    DeepSpeed's pipeline engine by default splits each activation sent between stages over the
    TP group and all-gathers it on arrival, assuming activations are identical on TP ranks.
    Under sequence parallelism each TP rank holds a different sequence shard, so that would mix
    shards from different ranks: turn it off.
    """
    if config.sequence_parallel:
        return {"pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}
    return {}
