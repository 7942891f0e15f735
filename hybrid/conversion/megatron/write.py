"""Megatron-LM checkpoints, written (checkpoint_util.py --saver megatron), in both of its formats:

- `--ckpt-format torch` (legacy): one `model_optim_rng.pt` per TP x PP (x EP) rank, layer numbers local to
  the stage (the MTP layers, `mtp.layers.{k}.`, on the last), the norms spelled as --saver-transformer-impl says
  (transformer_engine, Megatron-LM's default, or local; MLA's down projections whole with TE, split over TP in the
  local spec), experts as SequentialMLP names them (`mlp.experts.local_experts.J`, J local to the EP rank).
- `--ckpt-format torch_dist` (megatron-core's dist_checkpointing): what `dist_checkpointing.save` writes for
  the model's sharded_state_dict, in one process with torch.distributed.checkpoint (no process group):
  global tensors under megatron-core's sharded keys (every layer's weight of one kind stacked
  [num_layers, ...], or one key per layer when dense and MoE layers mix; experts [experts, ...]; the
  norms under Transformer Engine's names, Megatron-LM's default, and also under the local spec's where it has
  others: dist_layer_keys), the linear layers' `_extra_state` objects (empty, as a model without FP8 state has
  them), `common.pt` (args, iteration) and `metadata.json`. Any TP / PP / EP loads it.

Weights only: Megatron-LM resumes it with --no-load-optim --no-load-rng (or --finetune); the args it
stores describe the model (and the run's counters), so --use-checkpoint-args rebuilds it.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional

import torch

from hybrid.checkpoint.client_state import ClientState
from hybrid.checkpoint.files import MEGATRON_LATEST, atomic_directory, tag_for, write_atomic
from hybrid.checkpoint.tp_layout import tp_layout
from hybrid.conversion.families.mla_rope import deepseek_rope_rows
from hybrid.conversion.families.options import gemma4_options
from hybrid.conversion.layout import shard_for_rank
from hybrid.conversion.megatron.args import megatron_rope_args
from hybrid.conversion.megatron.names import (LEGACY_FILE, MLA_DOWN, MTP_LAYER, MTP_NAMES, is_buffer,
                                              megatron_global_key, megatron_layer_key)
from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig
from hybrid.model.naming import EXPERTS, buffer_names
from hybrid.parallel.layers import shard

LINEAR_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
MLA_LINEARS = ("self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj",
               "self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj", "self_attention.linear_proj")
SHARED_LINEARS = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
EXPERT_LINEARS = ("linear_fc1", "linear_fc2")
# megatron-core's torch_dist metadata.json (its sharded and common backends)
DIST_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                 "common_backend_version": 1}


def megatron_args(config: ModelConfig, tp: int, pp: int, client_state: ClientState, ep: int = 1) -> argparse.Namespace:
    """The args Megatron-LM stores (its argparse names) for this model at TP x PP x EP, over the run's own."""
    run = {k: v for k, v in (client_state.args or {}).items() if isinstance(v, (str, int, float, bool, type(None)))}
    arch = dict(
        num_layers=config.num_layers, hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads,
        group_query_attention=config.num_query_groups != config.num_attention_heads,
        num_query_groups=config.num_query_groups, kv_channels=config.head_dim,
        max_position_embeddings=config.max_position_embeddings, position_embedding_type=config.position_embedding_type,
        rotary_base=config.rotary_base, rotary_percent=config.rotary_percent, rotary_interleaved=False,
        use_rope_scaling=bool(config.rope_scaling and config.rope_scaling["rope_type"] == "llama3"),
        rope_scaling_factor=(config.rope_scaling or {}).get("factor", 8.0),
        rotary_seq_len_interpolation_factor=(config.rope_scaling["factor"] if config.rope_scaling and
                                             config.rope_scaling["rope_type"] == "linear" else None),
        normalization=config.normalization, norm_epsilon=config.norm_epsilon,
        apply_layernorm_1p=config.apply_layernorm_1p, swiglu=config.swiglu, openai_gelu=not config.gated_linear_unit,
        squared_relu=False, add_bias_linear=config.add_bias_linear, add_qkv_bias=config.add_qkv_bias,
        quick_geglu=config.quick_geglu, glu_linear_offset=config.glu_linear_offset,
        activation_func_clamp_value=config.activation_func_clamp_value,
        softmax_type="learnable" if config.attention_sinks else "vanilla",
        qk_layernorm=config.qk_layernorm,
        untie_embeddings_and_output_weights=config.untie_embeddings_and_output_weights,
        padded_vocab_size=config.padded_vocab_size(tp),
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
        window_size=(config.sliding_window - 1, 0) if config.sliding_window else None,
        window_attn_skip_freq=config.window_attn_skip_freq if config.sliding_window else None,
        hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout,
        init_method_std=config.init_method_std, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp(config, tp),
        num_experts=config.num_experts, multi_latent_attention=config.multi_latent_attention,
        consumed_train_samples=int(client_state.consumed_samples), consumed_valid_samples=0,
        iteration=int(client_state.iteration), bf16=config.hf_dtype == "bfloat16", fp16=config.hf_dtype == "float16")
    if config.multi_latent_attention:
        arch.update({name: getattr(config, name) for name in (
            "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")})
    arch.update(megatron_rope_args(config), mtp_num_layers=config.mtp_num_layers,
                mtp_loss_scaling_factor=config.mtp_loss_scaling_factor)
    if config.num_experts:
        arch.update({name: getattr(config, name) for name in (
            "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function",
            "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups",
            "moe_router_group_topk", "moe_router_load_balancing_type",
            "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_enable_expert_bias", "moe_router_dtype",
            "moe_router_bias_update_rate",
            "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_expert_capacity_factor",
            "moe_token_drop_policy", "moe_pad_expert_input_to_capacity")}, moe_grouped_gemm=False)
    run.pop("disable_bias_linear", None)
    return argparse.Namespace(**{**run, **arch})


