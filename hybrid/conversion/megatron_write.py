"""Megatron-LM checkpoints, written (checkpoint_util.py --saver megatron): the legacy `--ckpt-format torch`
files (one per TP x PP rank, layer numbers local to the stage, the norms spelled as --saver-transformer-impl
says: transformer_engine, Megatron-LM's default, or local). megatron-core's `torch_dist` is read, not
written yet (Megatron-LM converts the legacy files with --ckpt-convert-format torch_dist).

Weights only: Megatron-LM resumes it with --no-load-optim --no-load-rng (or --finetune); the args it
stores describe the model (and the run's counters), so --use-checkpoint-args rebuilds it.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

import torch

from hybrid.checkpoint.client_state import ClientState
from hybrid.checkpoint.files import MEGATRON_LATEST, atomic_directory, tag_for
from hybrid.conversion.layout import shard_for_rank
from hybrid.conversion.megatron import LEGACY_FILE, megatron_global_key, megatron_layer_key
from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig

LINEAR_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def megatron_args(config: ModelConfig, tp: int, pp: int, client_state: ClientState) -> argparse.Namespace:
    """The args Megatron-LM stores (its argparse names) for this model at TP x PP, over the run's own."""
    run = {k: v for k, v in (client_state.args or {}).items() if isinstance(v, (str, int, float, bool, type(None)))}
    arch = dict(
        num_layers=config.num_layers, hidden_size=config.hidden_size, ffn_hidden_size=config.ffn_hidden_size,
        num_attention_heads=config.num_attention_heads,
        group_query_attention=config.num_query_groups != config.num_attention_heads,
        num_query_groups=config.num_query_groups, kv_channels=config.head_dim,
        max_position_embeddings=config.max_position_embeddings, position_embedding_type=config.position_embedding_type,
        rotary_base=config.rotary_base, rotary_percent=1.0, rotary_interleaved=False,
        use_rope_scaling=bool(config.rope_scaling and config.rope_scaling["rope_type"] == "llama3"),
        rope_scaling_factor=(config.rope_scaling or {}).get("factor", 8.0),
        rotary_seq_len_interpolation_factor=(config.rope_scaling["factor"] if config.rope_scaling and
                                             config.rope_scaling["rope_type"] == "linear" else None),
        normalization=config.normalization, norm_epsilon=config.norm_epsilon,
        apply_layernorm_1p=config.apply_layernorm_1p, swiglu=config.swiglu, openai_gelu=not config.gated_linear_unit,
        squared_relu=False, add_bias_linear=config.add_bias_linear, add_qkv_bias=config.add_qkv_bias,
        qk_layernorm=config.qk_layernorm, untie_embeddings_and_output_weights=config.untie_embeddings_and_output_weights,
        padded_vocab_size=config.padded_vocab_size(tp), make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
        window_size=(config.sliding_window - 1, 0) if config.sliding_window else None,
        hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout,
        init_method_std=config.init_method_std, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1, num_experts=None,
        multi_latent_attention=False, consumed_train_samples=int(client_state.consumed_samples),
        consumed_valid_samples=0, iteration=int(client_state.iteration), bf16=config.hf_dtype == "bfloat16",
        fp16=config.hf_dtype == "float16")
    run.pop("disable_bias_linear", None)
    return argparse.Namespace(**{**run, **arch})


def _common(args: argparse.Namespace, iteration: int, ckpt_format: str) -> dict:
    return {"args": argparse.Namespace(**dict(vars(args), ckpt_format=ckpt_format)), "checkpoint_version": 3.0,
            "iteration": iteration, "num_floating_point_operations_so_far": 0}


def write_megatron(state: dict, config: ModelConfig, tp: int, pp: int, save_dir: str, client_state: ClientState,
                   ckpt_format: str = "torch", spelling: Optional[str] = None) -> str:
    """Write `state` (canonical, full) as a Megatron-LM checkpoint in `save_dir`; atomic. Returns the tag."""
    if ckpt_format != "torch":
        raise ConfigError(f"--saver megatron --ckpt-format {ckpt_format}: only the legacy format (torch) is written "
                          f"yet; write that, then let Megatron-LM re-save it as torch_dist (its --ckpt-convert-format "
                          f"torch_dist --ckpt-convert-save DIR).")
    iteration = int(client_state.iteration)
    tag = tag_for(iteration)
    args = megatron_args(config, tp, pp, client_state)
    with atomic_directory(save_dir) as tmp:
        directory = os.path.join(tmp, tag)
        os.makedirs(directory)
        _write_legacy(state, config, tp, pp, directory, _common(args, iteration, ckpt_format),
                      spelling or "transformer_engine")
        with open(os.path.join(tmp, MEGATRON_LATEST), "w") as f:
            f.write(str(iteration))
    return tag


def _write_legacy(state: dict, config: ModelConfig, tp: int, pp: int, directory: str, common: dict,
                  spelling: str) -> None:
    layers_per_stage = config.num_layers // pp
    for stage in range(pp):
        first, last = stage * layers_per_stage, (stage + 1) * layers_per_stage
        for tp_rank in range(tp):
            model = {}
            for name in sorted(state):
                if name.startswith("layers."):
                    layer, rest = int(name.split(".")[1]), name.split(".", 2)[2]
                    if first <= layer < last:
                        key = f"decoder.layers.{layer - first}.{megatron_layer_key(rest, spelling)}"
                        model[key] = shard_for_rank(name, state[name], config, tp, tp_rank).contiguous().clone()
                    continue
                on_first = name.startswith("embedding.")
                if (on_first and stage == 0) or (not on_first and stage == pp - 1):
                    model[megatron_global_key(name)] = shard_for_rank(name, state[name], config, tp,
                                                                      tp_rank).contiguous().clone()
            if stage == pp - 1 and pp > 1 and config.tied_embeddings:  # the last stage's copy of the table
                model["output_layer.weight"] = shard_for_rank("embedding.word_embeddings.weight",
                                                              state["embedding.word_embeddings.weight"], config, tp,
                                                              tp_rank).contiguous().clone()
            for i in range(last - first):
                for module in LINEAR_MODULES:
                    model[f"decoder.layers.{i}.{module}._extra_state"] = None
            if stage == pp - 1 and (config.untie_embeddings_and_output_weights or pp > 1):
                model["output_layer._extra_state"] = None
            rank_dir = os.path.join(directory, f"mp_rank_{tp_rank:02d}" + (f"_{stage:03d}" if pp > 1 else ""))
            os.makedirs(rank_dir)
            torch.save(dict(common, model=model), os.path.join(rank_dir, LEGACY_FILE))
