"""HuggingFace transformers <-> canonical hybrid state dicts, one key-map adapter per family.

Each adapter has a table from HF names ({} = layer index) to ours, and per tensor a transform
with its inverse. The layouts that differ:
  GPT-2: HF's Conv1D stores weights as [in, out] (transposed vs nn.Linear); c_attn's output is
         [all q | all k | all v], ours is grouped per head [q_h, k_h, v_h] (Megatron's layout).
  Llama: q/k/v projections become one fused weight grouped per KV head (that group's query heads,
         then its key, then its value); gate/up become fc1 = [gate; up]. transformers' Llama uses
         the rotate-half RoPE layout, as our model does, so no permutation is needed.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import torch

from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig

SUPPORTED = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama"}


def _expect(name: str, tensor: torch.Tensor, shape: tuple) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(shape):
        raise ConfigError(f"HF tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(shape)} from config.json.")
    return tensor


class Adapter:
    """Maps one HF family's state dict and config to ours and back."""

    family: str
    hf_class: str

    def __init__(self, config: ModelConfig):
        self.config = config

    def to_canonical(self, hf_state: dict) -> dict:
        raise NotImplementedError

    def to_hf(self, state: dict) -> dict:
        raise NotImplementedError


class GPT2Adapter(Adapter):
    family, hf_class = "gpt2", "GPT2LMHeadModel"
    LAYER_MAP = {  # HF name -> ours; Conv1D weights are transposed
        "h.{}.ln_1.weight": "layers.{}.input_norm.weight", "h.{}.ln_1.bias": "layers.{}.input_norm.bias",
        "h.{}.attn.c_attn.weight": "layers.{}.attention.qkv.weight",
        "h.{}.attn.c_attn.bias": "layers.{}.attention.qkv.bias",
        "h.{}.attn.c_proj.weight": "layers.{}.attention.dense.weight",
        "h.{}.attn.c_proj.bias": "layers.{}.attention.dense.bias",
        "h.{}.ln_2.weight": "layers.{}.post_attention_norm.weight",
        "h.{}.ln_2.bias": "layers.{}.post_attention_norm.bias",
        "h.{}.mlp.c_fc.weight": "layers.{}.mlp.fc1.weight", "h.{}.mlp.c_fc.bias": "layers.{}.mlp.fc1.bias",
        "h.{}.mlp.c_proj.weight": "layers.{}.mlp.fc2.weight", "h.{}.mlp.c_proj.bias": "layers.{}.mlp.fc2.bias",
    }
    GLOBAL_MAP = {"wte.weight": "embedding.word_embeddings.weight",
                  "wpe.weight": "embedding.position_embeddings.weight",
                  "ln_f.weight": "final_norm.weight", "ln_f.bias": "final_norm.bias"}

    @staticmethod
    def config_from_hf(hf) -> ModelConfig:
        if getattr(hf, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"GPT-2 activation_function {hf.activation_function!r}: only the tanh GeLU "
                              f"(gelu_new) matches the model.")
        if getattr(hf, "scale_attn_by_inverse_layer_idx", False) or getattr(hf, "reorder_and_upcast_attn", False):
            raise ConfigError("GPT-2 scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported.")
        return ModelConfig(num_layers=hf.n_layer, hidden_size=hf.n_embd, num_attention_heads=hf.n_head,
                           vocab_size=hf.vocab_size, max_position_embeddings=hf.n_positions,
                           ffn_hidden_size=hf.n_inner or 4 * hf.n_embd, norm_epsilon=hf.layer_norm_epsilon,
                           hidden_dropout=hf.resid_pdrop, attention_dropout=hf.attn_pdrop,
                           init_method_std=hf.initializer_range)

    def hf_config(self, tokenizer_ids: dict):
        from transformers import GPT2Config
        c = self.config
        return GPT2Config(vocab_size=c.vocab_size, n_positions=c.max_position_embeddings, n_embd=c.hidden_size,
                          n_layer=c.num_layers, n_head=c.num_attention_heads, n_inner=c.ffn_hidden_size,
                          activation_function="gelu_new", layer_norm_epsilon=c.norm_epsilon,
                          resid_pdrop=c.hidden_dropout, embd_pdrop=c.hidden_dropout, attn_pdrop=c.attention_dropout,
                          initializer_range=c.init_method_std, tie_word_embeddings=True,
                          architectures=[self.hf_class], **tokenizer_ids)

    def _qkv_to_ours(self, w):  # HF [3, n, d, ...] -> ours [n, 3, d, ...]
        c = self.config
        return w.reshape(3, c.num_attention_heads, c.head_dim, *w.shape[1:]).transpose(0, 1).reshape(w.shape)

    def _qkv_to_hf(self, w):
        c = self.config
        return w.reshape(c.num_attention_heads, 3, c.head_dim, *w.shape[1:]).transpose(0, 1).reshape(w.shape)

    def to_canonical(self, hf_state):
        c, h = self.config, self.config.hidden_size
        hf_state = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in hf_state.items()}
        out = {}
        for hf_name, ours in self.GLOBAL_MAP.items():
            out[ours] = _get(hf_state, hf_name)
        _expect("wte.weight", out["embedding.word_embeddings.weight"], (c.vocab_size, h))
        for i in range(c.num_layers):
            for hf_tmpl, our_tmpl in self.LAYER_MAP.items():
                hf_name, ours = hf_tmpl.format(i), our_tmpl.format(i)
                t = _get(hf_state, hf_name)
                if hf_name.endswith("weight") and t.dim() == 2:
                    t = t.t()  # Conv1D [in, out] -> Linear [out, in]
                if "c_attn" in hf_name:
                    t = self._qkv_to_ours(_expect(hf_name, t, (3 * h, h) if t.dim() == 2 else (3 * h,)))
                out[ours] = t.contiguous()
        return out

    def to_hf(self, state):
        c = self.config
        out = {f"transformer.{hf}": state[ours] for hf, ours in self.GLOBAL_MAP.items()}
        for i in range(c.num_layers):
            for hf_tmpl, our_tmpl in self.LAYER_MAP.items():
                hf_name, t = hf_tmpl.format(i), state[our_tmpl.format(i)]
                if "c_attn" in hf_name:
                    t = self._qkv_to_hf(t)
                if hf_name.endswith("weight") and t.dim() == 2:
                    t = t.t()
                out["transformer." + hf_name] = t.contiguous()
        return out  # lm_head.weight is tied to wte (transformers re-ties it on load)