def _common(args: argparse.Namespace, iteration: int, ckpt_format: str) -> dict:
    return {"args": argparse.Namespace(**dict(vars(args), ckpt_format=ckpt_format)), "checkpoint_version": 3.0,
            "iteration": iteration, "num_floating_point_operations_so_far": 0}


def write_megatron(state: dict, config: ModelConfig, tp: int, pp: int, save_dir: str, client_state: ClientState,
                   ckpt_format: str = "torch", spelling: Optional[str] = None, ep: int = 1) -> str:
    """Write `state` (canonical, full; the routers' score biases too when the model has them) as a
    Megatron-LM checkpoint in `save_dir`; atomic. Returns the tag."""
    missing = sorted(buffer_names(config) - set(state))
    if missing:
        raise ConfigError(f"the model's routers have expert biases, and the source does not carry them ({missing[0]}, "
                          f"...); convert from a checkpoint that has them (a Megatron-LM checkpoint, or "
                          f"launch/train.py --save).")
    if config.num_experts and config.num_experts % ep:
        raise ConfigError(f"--target-expert-parallel-size {ep} does not divide the model's {config.num_experts} "
                          f"experts.")
    unwritable = [flag for flag, on in {"--sandwich-norms": config.sandwich_norms,
                                        "--local-rotary-base": config.local_rotary_base is not None,
                                        "--softmax-scale": config.softmax_scale is not None,
                                        "--qk-norm-across-heads": config.qk_norm_across_heads,
                                        "--llama-4-scaling-beta": config.llama_4_scaling_beta is not None,
                                        "--experimental-attention-variant dsa": config.dsa_indexer_topk is not None,
                                        "--mla-latent-norm-epsilon": config.mla_latent_norm_epsilon is not None,
                                        "--experimental-attention-variant gated_delta_net":
                                            config.linear_attention_freq is not None,
                                        "--attention-output-gate": config.attention_output_gate,
                                        **gemma4_options(config)}.items() if on]
    if unwritable:
        raise ConfigError(f"a Megatron-LM checkpoint is not written here for {', '.join(unwritable)} (Gemma 3's and "
                          f"4's, MiniMax-M2's and Mistral 4's options have no Megatron-LM argument; megatron-core's "
                          f"DSA and Gated DeltaNet names are not mapped): Megatron-LM would build another model. "
                          f"Export with --saver hf instead.")
    if ckpt_format != "torch_dist" and expert_tp(config, tp) == 1 and tp > 1 and ep > 1:
        raise ConfigError(f"experts with biases are written at expert-TP 1 (megatron-core builds them only there), and "
                          f"the legacy format at TP {tp} x EP {ep} interleaves expert ranks over TP, which hybrid does "
                          f"not write; use --ckpt-format torch_dist, or TP 1 or EP 1.")
    iteration = int(client_state.iteration)
    tag = tag_for(iteration)
    args = megatron_args(config, tp, pp, client_state, ep)  # (before anything is written: it may refuse the rope)
    state = deepseek_rope_rows(state, config, to_halves=False)  # MLA's rope rows in megatron-core's order
    with atomic_directory(save_dir) as tmp:
        directory = os.path.join(tmp, tag)
        os.makedirs(directory)
        common = _common(args, iteration, ckpt_format)
        if ckpt_format == "torch_dist":
            _write_dist(state, config, tp, directory, common)
        else:
            _write_legacy(state, config, tp, pp, ep, directory, common, spelling or "transformer_engine")
        write_atomic(os.path.join(tmp, MEGATRON_LATEST), str(iteration))
    return tag


