"""Parameter names, declared once: the canonical names every form of the model shares, and the names
the other forms give the same parameters.

Canonical names (GPTModel's, used by checkpoints, conversion and the optimizer's parameter names):
  embedding.word_embeddings.weight, embedding.position_embeddings.weight,
  layers.{i}.{input_norm,post_attention_norm}.{weight,bias}, layers.{i}.attention.{qkv,dense}.{weight,bias},
  layers.{i}.{attention_output_norm,mlp_output_norm}.weight (--sandwich-norms), layers.{i}.attention.{q,k}_norm.weight,
  layers.{i}.attention.gate.weight (--attention-output-gate); a Gated DeltaNet layer's (hybrid.model.gated_delta_net)
  layers.{i}.attention.{in_proj.weight,conv_weight,A_log,dt_bias,norm.weight,out_proj.weight};
  layers.{i}.mlp.{fc1,fc2}.{weight,bias}, final_norm.{weight,bias}, output_layer.weight (untied only);
  an MoE layer's layers.{i}.mlp.router.weight, layers.{i}.mlp.deepspeed_moe.experts.deepspeed_experts.{e}.{fc1,fc2}
  .weight (e global, as DeepSpeed names experts in its expert files), layers.{i}.mlp.shared_mlp.{fc1,fc2}.weight,
  layers.{i}.mlp.shared_gate; Gemma 4's per-layer inputs (--per-layer-input-size): embedding.per_layer.{table.weight,
  projection,norm.weight}, layers.{i}.per_layer.{gate,up,norm.weight}.

Other names, in checkpoints written before (read by hybrid.conversion):
- DeepSpeed's PipelineModule (its 1F1B engine, and Megatron-DeepSpeed) names a layer by its index in the full
  LayerSpec list (embedding 0, transformer layer i at i + 1, final norm L + 1, head L + 2) whatever the stage
  split; a tied embedding lives under `tied_modules.embed.` on the first and last stages.
- Earlier virtual pipeline stages kept the last stage's copy of a tied table under `tied_output.` (loop
  placement); the copy is no parameter now (hybrid.model.virtual_stages).

Pure: no torch.distributed, no DeepSpeed.
"""

from __future__ import annotations

import re
from typing import Optional

TIED_KEY = "embed"  # the key of the word embeddings' TiedLayerSpec in DeepSpeed pipeline layer files
TIED_PREFIX = f"tied_modules.{TIED_KEY}."  # what DeepSpeed names that TiedLayerSpec's parameters
TIED_COPY = "tied_output"  # the last virtual stage's copy of a tied embedding (loop placement, PP > 1)
TIED_COPY_WEIGHT = f"{TIED_COPY}.word_embeddings.weight"
EMBEDDING_WEIGHT = "embedding.word_embeddings.weight"

_PIPE_NAME = re.compile(r"^(\d+)\.(.*)$")
_VOCAB_BLOCK = re.compile(r"^(embedding\.word_embeddings|output_layer)\.blocks\.(\d+)\.weight$")
# an MoE layer's experts (DeepSpeed's MoE naming): layers.{i}.mlp.deepspeed_moe.experts.deepspeed_experts.{e}.fc1.weight
EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."


# the parameters that take no weight decay (Megatron-LM's rule: biases and norms; the other 1-D ones too: the sinks,
# DSA's indexer key norm, Gemma 4's router scales, Gated DeltaNet's decay parameters as megatron-core's 1-D rule)
_NO_DECAY = re.compile(r"(^|\.)bias$|norm\.weight$|norm\.bias$|\.attention\.sinks$|\.k_norm_(weight|bias)$"
                       r"|\.router\.(input|output)_scale$|\.attention\.(A_log|dt_bias)$")


def weight_decayed(name: str) -> bool:
    """Whether the optimizer applies weight decay to the canonical parameter `name`."""
    return not _NO_DECAY.search(name)


def pipeline_index(name: str, num_layers: int) -> tuple[int, str]:
    """(LayerSpec index, name inside that layer) of a canonical parameter name."""
    if name.startswith("embedding."):
        return 0, name[len("embedding."):]
    if name.startswith("layers."):
        layer, key = name[len("layers."):].split(".", 1)
        return int(layer) + 1, key
    if name.startswith("final_norm."):
        return num_layers + 1, name
    return num_layers + 2, name  # output_layer.weight


def pipeline_name(name: str, num_layers: int, tied_embeddings: bool) -> str:
    """The name PipelineModule.named_parameters() gives a canonical parameter."""
    if tied_embeddings and name.startswith("embedding."):
        return TIED_PREFIX + name[len("embedding."):]
    index, key = pipeline_index(name, num_layers)
    return f"{index}.{key}"


def canonical_name(name: str, num_layers: int) -> Optional[str]:
    """Canonical name of any form's parameter name (also of a DeepSpeed layer file's key, given as
    `index.key`); None for the last stage's copy of a tied embedding in its layer file."""
    if name.startswith(TIED_PREFIX):
        return "embedding." + name[len(TIED_PREFIX):]
    if name.startswith(TIED_COPY + "."):
        return "embedding." + name[len(TIED_COPY) + 1:]
    match = _PIPE_NAME.match(name)
    if match is None:
        return name  # already canonical
    index, key = int(match.group(1)), match.group(2)
    if index == 0:
        return "embedding." + key
    if index <= num_layers:
        return f"layers.{index - 1}.{key}"
    if key == "word_embeddings.weight":
        return None
    return key