class LlamaAdapter(Adapter):
    family, hf_class = "llama", "LlamaForCausalLM"
    LAYER_MAP = {"model.layers.{}.input_layernorm.weight": "layers.{}.input_norm.weight",
                 "model.layers.{}.post_attention_layernorm.weight": "layers.{}.post_attention_norm.weight",
                 "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.dense.weight",
                 "model.layers.{}.mlp.down_proj.weight": "layers.{}.mlp.fc2.weight"}

    @staticmethod
    def config_from_hf(hf) -> ModelConfig:
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(hf, flag, False):
                raise ConfigError(f"Llama {flag}=True is not supported (the model has no biases with --disable-bias-linear).")
        rope_scaling = getattr(hf, "rope_scaling", None)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
            raise ConfigError(f"Llama rope_scaling {rope_scaling} is not supported; only the default RoPE.")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        if head_dim * hf.num_attention_heads != hf.hidden_size:
            raise ConfigError("Llama head_dim x num_attention_heads != hidden_size is not supported.")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ConfigError(f"Llama hidden_act {hf.hidden_act!r}: only silu (SwiGLU) is supported.")
        rope_theta = getattr(hf, "rope_theta", None)
        if rope_theta is None:
            rope_theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return ModelConfig(num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
                           num_attention_heads=hf.num_attention_heads,
                           num_query_groups=hf.num_key_value_heads or hf.num_attention_heads,
                           vocab_size=hf.vocab_size, max_position_embeddings=hf.max_position_embeddings,
                           ffn_hidden_size=hf.intermediate_size, position_embedding_type="rope",
                           rotary_base=float(rope_theta), normalization="RMSNorm", norm_epsilon=hf.rms_norm_eps,
                           swiglu=True, add_bias_linear=False,
                           untie_embeddings_and_output_weights=not getattr(hf, "tie_word_embeddings", False),
                           hidden_dropout=0.0, attention_dropout=float(getattr(hf, "attention_dropout", 0.0)),
                           init_method_std=hf.initializer_range)

    def hf_config(self, tokenizer_ids: dict):
        from transformers import LlamaConfig
        c = self.config
        return LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
                           num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
                           num_key_value_heads=c.num_query_groups, max_position_embeddings=c.max_position_embeddings,
                           rms_norm_eps=c.norm_epsilon, rope_theta=c.rotary_base,
                           tie_word_embeddings=c.tied_embeddings, attention_bias=False, mlp_bias=False,
                           hidden_act="silu", initializer_range=c.init_method_std,
                           attention_dropout=c.attention_dropout, architectures=[self.hf_class], **tokenizer_ids)

    def _check_config(self):
        c = self.config
        if c.position_embedding_type != "rope" or c.normalization != "RMSNorm" or not c.swiglu or c.add_bias_linear:
            raise ConfigError("exporting to LlamaForCausalLM needs rope, RMSNorm, --swiglu and --disable-bias-linear.")

    def to_canonical(self, hf_state):
        c = self.config
        groups, per_group, d, h = c.num_query_groups, c.num_attention_heads // c.num_query_groups, c.head_dim, c.hidden_size
        out = {"embedding.word_embeddings.weight": _expect("model.embed_tokens.weight",
                                                           _get(hf_state, "model.embed_tokens.weight"), (c.vocab_size, h)),
               "final_norm.weight": _get(hf_state, "model.norm.weight")}
        if c.untie_embeddings_and_output_weights:
            out["output_layer.weight"] = _expect("lm_head.weight", _get(hf_state, "lm_head.weight"), (c.vocab_size, h))
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            q = _expect(p + "self_attn.q_proj.weight", _get(hf_state, p + "self_attn.q_proj.weight"), (groups * per_group * d, h))
            k = _expect(p + "self_attn.k_proj.weight", _get(hf_state, p + "self_attn.k_proj.weight"), (groups * d, h))
            v = _expect(p + "self_attn.v_proj.weight", _get(hf_state, p + "self_attn.v_proj.weight"), (groups * d, h))
            qkv = torch.cat([q.reshape(groups, per_group, d, h), k.reshape(groups, 1, d, h), v.reshape(groups, 1, d, h)],
                            dim=1)  # [groups, per_group + 2, d, h]
            out[f"layers.{i}.attention.qkv.weight"] = qkv.reshape(-1, h)
            gate = _get(hf_state, p + "mlp.gate_proj.weight")
            up = _get(hf_state, p + "mlp.up_proj.weight")
            out[f"layers.{i}.mlp.fc1.weight"] = torch.cat([gate, up], dim=0)
            for hf_tmpl, our_tmpl in self.LAYER_MAP.items():
                out[our_tmpl.format(i)] = _get(hf_state, hf_tmpl.format(i))
        return out

    def to_hf(self, state):
        self._check_config()
        c = self.config
        groups, per_group, d, h = c.num_query_groups, c.num_attention_heads // c.num_query_groups, c.head_dim, c.hidden_size
        out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
               "model.norm.weight": state["final_norm.weight"]}
        if c.untie_embeddings_and_output_weights:
            out["lm_head.weight"] = state["output_layer.weight"]
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            qkv = state[f"layers.{i}.attention.qkv.weight"].reshape(groups, per_group + 2, d, h)
            out[p + "self_attn.q_proj.weight"] = qkv[:, :per_group].reshape(-1, h).contiguous()
            out[p + "self_attn.k_proj.weight"] = qkv[:, per_group].reshape(-1, h).contiguous()
            out[p + "self_attn.v_proj.weight"] = qkv[:, per_group + 1].reshape(-1, h).contiguous()
            gate, up = state[f"layers.{i}.mlp.fc1.weight"].chunk(2, dim=0)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
            for hf_tmpl, our_tmpl in self.LAYER_MAP.items():
                out[hf_tmpl.format(i)] = state[our_tmpl.format(i)]
        return out


