"""Each parameter's tensor-parallel split, read from the layers' own attributes (`partition_dim`,
`partition_stride`, `vocab_padded`, set where each parameter is made), not restated here; checkpoint
partitioning, DeepSpeed's `universal_checkpoint_info` and conversion all derive from it."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Optional

import torch
from deepspeed.checkpoint import constants as c

from hybrid.model import gated_delta_net, lora
from hybrid.model.config import ModelConfig
from hybrid.model.gpt import GPTModel
from hybrid.model.naming import pipeline_name, vocab_block
from hybrid.parallel.groups import ParallelGroups


@dataclasses.dataclass(frozen=True)
class TPRule:
    """How one parameter is split over TP ranks (read from the parameter's attributes)."""

    dim: Optional[int]  # the split dimension; None: replicated on every TP rank
    stride: int = 1  # 2: [gate; up] halves each split (SwiGLU's fc1)
    vocab_padded: bool = False  # vocabulary rows, padded to a multiple of make-vocab-size-divisible-by x TP


def tp_layout(config: ModelConfig) -> dict[str, TPRule]:
    """Canonical name -> TPRule for every parameter of a model with this config."""
    return dict(_tp_layout(json.dumps(dataclasses.asdict(config), sort_keys=True)))


@functools.lru_cache(maxsize=16)
def _tp_layout(config_json: str) -> tuple:
    config = ModelConfig(**json.loads(config_json))
    # a tiny model of the same structure (names and layers depend on the options, not the sizes)
    tiny = dataclasses.replace(config, hidden_size=2 * config.num_attention_heads, ffn_hidden_size=2, vocab_size=8,
                               vocab_block_rows=0,  # the tables whole: ZeRO-3's row blocks are a form of them
                               max_position_embeddings=2, make_vocab_size_divisible_by=1, rotary_percent=1.0,
                               **({"q_lora_rank": 2 if config.q_lora_rank else None, "kv_lora_rank": 2,
                                   "qk_head_dim": 2, "qk_pos_emb_head_dim": 2, "v_head_dim": 2}
                                  if config.multi_latent_attention else {}),
                               **({"moe_ffn_hidden_size": 2} if config.num_experts else {}),
                               **({"lora_rank": 1} if config.lora_rank else {}),
                               **({"moe_shared_expert_intermediate_size": 2}
                                  if config.moe_shared_expert_intermediate_size else {}))
    rules = []
    for name, param in GPTModel(tiny, ParallelGroups.single()).named_parameters():
        split = getattr(param, "tensor_model_parallel", False)
        rules.append((name, TPRule(param.partition_dim if split else None, getattr(param, "partition_stride", 1),
                                   getattr(param, "vocab_padded", False))))
    return tuple(rules)


def full_numels(config: ModelConfig) -> dict[str, int]:
    """Canonical name -> elements of the whole (unsharded) parameter, vocabulary tables at `config.vocab_size`
    rows (no padding), for every parameter of tp_layout. What the checkpoint readers check a joined tensor
    against (a missing TP shard shows as a tensor of half the size) and what the memory estimate counts."""
    shapes = {}
    out = {}
    for key, rule in tp_layout(config).items():
        name = key
        if name.startswith("mtp."):  # multi-token prediction: a layer of the last decoder layer's kind, norms, eh_proj
            depth, part = name[len("mtp."):].split(".", 1)
            if not part.startswith("layer."):
                out[key] = 2 * config.hidden_size ** 2 if part.startswith("eh_proj.") else config.hidden_size
                continue
            name = f"layers.{config.num_layers + int(depth)}.{part[len('layer.'):]}"  # counted as that layer's
        index = int(name.split(".")[1]) if name.startswith("layers.") else None
        if index not in shapes:  # (Gemma 4: a full-attention layer's own head size and KV heads, a sharing layer's)
            layer = config if index is None else config.layer_config(index)
            shapes[index] = (layer, _shapes(layer, index is not None and config.kv_source(index) is not None))
        out[key] = _numel(name, rule, shapes[index][0], *shapes[index][1])
    return out


def _shapes(config: ModelConfig, reader: bool = False) -> tuple:
    """(rows, inputs, norms) of the layer parameters of a model with this config (`reader`: of a layer reading
    another's keys and values, whose projection makes queries only)."""
    h, d = config.hidden_size, config.head_dim
    values = 0 if reader else 1 if config.attention_k_eq_v else 2
    rows = {"attention.qkv": (config.num_attention_heads + values * config.num_query_groups) * d, "attention.dense": h,
            "mlp.fc1": config.ffn_hidden_size * (2 if config.gated_linear_unit else 1), "mlp.fc2": h}
    inputs = {"attention.qkv": h, "attention.dense": config.num_attention_heads * config.value_head_dim, "mlp.fc1": h,
              "mlp.fc2": config.ffn_hidden_size}
    if config.attention_output_gate:  # --attention-output-gate: a gate per head and feature
        rows["attention.gate"], inputs["attention.gate"] = config.num_attention_heads * d, h
    norms = {"q_norm": d, "k_norm": d}  # Q/K norms: one head (--qk-norm-across-heads: every head)
    if config.qk_norm_across_heads:
        norms = {"q_norm": config.num_attention_heads * d, "k_norm": config.num_query_groups * d}
    if config.multi_latent_attention:  # hybrid.model.mla
        heads, q_rank, kv_rank = config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank
        rows.update({"attention.q": heads * d, "attention.q_down": q_rank, "attention.q_up": heads * d,
                     "attention.kv_down": kv_rank + config.qk_pos_emb_head_dim,
                     "attention.kv_up": heads * (config.qk_head_dim + config.v_head_dim)})
        inputs.update({"attention.q": h, "attention.q_down": h, "attention.q_up": q_rank, "attention.kv_down": h,
                       "attention.kv_up": kv_rank})
        norms.update(q_down_norm=q_rank, kv_down_norm=kv_rank)
    return rows, inputs, norms


def _numel(name: str, rule, config: ModelConfig, rows: dict, inputs: dict, norms: dict) -> int:
    """Full elements of the parameter `name` (canonical; `rule` its TPRule)."""
    h = config.hidden_size
    if lora.is_adapter(name):
        rows, columns = lora.adapter_shapes(config)[name]
        return rows * columns
    if ".per_layer." in name:  # Gemma 4's per-layer inputs (hybrid.model.per_layer)
        size, width = config.per_layer_input_size, config.per_layer_input_size * config.num_layers
        part = name.split(".per_layer.", 1)[1]
        if name.startswith("embedding."):
            return {"table.weight": config.vocab_size * width, "projection": width * h, "norm.weight": size}[part]
        return {"gate": size * h, "up": h * size, "norm.weight": h, "norm.bias": h}[part]
    if rule.vocab_padded:
        return config.vocab_size * h
    if name == "embedding.position_embeddings.weight":
        return config.max_position_embeddings * h
    if ".mlp." in name and config.mlp_type_of(int(name.split(".")[1])) == "moe":
        return _moe_numel(name, config)
    if name.startswith("layers.") and ".attention." in name and config.linear_attention(int(name.split(".")[1])):
        return gated_delta_net.parameter_numels(config)[name.split(".attention.", 1)[1]]
    if name.endswith("norm.weight") or name.endswith("norm.bias"):
        return norms.get(name.split(".")[-2], h)
    if name.endswith(".attention.sinks"):  # one logit per head
        return config.num_attention_heads
    if ".attention.indexer." in name:  # DSA's lightning indexer (hybrid.model.dsa), replicated over TP
        heads, dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        return {"wq_b": heads * dim * config.q_lora_rank, "wk": dim * h, "k_norm_weight": dim, "k_norm_bias": dim,
                "weights_proj": heads * h}[name.rsplit(".", 1)[1]]
    module = ".".join(name.split(".")[2:4])  # layers.{i}.attention.qkv.weight -> attention.qkv
    return rows[module] * (inputs[module] if name.endswith(".weight") else 1)


def _moe_numel(name: str, config: ModelConfig) -> int:
    """Full elements of an MoE layer's parameter: router [E, h], an expert's fc1 [up, h] / fc2 [h, f],
    the shared experts' fc1 / fc2 (a dense MLP of their width), the shared gate [1, h]."""
    h, gated = config.hidden_size, 2 if config.gated_linear_unit else 1
    part = name.split(".mlp.", 1)[1]
    if part == "router.weight":
        return config.num_experts * h
    if part in ("router.bias", "router.output_scale"):  # (the expert scale: Gemma 4's router)
        return config.num_experts
    if part == "router.input_scale" or part.endswith("_norm.weight"):  # (Gemma 4's block: its norms, router scale)
        return h
    if part == "shared_gate":
        return h
    width = config.moe_shared_expert_intermediate_size if part.startswith("shared_mlp.") else config.moe_ffn_hidden_size
    if name.endswith(".bias"):  # (--add-bias-linear: the experts' and shared experts' biases)
        return width * gated if ".fc1." in name else h
    return width * h * (gated if ".fc1." in name else 1)


def universal_checkpoint_info(config: ModelConfig, tp: int, pipeline: bool = False,
                              tied_copy: Optional[str] = None) -> dict:
    """DeepSpeed's `universal_checkpoint_info` for this model: one exact pattern per parameter (in the names
    DeepSpeed's files use: canonical names, or with `pipeline` those of DeepSpeed's pipeline engine, whose
    layer files older checkpoints hold), derived from tp_layout, so `ds_to_universal` in strict mode finds every
    pattern used. `tied_copy`: the name of a second copy of the tied embedding table (the virtual stages of
    older checkpoints kept one as a parameter), a vocabulary parameter too."""
    groups = {c.VOCABULARY_PARAMETER_PATTERNS: [], c.TP_REPLICATED_PARAMETER_PATTERNS: [],
              c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [], c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: []}
    blocked = config.vocab_blocked(tp)
    for name, rule in tp_layout(config).items():
        if blocked and rule.vocab_padded:
            continue  # its row blocks (ZeRO-3): column-parallel slices, no padding of their own (DeepSpeed's default)
        pattern = "^" + re.escape(pipeline_name(name, config.num_layers, config.tied_embeddings) if pipeline
                                  else name) + "$"
        if rule.vocab_padded:
            groups[c.VOCABULARY_PARAMETER_PATTERNS].append(pattern)
        elif rule.dim is None:
            groups[c.TP_REPLICATED_PARAMETER_PATTERNS].append(pattern)
        elif rule.dim == 1:
            groups[c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS].append(pattern)
        elif rule.stride == 2:
            groups[c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0].append(pattern)
        # column-parallel (dim 0, stride 1) is DeepSpeed's default: concatenated along dim 0
    if tied_copy is not None:
        groups[c.VOCABULARY_PARAMETER_PATTERNS].append("^" + re.escape(tied_copy) + "$")
    info = {c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            c.ORIGINAL_VOCAB_SIZE: config.vocab_size, c.PADDED_VOCAB_SIZE: config.padded_vocab_size(tp),
            c.PARAMETER_TO_AVERAGE_PATTERNS: []}
    info.update({key: patterns for key, patterns in groups.items() if patterns})
    return info


def join_vocab_blocks(state: dict, tp: int = 1) -> dict:
    """`state` (canonical name -> tensor) with each vocabulary table's row blocks (hybrid.model.naming.vocab_block:
    ZeRO-3's form of an untied table) joined into the table, in place. With `tp` > 1 each block holds that block of
    every TP rank in rank order, as DeepSpeed's ds_to_universal joins TP slices (dim 0): the table is each rank's
    blocks in order, rank after rank."""
    blocks: dict[str, dict[int, torch.Tensor]] = {}
    for name in [n for n in state if vocab_block(n)]:
        table, index = vocab_block(name)
        blocks.setdefault(table, {})[index] = state.pop(name)
    for table, parts in blocks.items():
        ordered = [parts[i] for i in sorted(parts)]
        state[table] = torch.cat([torch.cat([part.chunk(tp)[rank] for part in ordered]) for rank in range(tp)])
    return state