# --- the legacy format ----------------------------------------------------------------------------

def _write_legacy(state: dict, config: ModelConfig, tp: int, pp: int, ep: int, directory: str, common: dict,
                  spelling: str) -> None:
    layers_per_stage = config.num_layers // pp
    local_experts = (config.num_experts or 0) // ep
    for stage in range(pp):
        first, last = stage * layers_per_stage, (stage + 1) * layers_per_stage
        for ep_rank in range(ep):
            experts = range(ep_rank * local_experts, (ep_rank + 1) * local_experts)
            for tp_rank in range(tp):
                model = _legacy_model(state, config, tp, tp_rank, stage, pp, first, last, experts, spelling)
                name = (f"mp_rank_{tp_rank:02d}" + (f"_{stage:03d}" if pp > 1 else "")
                        + (f"_{ep_rank:03d}" if ep > 1 else ""))
                os.makedirs(os.path.join(directory, name))
                torch.save(dict(common, model=model), os.path.join(directory, name, LEGACY_FILE))


def _layer_scope(name: str, config: ModelConfig, first: int) -> Optional[tuple]:
    """(layer number, Megatron's prefix, the name inside the layer) of a canonical name inside a transformer layer:
    a decoder layer's (numbered from the stage's `first`), or an MTP layer's (numbered after the decoder's); None for
    other names."""
    if name.startswith("layers."):
        layer, rest = int(name.split(".")[1]), name.split(".", 2)[2]
        return layer, f"decoder.layers.{layer - first}.", rest
    if name.startswith("mtp.") and name.split(".", 2)[2].startswith("layer."):
        depth, rest = int(name.split(".")[1]), name.split(".", 3)[3]
        return config.num_layers + depth, f"mtp.layers.{depth}.{MTP_LAYER}", rest
    return None


def _mtp_key(name: str) -> str:
    """Megatron's key of an MTP layer's own norm or projection (mtp.{k}.enorm.weight, ...)."""
    depth, rest = name[len("mtp."):].split(".", 1)
    return f"mtp.layers.{depth}." + {ours: theirs for theirs, ours in MTP_NAMES.items()}[rest]


def _legacy_model(state, config, tp, tp_rank, stage, pp, first, last, experts, spelling) -> dict:
    """One legacy file's `model`: this stage's layers (stage-local numbers; the MTP layers on the last stage), this
    EP rank's experts, TP shards."""
    model = {}
    for name in sorted(state):
        scope = _layer_scope(name, config, first)
        if scope is not None:
            layer, prefix, rest = scope
            if not (first <= layer < last or (layer >= config.num_layers and stage == pp - 1)):
                continue
            moe = config.mlp_type_of(layer) == "moe"
            if EXPERTS in name:
                expert, fc, field = rest[len("mlp") + len(EXPERTS):].split(".")[:3]
                if int(expert) in experts:
                    key = f"{prefix}mlp.experts.local_experts.{int(expert) - experts.start}.linear_{fc}.{field}"
                    model[key] = _expert_shard(state[name], fc, field, config, tp, tp_rank).contiguous().clone()
                continue
            key = prefix + megatron_layer_key(rest, spelling, config.multi_latent_attention, moe)
            if rest in MLA_DOWN and spelling == "local":  # (ColumnParallelLinear there; TE's TELinear: whole)
                if state[name].size(0) % tp:
                    raise ConfigError(f"--saver-transformer-impl local splits MLA's down projections over TP, and "
                                      f"{name}'s {state[name].size(0)} rows do not divide by TP {tp}; write "
                                      f"transformer_engine's (whole on each rank) or another TP.")
                value = shard(state[name], 0, tp_rank, tp)
            else:
                value = state[name] if is_buffer(name) else shard_for_rank(name, state[name], config, tp, tp_rank)
            model[key] = value.contiguous().clone()
            continue
        if name.startswith("mtp."):
            if stage == pp - 1:
                model[_mtp_key(name)] = shard_for_rank(name, state[name], config, tp, tp_rank).contiguous().clone()
            continue
        on_first = name.startswith("embedding.")  # (the last stage holds the embeddings too when it has MTP layers:
        mtp_stage = bool(config.mtp_num_layers) and stage == pp - 1  # megatron-core builds them there)
        if (on_first and (stage == 0 or mtp_stage)) or (not on_first and stage == pp - 1):
            piece = shard_for_rank(name, state[name], config, tp, tp_rank)
            model[megatron_global_key(name)] = piece.contiguous().clone()
    if stage == pp - 1 and pp > 1 and config.tied_embeddings:  # the last stage's copy of the table
        model["output_layer.weight"] = shard_for_rank("embedding.word_embeddings.weight",
                                                      state["embedding.word_embeddings.weight"], config, tp,
                                                      tp_rank).contiguous().clone()
    scopes = [(first + i, f"decoder.layers.{i}.") for i in range(last - first)]
    if stage == pp - 1:
        scopes += [(layer, f"mtp.layers.{layer - config.num_layers}.{MTP_LAYER}") for layer in config.mtp_layers]
        model.update({f"mtp.layers.{k}.eh_proj._extra_state": None for k in range(config.mtp_num_layers or 0)})
    for layer, prefix in scopes:
        for module in _linear_modules(config, layer):
            model[f"{prefix}{module}._extra_state"] = None
        if config.mlp_type_of(layer) == "moe":
            for j in range(len(experts)):
                for linear in EXPERT_LINEARS:
                    model[f"{prefix}mlp.experts.local_experts.{j}.{linear}._extra_state"] = None
    if stage == pp - 1 and (config.untie_embeddings_and_output_weights or pp > 1):
        model["output_layer._extra_state"] = None
    return model