ADAPTERS = {"gpt2": GPT2Adapter, "llama": LlamaAdapter}


def _get(state: dict, name: str) -> torch.Tensor:
    if name not in state:
        raise ConfigError(f"HF checkpoint lacks tensor {name}.")
    return state[name]


def adapter_for_model(config: ModelConfig) -> Adapter:
    """GPT-2 style (learned positions, LayerNorm) or Llama style (rope, RMSNorm, SwiGLU)."""
    if config.position_embedding_type == "learned_absolute" and config.normalization == "LayerNorm" \
            and not config.swiglu and config.add_bias_linear and config.tied_embeddings \
            and config.num_query_groups == config.num_attention_heads:
        return GPT2Adapter(config)
    if config.position_embedding_type == "rope":
        return LlamaAdapter(config)
    raise ConfigError("this model matches neither GPT2LMHeadModel (learned positions, LayerNorm, GeLU, biases, "
                      "tied head, no GQA) nor LlamaForCausalLM (rope, RMSNorm, SwiGLU, no biases); cannot export.")


# ---- HF directories ----------------------------------------------------------------------------

def read_hf_dir(path: str, progress: Callable = None) -> tuple[dict, ModelConfig, Adapter]:
    """A local HF model directory -> (canonical full state dict, ModelConfig, adapter)."""
    if not os.path.isdir(path):
        raise ConfigError(f"--load-dir {path}: no such directory.")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"--load-dir {path}: no config.json; not a HuggingFace model directory.")
    with open(config_path) as f:
        architectures = json.load(f).get("architectures") or []
    family = next((SUPPORTED[a] for a in architectures if a in SUPPORTED), None)
    if family is None:
        raise ConfigError(f"--load-dir {path}: architecture {architectures or 'unknown'} is not supported; "
                          f"supported: {', '.join(SUPPORTED)}.")
    from transformers import AutoConfig
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    adapter_cls = ADAPTERS[family]
    config = adapter_cls.config_from_hf(hf_config)
    adapter = adapter_cls(config)
    state = load_hf_weights(path, progress)
    return {k: v.float() for k, v in adapter.to_canonical(state).items()}, config, adapter