def vocab_block(name: str) -> Optional[tuple[str, int]]:
    """(the table's canonical name, the block's index) of a row block of an untied vocabulary table (ZeRO-3's form
    of it: hybrid.parallel.layers.TableBlock, `embedding.word_embeddings.blocks.{i}.weight`,
    `output_layer.blocks.{i}.weight`), else None."""
    match = _VOCAB_BLOCK.match(name)
    return (f"{match.group(1)}.weight", int(match.group(2))) if match else None


def vocab_block_name(table: str, index: int) -> str:
    """The name of row block `index` of the vocabulary table `table` (the inverse of vocab_block)."""
    return f"{table[:-len('weight')]}blocks.{index}.weight"


def global_expert_name(name: str, expert_offsets: dict, default: int = 0) -> str:
    """A local expert's parameter name with the global expert index (as DeepSpeed's expert checkpoint
    files name it): `expert_offsets` maps an MoE layer's module name to its first expert's global index
    (`default` for layers it does not name)."""
    if EXPERTS not in name:
        return name
    prefix, rest = name.split(EXPERTS, 1)
    local, tail = rest.split(".", 1)
    return f"{prefix}{EXPERTS}{int(local) + expert_offsets.get(prefix, default)}.{tail}"


def buffer_names(config) -> set:
    """Canonical names of the model's state that is not a parameter: the routers' score biases (replicated
    over TP, whole in every checkpoint file that holds their layer)."""
    if not config.num_experts or not config.moe_router_enable_expert_bias:
        return set()
    return {f"layers.{i}.mlp.router.score_bias" for i in config.moe_layers} | \
        {f"{mtp_prefix(config, i)}layer.mlp.router.score_bias" for i in config.mtp_layers
         if config.mlp_type_of(i) == "moe"}


def mtp_prefix(config, layer: int) -> str:
    """The canonical prefix of multi-token prediction layer `layer` (numbered after the decoder's layers):
    `mtp.{depth}.` (its embedding and hidden norms `enorm`, `hnorm`, the projection `eh_proj`, the transformer
    layer `layer.*`, its final norm `final_norm`)."""
    return f"mtp.{layer - config.num_layers}."


def canonical_buffers(model, num_layers: int) -> dict:
    """This rank's buffers under their canonical names (the routers' score biases among them), named as
    canonical_parameters names parameters."""
    offsets = {name: m.expert_offset for name, m in model.named_modules() if getattr(m, "expert_offset", 0)}
    return {canonical_name(global_expert_name(name, offsets) if offsets else name, num_layers): buffer
            for name, buffer in model.named_buffers()}


def canonical_parameters(model, num_layers: int) -> dict:
    """This rank's parameters under their canonical names, for GPTModel, a DeepSpeed pipeline stage
    or a rank's virtual stages (whose copy of a tied embedding is the embedding's); a local expert is
    named by its global index (its MoE layer's `expert_offset`)."""
    offsets = {name: m.expert_offset for name, m in model.named_modules() if getattr(m, "expert_offset", 0)}
    return {canonical_name(global_expert_name(name, offsets) if offsets else name, num_layers): param
            for name, param in model.named_parameters()}


def names_to_load(model, num_layers: int, buffers: bool = True) -> set:
    """What a checkpoint reader gives this rank's model: its parameters (and `buffers`) under canonical names and,
    for a last stage's copy of a tied table (hybrid.model.virtual_stages.RankModel.tied_table), the word
    embeddings. A table in row blocks (vocab_block) is read whole."""
    names = {(vocab_block(name) or (name,))[0] for name in canonical_parameters(model, num_layers)}
    if buffers:
        names |= set(canonical_buffers(model, num_layers))
    if getattr(model, "tied_table", None) is not None:
        names.add(EMBEDDING_WEIGHT)
    return names


# the transformer layers' matrices that take Muon (the rest of the layer's parameters are norms and biases, and an
# MoE layer's router and shared-expert gate); every expert's fc1 and fc2 and the shared experts' are matrices of
# their own; the fused ones (QKV, and fc1 when gated) are stepped as their parts
_MUON_MATRIX = re.compile(r"^layers\.\d+\.(attention\.(qkv|dense)|mlp\.(fc1|fc2)"
                          r"|mlp\.shared_mlp\.(fc1|fc2)|mlp\.deepspeed_moe\.experts\.deepspeed_experts\.\d+\.(fc1|fc2))"
                          r"\.weight$")


def takes_muon(name: str) -> bool:
    """Whether a canonical parameter is one of the matrices torch's Muon steps."""
    return bool(_MUON_MATRIX.match(name))


def is_fused(name: str, config) -> bool:
    """Whether a Muon matrix is stepped as parts (copies of its rows, which hybrid.memory counts)."""
    return name.endswith("attention.qkv.weight") or (name.endswith(".fc1.weight") and config.gated_linear_unit)