def _linear_modules(config: ModelConfig, layer: int) -> tuple:
    """The linear layers of a layer that keep an `_extra_state` (not the experts')."""
    attention = LINEAR_MODULES[:2]
    if config.multi_latent_attention:
        attention = MLA_LINEARS if config.q_lora_rank else ("self_attention.linear_q_proj",) + MLA_LINEARS[2:]
    if config.mlp_type_of(layer) != "moe":
        return attention + LINEAR_MODULES[2:]
    return attention + (SHARED_LINEARS if config.moe_shared_expert_intermediate_size else ())


def expert_tp(config: ModelConfig, tp: int) -> int:
    """The experts' TP: TP's (Megatron-LM's default), but 1 for experts with biases, which megatron-core builds only
    at expert-TP 1 (GPT-OSS's)."""
    return 1 if config.num_experts and config.add_bias_linear else tp


def _expert_shard(tensor: torch.Tensor, fc: str, field: str, config: ModelConfig, tp: int,
                  tp_rank: int) -> torch.Tensor:
    """An expert's weight or bias on one expert-TP rank (expert_tp): fc1's by rows ([gate; up] per rank when gated),
    fc2's weight by columns and its bias whole, as a dense MLP; whole at expert-TP 1."""
    if expert_tp(config, tp) == 1:
        return tensor
    if fc == "fc1":
        return shard(tensor, 0, tp_rank, tp, 2 if config.gated_linear_unit else 1)
    return tensor if field == "bias" else shard(tensor, 1, tp_rank, tp)


# --- torch_dist -----------------------------------------------------------------------------------