def load_hf_weights(path: str, progress=None) -> dict:
    """safetensors (single or sharded with an index), else pytorch_model.bin with weights_only=True."""
    from safetensors.torch import load_file
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    elif os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        from hybrid.checkpoint_format import safe_load
        return safe_load(os.path.join(path, "pytorch_model.bin"))
    else:
        raise ConfigError(f"--load-dir {path}: no model.safetensors, sharded index or pytorch_model.bin.")
    state = {}
    for name in (progress(files) if progress else files):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ConfigError(f"--load-dir {path}: weight shard {name} listed in the index is missing.")
        state.update(load_file(file))
    return state


def write_hf_dir(state: dict, config: ModelConfig, save_dir: str, tokenizer=None, max_shard_size: str = "5GB",
                 progress: Callable = None) -> None:
    """Canonical full state -> HF directory (config, safetensors shards + index, generation config,
    tokenizer), written to a temporary directory and renamed when complete."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from hybrid.checkpoint_format import atomic_directory
    adapter = adapter_for_model(config)
    hf_state = adapter.to_hf(state)
    ids = {}
    if tokenizer is not None:
        ids = {"bos_token_id": tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
               "eos_token_id": tokenizer.eos_token_id}
    with atomic_directory(save_dir) as tmp:
        adapter.hf_config(ids).save_pretrained(tmp)
        GenerationConfig(**ids).save_pretrained(tmp)
        split = split_torch_state_dict_into_shards(hf_state, filename_pattern="model{suffix}.safetensors",
                                                   max_shard_size=max_shard_size)
        files = list(split.filename_to_tensors.items())
        for filename, names in (progress(files) if progress else files):
            save_file({n: hf_state[n].contiguous() for n in names}, os.path.join(tmp, filename),
                      metadata={"format": "pt"})
        if split.is_sharded:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