def _write_dist(state: dict, config: ModelConfig, tp: int, directory: str, common: dict) -> None:
    """megatron-core's torch_dist layout of `state`, written by torch.distributed.checkpoint in this process."""
    import torch.distributed.checkpoint as dcp  # torch's DCP: only when writing this format
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # (see above)
    tensors = _dist_tensors(state, config, tp)
    objects = {key: [None] for key in _dist_objects(config)}  # what a linear layer's get_extra_state gives
    dcp.save({**tensors, **objects}, storage_writer=dcp.FileSystemWriter(directory),
             planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    torch.save(common, os.path.join(directory, "common.pt"))
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        json.dump(DIST_METADATA, f)


def homogeneous(config: ModelConfig) -> bool:
    """megatron-core stacks each kind of layer weight over the layers only when every layer has the same
    modules (its TransformerBlock.sharded_state_dict: no --moe-layer-freq list or N > 1)."""
    freq = config.moe_layer_freq
    return not config.num_experts or (not isinstance(freq, (list, tuple)) and int(freq) == 1)


def _dist_key(layer: int, rest: str, stacked: bool) -> str:
    return f"decoder.layers.{rest}" if stacked else f"decoder.layers.{layer}.{rest}"


def _dist_tensors(state: dict, config: ModelConfig, tp: int) -> dict:
    """{megatron-core sharded key: global tensor}: vocabulary rows padded as the args say, each layer's
    weights stacked over the layers (homogeneous models), experts stacked over the experts."""
    stacked = homogeneous(config)
    per_key: dict[str, dict[int, torch.Tensor]] = {}  # key -> {layer: tensor}
    out = {}
    for name, tensor in state.items():
        scope = _layer_scope(name, config, 0)
        if scope is None:
            out[_mtp_key(name) if name.startswith("mtp.") else megatron_global_key(name)] = \
                _padded(name, tensor, config, tp).contiguous()
            continue
        layer, prefix, rest = scope
        mtp = layer >= config.num_layers  # (one key per MTP layer, as megatron-core's MultiTokenPredictionBlock)
        if EXPERTS in name:
            expert, fc, field = rest[len("mlp") + len(EXPERTS):].split(".")[:3]
            key = f"mlp.experts.experts.linear_{fc}.{field}"
            key = prefix + key if mtp else _dist_key(layer, key, stacked)
            per_key.setdefault(key, {}).setdefault(layer, {})[int(expert)] = tensor
            continue
        for key in dist_layer_keys(rest, config.multi_latent_attention, config.mlp_type_of(layer) == "moe"):
            per_key.setdefault(prefix + key if mtp else _dist_key(layer, key, stacked), {})[layer] = tensor
    for key, layers in per_key.items():
        values = [torch.stack([v[e] for e in sorted(v)]) if isinstance(v, dict) else v
                  for _, v in sorted(layers.items())]
        if stacked and not key.startswith("mtp."):
            if len(values) != config.num_layers:
                raise ConfigError(f"{key}: {len(values)} of {config.num_layers} layers in the source.")
            out[key] = torch.stack(values)
        else:
            out[key] = values[0]
    return out


def dist_layer_keys(rest: str, mla: bool, moe: bool) -> tuple:
    """The torch_dist keys (inside a layer) of one of our layer parameters: Transformer Engine's (Megatron-LM's
    default), and where megatron-core's local spec names the tensor otherwise, its name too (the same tensor twice,
    so that either loads it; Megatron-LM's loads let a checkpoint hold keys its model lacks). The local spec maps its
    norms to TE's fused names for a dense layer's attention and MLP, not before an MoE router (TE's own norm
    there), and not at all with MLA (its latent norms, its pre-MLP norm)."""
    te = megatron_layer_key(rest, "transformer_engine", mla, moe)
    local = megatron_layer_key(rest, "local", True, moe) if mla else megatron_layer_key(rest, "transformer_engine")
    return (te,) if local == te else (te, local)


def _padded(name: str, tensor: torch.Tensor, config: ModelConfig, tp: int) -> torch.Tensor:
    """A full tensor with its vocabulary rows padded as the model at TP pads them (the global tensor)."""
    rows = config.padded_vocab_size(tp)
    if not tp_layout(config)[name].vocab_padded or tensor.size(0) >= rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.size(0),) + tuple(tensor.shape[1:]))])


def _dist_objects(config: ModelConfig) -> list:
    """The unique keys of the linear layers' `_extra_state` ShardedObjects (`{key}/shard_{offsets}_{shape}`,
    offsets and shape over the stacked axes: the layer, then the expert)."""
    stacked, layers, experts = homogeneous(config), config.num_layers, config.num_experts or 0
    keys = [_object_key(f"mtp.layers.{k}.eh_proj._extra_state", [0], [1]) for k in range(config.mtp_num_layers or 0)]
    for layer in [*range(layers), *config.mtp_layers]:
        mtp = layer >= layers  # (MTP layers: one key each, never stacked)
        stack = stacked and not mtp
        prefix = f"mtp.layers.{layer - layers}.{MTP_LAYER}" if mtp else None
        axes = ([layer], [layers]) if stack else ([0], [1])
        for module in _linear_modules(config, layer):
            keys.append(_object_key(prefix + f"{module}._extra_state" if mtp else
                                    _dist_key(layer, f"{module}._extra_state", stack), *axes))
        if config.mlp_type_of(layer) == "moe":
            for expert in range(experts):
                for linear in EXPERT_LINEARS:
                    key = f"mlp.experts.experts.{linear}._extra_state"
                    key = prefix + key if mtp else _dist_key(layer, key, stack)
                    offsets, shape = ([layer, expert], [layers, experts]) if stack else ([expert], [experts])
                    keys.append(_object_key(key, offsets, shape))
    return keys


def _object_key(key: str, offsets: list, shape: list) -> str:
    return f"{key}/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, shape))}"
