"""The HuggingFace families hybrid imports and exports: one registry entry each (config mapping, key
map, and the options it needs), the family recorded in every checkpoint (`ModelConfig.family`).

Each adapter maps one family's config to a ModelConfig and back, and its state dict to our canonical
names and back. How each tensor splits over TP is not restated here: it is read from the layers
(hybrid.checkpoint.tp_layout). Every config field that would change the numerics and that the
model does not implement is refused by name (`REFUSED` in each adapter), never dropped.

Layouts that differ from ours:
  GPT-2: Conv1D stores weights as [in, out]; c_attn's output is [all q | all k | all v].
  Llama family (Llama, Mistral, Qwen2, Qwen3, Gemma): q/k/v projections become one fused weight
         (hybrid.model.qkv), gate/up become fc1 = [gate; up]. transformers uses the rotate-half
         RoPE layout, as our model does, so no permutation is needed.
"""

from __future__ import annotations

import dataclasses

import torch

from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig
from hybrid.model.naming import EXPERTS
from hybrid.model.qkv import fuse_qkv, split_qkv_flat


def expect(name: str, tensor: torch.Tensor, shape: tuple) -> torch.Tensor:
    if tuple(tensor.shape) != tuple(shape):
        raise ConfigError(f"HF tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(shape)} from "
                          f"config.json.")
    return tensor


def get(state: dict, name: str) -> torch.Tensor:
    if name not in state:
        raise ConfigError(f"HF checkpoint lacks tensor {name}.")
    return state[name]


def dtype_of(hf):
    """The HF config's dtype as a name ("bfloat16"), or None."""
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    if dtype is None:
        return None
    name = str(dtype).replace("torch.", "")
    return name if name in ("float32", "bfloat16", "float16") else None


def _refuse(family: str, field: str, value, why: str):
    raise ConfigError(f"{family} config field {field}={value!r} is not supported: {why}.")


class Adapter:
    """Maps one HF family's state dict and config to ours and back."""

    @classmethod
    def with_stored_layers(cls, config: ModelConfig, names) -> ModelConfig:
        """The config with what the checkpoint's tensor `names` add to config.json (DeepSeek's MTP layers)."""
        return config

    family: str  # the name recorded in checkpoints
    hf_class: str  # transformers' model class (config.json's architectures)
    options: str  # README: what the family maps to
    refused: str  # README: what is refused

    def __init__(self, config: ModelConfig):
        self.config = config

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        raise NotImplementedError

    def check_exportable(self) -> None:
        """Raise if the model has an option this family cannot express."""

    def hf_config(self, tokenizer_ids: dict):
        raise NotImplementedError

    def to_canonical(self, hf_state) -> dict:
        """The whole model's canonical tensors from an HF state (a dict, or a lazy mapping that reads each
        tensor when asked: hybrid.conversion.hf.HFTensors)."""
        out = self.globals_to_canonical(hf_state)
        for i in range(self.config.num_layers):
            out.update(self.layer_to_canonical(hf_state, i))
        return out

    def globals_to_canonical(self, hf_state, wanted=None) -> dict:
        """The tensors outside the transformer layers (embeddings, final norm, output head), those of
        `wanted` (canonical names) only when given."""
        raise NotImplementedError

    def layer_to_canonical(self, hf_state, i: int, wanted=None) -> dict:
        """Transformer layer `i`'s canonical tensors (reading only that layer's HF tensors; of an MoE layer's
        experts only those in `wanted`, canonical names, when given)."""
        raise NotImplementedError

    def to_hf(self, state: dict) -> dict:
        raise NotImplementedError


class GPT2Adapter(Adapter):
    family, hf_class = "gpt2", "GPT2LMHeadModel"
    options = "learned positions, LayerNorm, tanh-GeLU MLP, biases, tied head"
    refused = "`activation_function` other than gelu_new, `scale_attn_by_inverse_layer_idx`, `reorder_and_upcast_attn`"
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

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        if getattr(hf, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            _refuse("GPT-2", "activation_function", hf.activation_function, "only the tanh GeLU (gelu_new) matches")
        for field in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if getattr(hf, field, False):
                _refuse("GPT-2", field, True, "not implemented")
        return ModelConfig(num_layers=hf.n_layer, hidden_size=hf.n_embd, num_attention_heads=hf.n_head,
                           vocab_size=hf.vocab_size, max_position_embeddings=hf.n_positions,
                           ffn_hidden_size=hf.n_inner or 4 * hf.n_embd, norm_epsilon=hf.layer_norm_epsilon,
                           hidden_dropout=hf.resid_pdrop, attention_dropout=hf.attn_pdrop,
                           init_method_std=hf.initializer_range, family=cls.family, hf_dtype=dtype_of(hf))

    def check_exportable(self):
        c = self.config
        if not (c.position_embedding_type == "learned_absolute" and c.normalization == "LayerNorm"
                and not c.gated_linear_unit and c.add_bias_linear and c.tied_embeddings
                and c.num_query_groups == c.num_attention_heads and c.kv_channels in (None, c.head_dim)
                and c.hidden_size == c.num_attention_heads * c.head_dim and not _extras(c)):
            raise ConfigError("exporting to GPT2LMHeadModel needs learned positions, LayerNorm, GeLU, biases, a tied "
                              "head, no GQA and none of --qk-layernorm/--window-size/--apply-layernorm-1p/"
                              "--scale-embeddings.")

    def hf_config(self, tokenizer_ids: dict):
        from transformers import GPT2Config  # transformers' import takes seconds: only when a config is made
        c = self.config
        return GPT2Config(vocab_size=c.vocab_size, n_positions=c.max_position_embeddings, n_embd=c.hidden_size,
                          n_layer=c.num_layers, n_head=c.num_attention_heads, n_inner=c.ffn_hidden_size,
                          activation_function="gelu_new", layer_norm_epsilon=c.norm_epsilon,
                          resid_pdrop=c.hidden_dropout, embd_pdrop=c.hidden_dropout, attn_pdrop=c.attention_dropout,
                          initializer_range=c.init_method_std, tie_word_embeddings=True,
                          architectures=[self.hf_class], **tokenizer_ids)

    def _split(self, t):  # HF [q all | k all | v all] -> per head
        n = self.config.num_attention_heads
        return fuse_qkv(*t.chunk(3, dim=0), num_groups=n)

    def _join(self, t):
        return torch.cat(split_qkv_flat(t, 1, self.config.head_dim), dim=0)

    @staticmethod
    def _key(hf_state, name: str) -> str:
        """GPT-2 files name tensors with or without the `transformer.` prefix."""
        return name if name in hf_state else "transformer." + name

    def globals_to_canonical(self, hf_state, wanted=None):
        c, h = self.config, self.config.hidden_size
        out = {ours: get(hf_state, self._key(hf_state, hf_name)) for hf_name, ours in self.GLOBAL_MAP.items()
               if wanted is None or ours in wanted}
        if "embedding.word_embeddings.weight" in out:
            expect("wte.weight", out["embedding.word_embeddings.weight"], (c.vocab_size, h))
        return out

    def layer_to_canonical(self, hf_state, i, wanted=None):
        h = self.config.hidden_size
        out = {}
        for hf_tmpl, our_tmpl in self.LAYER_MAP.items():
            hf_name, ours = hf_tmpl.format(i), our_tmpl.format(i)
            t = get(hf_state, self._key(hf_state, hf_name))
            if hf_name.endswith("weight") and t.dim() == 2:
                t = t.t()  # Conv1D [in, out] -> Linear [out, in]
            if "c_attn" in hf_name:
                t = self._split(expect(hf_name, t, (3 * h, h) if t.dim() == 2 else (3 * h,)))
            out[ours] = t.contiguous()
        return out

    def to_hf(self, state):
        c = self.config
        out = {f"transformer.{hf}": state[ours] for hf, ours in self.GLOBAL_MAP.items()}
        for i in range(c.num_layers):
            for hf_tmpl, our_tmpl in self.LAYER_MAP.items():
                hf_name, t = hf_tmpl.format(i), state[our_tmpl.format(i)]
                if "c_attn" in hf_name:
                    t = self._join(t)
                if hf_name.endswith("weight") and t.dim() == 2:
                    t = t.t()
                out["transformer." + hf_name] = t.contiguous()
        return out  # lm_head.weight is tied to wte (transformers re-ties it on load)


def _extras(c: ModelConfig) -> list[str]:
    """The options only some Llama-family members have, as flags (for messages)."""
    named = {"--add-qkv-bias": c.add_qkv_bias, "--qk-layernorm": c.qk_layernorm, "--softmax-type learnable":
             c.attention_sinks, "--quick-geglu": c.quick_geglu, "--multi-latent-attention": c.multi_latent_attention,
             "--mtp-num-layers": bool(c.mtp_num_layers), "--num-experts": bool(c.num_experts),
             "--window-size": c.sliding_window is not None, "--apply-layernorm-1p": c.apply_layernorm_1p,
             "--geglu": c.geglu, "--scale-embeddings": c.scale_embeddings, **_gemma3_options(c)}
    return [flag for flag, on in named.items() if on]


def _gemma3_options(c: ModelConfig) -> dict:
    """Gemma 3's options, as flags: only its adapter exports them."""
    return {"--sandwich-norms": c.sandwich_norms, "--window-attn-skip-freq": c.window_attn_skip_freq is not None,
            "--local-rotary-base": c.local_rotary_base is not None, "--softmax-scale": c.softmax_scale is not None}


def _rope_of(hf, params: dict | None = None, partial: bool = False) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling or None) from transformers 5's rope_parameters (or 4.x's rope_theta /
    rope_scaling), or from `params` (one layer type's, Gemma 3); scaling types other than llama3 and linear
    are refused by name, and a `partial_rotary_factor` unless the family rotates part of each head (`partial`)."""
    if params is None:
        params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    params = dict(params)
    params.pop("partial_rotary_factor" if partial else "", None)
    theta = params.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind not in ("llama3", "linear", "yarn"):
        _refuse(type(hf).__name__, "rope_scaling.rope_type", kind, "only default, llama3, linear and yarn RoPE are "
                "implemented")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        _refuse(type(hf).__name__, "partial_rotary_factor", params["partial_rotary_factor"], "RoPE covers whole heads")
    if kind == "yarn":
        return float(theta), _yarn_of(hf, params)
    keys = ("factor",) + (("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                          if kind == "llama3" else ())
    return float(theta), {"rope_type": kind, **{k: params[k] for k in keys if k in params}}


def _yarn_of(hf, params: dict) -> dict:
    """transformers' YaRN fields with its defaults written out (factor: the context's growth; betas 32 and 1;
    truncate True is left out), so that equal settings give equal configs (architecture.yarn_scaling's form)."""
    factor = params.get("factor") or hf.max_position_embeddings / params["original_max_position_embeddings"]
    scaling = {"rope_type": "yarn", "factor": float(factor),
               "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
               "beta_fast": float(params.get("beta_fast") or 32.0), "beta_slow": float(params.get("beta_slow") or 1.0)}
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if params.get(key) is not None:
            scaling[key] = float(params[key])
    if params.get("truncate", True) is False:
        scaling["truncate"] = False
    return scaling



SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types (Gemma 3, GPT-OSS)


def sliding_layers(hf, family: str) -> list:
    """1 per windowed layer of transformers' `layer_types` (other kinds refused by name)."""
    unknown = set(hf.layer_types) - {SLIDING, FULL}
    if unknown:
        _refuse(family, "layer_types", sorted(unknown), "only sliding_attention and full_attention layers exist")
    return [int(kind == SLIDING) for kind in hf.layer_types]


def layer_types(c: ModelConfig) -> list:
    """transformers' `layer_types` of the model's windowed and full layers (ModelConfig.layer_window)."""
    return [SLIDING if c.layer_window(i) is not None else FULL for i in range(c.num_layers)]


def window_pattern(sliding: list):
    """Which layers attend through the window (1 per layer), as Megatron-LM's --window-attn-skip-freq writes it:
    N where every N-th layer (1-based) is the full one, else the list; None when every layer is windowed."""
    if all(sliding):
        return None
    for n in range(2, len(sliding) + 1):
        if sliding == [int((i + 1) % n != 0) for i in range(len(sliding))]:
            return n
    return sliding


def _window_of(hf, family: str):
    """The sliding window every layer uses, or None; alternating local/global layers are refused."""
    layer_types = getattr(hf, "layer_types", None)
    window = getattr(hf, "sliding_window", None)
    if layer_types and "sliding_attention" in layer_types:
        if set(layer_types) != {"sliding_attention"}:
            _refuse(family, "layer_types", "mixed sliding/full", "alternating local and global attention layers are "
                    "not implemented (every layer uses the same attention)")
        return int(window)
    if layer_types and family.startswith(("Qwen2", "Qwen3")):
        return None  # sliding_window is set but no layer uses it (use_sliding_window false)
    return int(window) if window else None


class LlamaAdapter(Adapter):
    """Llama and the families that change a few of its options (subclasses below)."""

    family, hf_class, config_class = "llama", "LlamaForCausalLM", "LlamaConfig"
    options = "RoPE (default, llama3 and linear scaling), RMSNorm, SwiGLU, no biases, GQA, any head_dim, tied or untied"
    refused = ("`attention_bias`, `mlp_bias`, `rope_scaling` types other than llama3/linear/yarn, "
               "`partial_rotary_factor` < 1, quantized weights (`quantization_config`)")
    hidden_act = "silu"
    qkv_bias = False  # the HF class always has Q/K/V biases (Qwen2)
    qk_norm = False  # per-head Q/K RMSNorm (Qwen3)
    windowed = False  # sliding_window is part of the config (Mistral, Qwen2/3)
    gemma = False  # (1 + w) RMSNorm, GeGLU, embeddings x sqrt(hidden)
    gemma3 = False  # Gemma 3's options (_gemma3_options) may be on
    partial_rotary = False  # rope may rotate part of each head (`partial_rotary_factor` = --rotary-percent)
    mla = False  # multi-latent attention (DeepSeek-V3)
    stores_mtp = False  # multi-token prediction layers in the checkpoint (_StoredMTP)
    REFUSED_BIASES = ("attention_bias", "mlp_bias")  # HF bias options this family's model does not have
    LAYER_MAP = {"model.layers.{}.input_layernorm.weight": "layers.{}.input_norm.weight",
                 "model.layers.{}.post_attention_layernorm.weight": "layers.{}.post_attention_norm.weight",
                 "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.dense.weight"}
    QK_NORM_MAP = {"model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",
                   "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight"}

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        name = cls.hf_class.replace("ForCausalLM", "")
        quantization = getattr(hf, "quantization_config", None)
        if quantization:  # (DeepSeek-V3's and Kimi-K2's FP8 blocks with their weight_scale_inv, GPT-OSS's MXFP4, ...)
            method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else \
                getattr(quantization, "quant_method", "?")
            _refuse(name, "quantization_config", method, "quantized weights are read as they are stored, without "
                    "their scales; load the model with transformers and save_pretrained it dequantized (bf16)")
        for field in cls.REFUSED_BIASES:
            if getattr(hf, field, False):
                _refuse(name, field, True, "biases on the output projection and MLP of this family are not "
                        "implemented (Qwen2's Q/K/V-only bias is)")
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", cls.hidden_act)
        if act != cls.hidden_act:
            _refuse(name, "hidden_act", act, f"this family's MLP is {cls.hidden_act}-gated")
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(hf, field, None):
                _refuse(name, field, getattr(hf, field), "logit soft-capping is not implemented")
        theta, scaling = cls._rope(hf)
        window = cls._window(hf, name)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return ModelConfig(
            num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
            num_query_groups=hf.num_key_value_heads or hf.num_attention_heads, vocab_size=hf.vocab_size,
            max_position_embeddings=hf.max_position_embeddings, ffn_hidden_size=hf.intermediate_size,
            position_embedding_type="rope", rotary_base=theta, rope_scaling=scaling, normalization="RMSNorm",
            norm_epsilon=hf.rms_norm_eps, swiglu=not cls.gemma, geglu=cls.gemma, add_bias_linear=False,
            add_qkv_bias=cls.qkv_bias, qk_layernorm=cls.qk_norm, sliding_window=window,
            kv_channels=None if head_dim * hf.num_attention_heads == hf.hidden_size else head_dim,
            apply_layernorm_1p=cls.gemma, scale_embeddings=cls.gemma,
            untie_embeddings_and_output_weights=not getattr(hf, "tie_word_embeddings", False),
            hidden_dropout=0.0, attention_dropout=float(getattr(hf, "attention_dropout", 0.0)),
            init_method_std=hf.initializer_range, family=cls.family, hf_dtype=dtype_of(hf))

    @classmethod
    def _rope(cls, hf) -> tuple:
        return _rope_of(hf)

    @classmethod
    def _window(cls, hf, name: str):
        return _window_of(hf, name) if cls.windowed else None

    def check_exportable(self):
        c = self.config
        others = [flag for flag, on in _gemma3_options(c).items() if on and not self.gemma3]
        wanted = {"rope": c.position_embedding_type == "rope", "RMSNorm": c.normalization == "RMSNorm",
                  f"none of {', '.join(others)}": not others,
                  "--disable-bias-linear": not c.add_bias_linear,
                  ("--geglu" if self.gemma else "--swiglu"): c.geglu if self.gemma else c.swiglu,
                  "--add-qkv-bias" + ("" if self.qkv_bias else " off"): c.add_qkv_bias == self.qkv_bias,
                  "--qk-layernorm" + ("" if self.qk_norm else " off"): c.qk_layernorm == self.qk_norm,
                  "--apply-layernorm-1p and --scale-embeddings" + ("" if self.gemma else " off"):
                      c.apply_layernorm_1p == self.gemma and c.scale_embeddings == self.gemma,
                  "no --window-size": self.windowed or c.sliding_window is None,
                  "no --rotary-percent": self.partial_rotary or c.rotary_percent == 1.0,
                  "--sandwich-norms" + ("" if self.gemma3 else " off"): c.sandwich_norms == self.gemma3,
                  "no --softmax-type learnable, --quick-geglu (GPT-OSS's)": not (c.attention_sinks or c.quick_geglu),
                  "--multi-latent-attention" + ("" if self.mla else " off"): c.multi_latent_attention == self.mla,
                  "no --mtp-num-layers (DeepSeek-V3's and GLM-4.5's layers)": self.stores_mtp or not c.mtp_num_layers}
        missing = [what for what, ok in wanted.items() if not ok]
        if missing:
            raise ConfigError(f"exporting to {self.hf_class} needs {', '.join(missing)}.")

    def family_fields(self) -> dict:
        return {}

    def hf_config(self, tokenizer_ids: dict):
        import transformers  # transformers' import takes seconds: only when a config is made
        c = self.config
        rope = {"rope_type": "default", "rope_theta": c.rotary_base} if not c.rope_scaling else \
            dict(c.rope_scaling, rope_theta=c.rotary_base)
        fields = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_query_groups, head_dim=c.head_dim,
                      max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.norm_epsilon,
                      rope_parameters=rope, tie_word_embeddings=c.tied_embeddings, hidden_act=self.hidden_act,
                      initializer_range=c.init_method_std, attention_dropout=c.attention_dropout,
                      architectures=[self.hf_class], **tokenizer_ids)
        fields.update(self.family_fields())  # a family's own fields (and its spelling of shared ones)
        return getattr(transformers, self.config_class)(**fields)

    def globals_to_canonical(self, hf_state, wanted=None):
        c, h = self.config, self.config.hidden_size
        names = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                 "final_norm.weight": "model.norm.weight"}
        if c.untie_embeddings_and_output_weights:
            names["output_layer.weight"] = "lm_head.weight"
        out = {ours: get(hf_state, hf) for ours, hf in names.items() if wanted is None or ours in wanted}
        for ours in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if ours in out:
                expect(names[ours], out[ours], (c.vocab_size, h))
        return out

    def layer_to_canonical(self, hf_state, i, wanted=None):
        out = {}
        self.attention_to_canonical(hf_state, i, out)
        self.mlp_to_canonical(hf_state, i, out, wanted)
        for hf_tmpl, our_tmpl in self._layer_map().items():
            out[our_tmpl.format(i)] = get(hf_state, hf_tmpl.format(i))
        return out

    def attention_to_canonical(self, hf_state, i: int, out: dict) -> None:
        """q/k/v projections (and biases) -> the fused QKV (hybrid.model.qkv)."""
        c = self.config
        groups, d, h = c.num_query_groups, c.head_dim, c.hidden_size
        per_group = c.num_attention_heads // groups
        shapes = {"q": (groups * per_group * d,), "k": (groups * d,), "v": (groups * d,)}
        p = f"model.layers.{i}.self_attn."
        for kind in ("weight", "bias") if self.qkv_bias else ("weight",):
            tail = (h,) if kind == "weight" else ()
            q, k, v = (expect(f"{p}{x}_proj.{kind}", get(hf_state, f"{p}{x}_proj.{kind}"), shapes[x] + tail)
                       for x in "qkv")
            out[f"layers.{i}.attention.qkv.{kind}"] = fuse_qkv(q, k, v, groups)

    def attention_to_hf(self, state: dict, i: int, out: dict) -> None:
        c = self.config
        per_group, d = c.num_attention_heads // c.num_query_groups, c.head_dim
        for kind in ("weight", "bias") if self.qkv_bias else ("weight",):
            q, k, v = split_qkv_flat(state[f"layers.{i}.attention.qkv.{kind}"], per_group, d)
            for x, t in zip("qkv", (q, k, v)):
                out[f"model.layers.{i}.self_attn.{x}_proj.{kind}"] = t

    def _layer_map(self) -> dict:
        return dict(self.LAYER_MAP, **(self.QK_NORM_MAP if self.qk_norm else {}))

    @staticmethod
    def _gated_to_canonical(hf_state: dict, hf_prefix: str, ours: str, out: dict, names=("gate_proj", "up_proj",
                                                                                         "down_proj")) -> None:
        """A gated MLP's gate/up/down projections -> fc1 = [gate; up], fc2."""
        gate, up, down = (get(hf_state, f"{hf_prefix}{n}.weight") for n in names)
        out[f"{ours}fc1.weight"], out[f"{ours}fc2.weight"] = torch.cat([gate, up], dim=0), down

    @staticmethod
    def _gated_to_hf(state: dict, ours: str, hf_prefix: str, out: dict, names=("gate_proj", "up_proj",
                                                                               "down_proj")) -> None:
        gate, up = state[f"{ours}fc1.weight"].chunk(2, dim=0)
        for n, t in zip(names, (gate, up, state[f"{ours}fc2.weight"])):
            out[f"{hf_prefix}{n}.weight"] = t.contiguous()

    def mlp_to_canonical(self, hf_state: dict, i: int, out: dict, wanted=None) -> None:
        self._gated_to_canonical(hf_state, f"model.layers.{i}.mlp.", f"layers.{i}.mlp.", out)

    def mlp_to_hf(self, state: dict, i: int, out: dict) -> None:
        self._gated_to_hf(state, f"layers.{i}.mlp.", f"model.layers.{i}.mlp.", out)

    def to_hf(self, state):
        self.check_exportable()
        c = self.config
        out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
               "model.norm.weight": state["final_norm.weight"]}
        if c.untie_embeddings_and_output_weights:
            out["lm_head.weight"] = state["output_layer.weight"]
        for i in range(c.num_layers):
            self.layer_to_hf(state, i, out)
        return out

    def layer_to_hf(self, state: dict, i: int, out: dict) -> None:
        """Transformer layer `i`'s HF tensors (model.layers.{i}.*) from canonical `state`."""
        self.attention_to_hf(state, i, out)
        self.mlp_to_hf(state, i, out)
        for hf_tmpl, our_tmpl in self._layer_map().items():
            out[hf_tmpl.format(i)] = state[our_tmpl.format(i)]


class MistralAdapter(LlamaAdapter):
    family, hf_class, config_class = "mistral", "MistralForCausalLM", "MistralConfig"
    options = "Llama's, plus sliding-window attention (`sliding_window` = --window-size)"
    refused = "`layer_types` (alternating attention: Ministral), as Llama's"
    windowed = True

    def family_fields(self):
        return {"sliding_window": self.config.sliding_window}


class Qwen2Adapter(LlamaAdapter):
    family, hf_class, config_class = "qwen2", "Qwen2ForCausalLM", "Qwen2Config"
    options = "Llama's, plus a bias on Q, K and V only (--add-qkv-bias); a sliding window on every layer"
    refused = "a sliding window on some layers only (`max_window_layers` < `num_hidden_layers`), as Llama's"
    qkv_bias, windowed = True, True

    def family_fields(self):
        w = self.config.sliding_window  # a window on every layer (max_window_layers 0), or none
        return {"use_sliding_window": True, "sliding_window": w, "max_window_layers": 0} if w else {}


class Qwen3Adapter(Qwen2Adapter):
    family, hf_class, config_class = "qwen3", "Qwen3ForCausalLM", "Qwen3Config"
    options = "Llama's, plus per-head RMSNorm on Q and K (--qk-layernorm), head_dim = --kv-channels"
    refused = "`attention_bias` (on Q, K, V and O), a sliding window on some layers only, as Llama's"
    qkv_bias, qk_norm = False, True


class GemmaAdapter(LlamaAdapter):
    family, hf_class, config_class = "gemma", "GemmaForCausalLM", "GemmaConfig"
    options = ("GeGLU with tanh GeLU (--geglu), RMSNorm x (1 + weight) (--apply-layernorm-1p), embeddings x "
               "sqrt(hidden) (--scale-embeddings), head_dim = --kv-channels")
    refused = "Gemma 2 (soft-capping; another class; Gemma 3 is the `gemma3` family), as Llama's"
    hidden_act, gemma = "gelu_pytorch_tanh", True

    def family_fields(self):
        return {"hidden_activation": self.hidden_act}


class Gemma3Adapter(GemmaAdapter):
    family, hf_class, config_class = "gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig"
    options = ("Gemma's, plus (1 + w) RMSNorm over each head of Q and K (--qk-layernorm), norms on the attention's "
               "and the MLP's outputs (--sandwich-norms), sliding-window and full layers (`layer_types`: --window-size "
               "with --window-attn-skip-freq), each with its own rope base (--local-rotary-base; linear or llama3 "
               "scaling on the full layers), `query_pre_attn_scalar` (--softmax-scale); text only")
    refused = "soft-capping, bidirectional attention, rope scaling on the sliding layers, as Llama's"
    qk_norm, windowed, gemma3 = True, True, True
    LAYER_MAP = {"model.layers.{}.input_layernorm.weight": "layers.{}.input_norm.weight",
                 "model.layers.{}.post_attention_layernorm.weight": "layers.{}.attention_output_norm.weight",
                 "model.layers.{}.pre_feedforward_layernorm.weight": "layers.{}.post_attention_norm.weight",
                 "model.layers.{}.post_feedforward_layernorm.weight": "layers.{}.mlp_output_norm.weight",
                 "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.dense.weight"}
    @classmethod
    def _rope(cls, hf) -> tuple:
        return _rope_of(hf, hf.rope_parameters[FULL])

    @classmethod
    def _window(cls, hf, name: str):
        return int(hf.sliding_window) if SLIDING in hf.layer_types else None

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        name = cls.hf_class.replace("ForCausalLM", "")
        if getattr(hf, "use_bidirectional_attention", False):
            _refuse(name, "use_bidirectional_attention", True, "attention here is causal")
        sliding = sliding_layers(hf, name)
        config = super().config_from_hf(hf)
        local_base = None
        if any(sliding):
            local_base, local_scaling = _rope_of(hf, hf.rope_parameters[SLIDING])
            if local_scaling and (local_scaling, local_base) != (config.rope_scaling, config.rotary_base):
                _refuse(name, "rope_parameters.sliding_attention", hf.rope_parameters[SLIDING],
                        "the sliding layers' rope is unscaled here, or the full layers' own")
            if local_scaling:  # the full layers' rope on every layer
                local_base = None
        head_dim = config.head_dim
        scale = float(hf.query_pre_attn_scalar) ** -0.5
        return dataclasses.replace(
            config, sandwich_norms=True, window_attn_skip_freq=window_pattern(sliding) if any(sliding) else None,
            local_rotary_base=local_base, softmax_scale=None if scale == head_dim ** -0.5 else scale)

    def family_fields(self):
        c = self.config
        kinds = layer_types(c)
        ropes = {}
        for i, kind in enumerate(kinds):  # each kind's rope, as the model computes it (ModelConfig.layer_rope)
            base, scaling = c.layer_rope(i)
            ropes[kind] = dict(scaling, rope_theta=base) if scaling else {"rope_type": "default", "rope_theta": base}
        for kind in (SLIDING, FULL):  # a kind no layer has: the other's
            ropes.setdefault(kind, ropes[FULL if kind == SLIDING else SLIDING])
        return dict(super().family_fields(), layer_types=kinds, sliding_window=c.sliding_window or 4096,
                    rope_parameters=ropes, query_pre_attn_scalar=self._pre_attn_scalar())

    def _pre_attn_scalar(self):
        c = self.config
        if c.softmax_scale is None:
            return c.head_dim
        scalar = c.softmax_scale ** -2
        return round(scalar) if round(scalar) > 0 and abs(scalar - round(scalar)) < 1e-6 else None

    def check_exportable(self):
        super().check_exportable()
        if self._pre_attn_scalar() is None:
            raise ConfigError(f"exporting to Gemma3ForCausalLM: --softmax-scale {self.config.softmax_scale} is not "
                              f"1/sqrt(n) for a whole n (its query_pre_attn_scalar is an integer).")


class _MoEFamily:
    """Mixture-of-experts members of the Llama family (mixed in before their dense adapter): the router
    (`gate.weight`) and every expert's gate/up/down projections of each MoE layer, optional shared
    experts; dense layers as the dense adapter maps them."""

    moe_block = "mlp"  # the HF module of a layer's router and experts
    expert_names = ("gate_proj", "up_proj", "down_proj")  # an expert's projections: gate, up, down
    shared = False  # shared experts every token sees
    shared_block = "shared_expert"  # their HF module
    shared_gated = True  # scaled by sigmoid(x w) (Qwen2-MoE's `shared_expert_gate`)
    sigmoid_routing = False  # DeepSeek's router: sigmoid scores, a score bias, groups, a scaling factor

    @classmethod
    def _moe_config(cls, hf, config: ModelConfig) -> ModelConfig:
        raise NotImplementedError

    @classmethod
    def config_from_hf(cls, hf) -> ModelConfig:
        return cls._moe_config(hf, super().config_from_hf(hf))

    def check_exportable(self):
        super().check_exportable()
        c = self.config
        shared = bool(c.moe_shared_expert_intermediate_size)
        wanted = {"--num-experts": bool(c.num_experts),
                  ("--moe-shared-expert-intermediate-size" if self.shared else "no shared experts"):
                      shared == self.shared,
                  "--moe-shared-expert-gate" + ("" if self.shared_gated else " off"):
                      not shared or c.moe_shared_expert_gate == self.shared_gated, **self._moe_wanted()}
        if not self.sigmoid_routing:
            wanted.update({"--moe-router-score-function softmax": c.moe_router_score_function == "softmax",
                           "no --moe-router-topk-scaling-factor": not c.moe_router_topk_scaling_factor,
                           "no --moe-router-enable-expert-bias": not c.moe_router_enable_expert_bias,
                           "no --moe-router-num-groups": not c.moe_router_num_groups})
        missing = [what for what, ok in wanted.items() if not ok]
        if missing:
            raise ConfigError(f"exporting to {self.hf_class} needs {', '.join(missing)}.")

    def _moe_wanted(self) -> dict:
        return {}

    def mlp_to_canonical(self, hf_state, i, out, wanted=None):
        c = self.config
        if c.mlp_type_of(i) != "moe":
            return super().mlp_to_canonical(hf_state, i, out, wanted)
        hf, ours = f"model.layers.{i}.{self.moe_block}.", f"layers.{i}.mlp."
        out[ours + "router.weight"] = expect(hf + "gate.weight", get(hf_state, hf + "gate.weight"),
                                             (c.num_experts, c.hidden_size))
        if self.sigmoid_routing:
            name = hf + "gate.e_score_correction_bias"
            out[ours + "router.score_bias"] = expect(name, get(hf_state, name), (c.num_experts,))
        for e in range(c.num_experts):
            expert = f"{ours}{EXPERTS[1:]}{e}."
            if wanted is None or f"{expert}fc1.weight" in wanted:  # an EP rank reads its own experts only
                self._gated_to_canonical(hf_state, f"{hf}experts.{e}.", expert, out, self.expert_names)
        if self.shared:
            self._gated_to_canonical(hf_state, f"{hf}{self.shared_block}.", ours + "shared_mlp.", out)
            if self.shared_gated:
                out[ours + "shared_gate"] = get(hf_state, hf + "shared_expert_gate.weight")

    def mlp_to_hf(self, state, i, out):
        c = self.config
        if c.mlp_type_of(i) != "moe":
            return super().mlp_to_hf(state, i, out)
        hf, ours = f"model.layers.{i}.{self.moe_block}.", f"layers.{i}.mlp."
        out[hf + "gate.weight"] = state[ours + "router.weight"]
        if self.sigmoid_routing:  # a router without a score bias routes as one of zeros
            out[hf + "gate.e_score_correction_bias"] = state.get(ours + "router.score_bias",
                                                                 torch.zeros(c.num_experts))
        for e in range(c.num_experts):
            self._gated_to_hf(state, f"{ours}{EXPERTS[1:]}{e}.", f"{hf}experts.{e}.", out, self.expert_names)
        if self.shared:
            self._gated_to_hf(state, ours + "shared_mlp.", f"{hf}{self.shared_block}.", out)
            if self.shared_gated:
                out[hf + "shared_expert_gate.weight"] = state[ours + "shared_gate"]


class _StoredMTP:
    """DeepSeek's multi-token prediction layers as its checkpoints (and GLM-4.5's) store them: model.layers.{L + k}.*
    are depth k's layer (named as a decoder layer) and its own tensors (hybrid.model.mtp), read as --mtp-num-layers
    and written back. Mixed in before the family's adapter."""

    stores_mtp = True

    # a multi-token prediction layer's own tensors, model.layers.{L + k}.* -> mtp.{k}.* (hybrid.model.mtp); it also
    # holds copies of the word embeddings (embed_tokens) and of the head (shared_head.head), written, not read
    MTP_MAP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
               "shared_head.norm.weight": "final_norm.weight"}

    @classmethod
    def with_stored_layers(cls, config: ModelConfig, names) -> ModelConfig:
        """The checkpoint's multi-token prediction layers (model.layers.{L + k}.eh_proj, as DeepSeek stores them)
        become --mtp-num-layers."""
        depth = 0
        while f"model.layers.{config.num_layers + depth}.eh_proj.weight" in names:
            depth += 1
        return _replace(config, mtp_num_layers=depth) if depth else config

    def _mtp_state(self, state: dict, k: int) -> dict:
        """MTP layer k's transformer layer under the canonical names of decoder layer L + k (its HF number)."""
        inner, as_layer = f"mtp.{k}.layer.", f"layers.{self.config.num_layers + k}."
        return {as_layer + n[len(inner):]: t for n, t in state.items() if n.startswith(inner)}

    def globals_to_canonical(self, hf_state, wanted=None):
        out = super().globals_to_canonical(hf_state, None if wanted is None else
                                           {n for n in wanted if not n.startswith("mtp.")})
        c = self.config
        for k in range(c.mtp_num_layers or 0):
            hf, ours, i = f"model.layers.{c.num_layers + k}.", f"mtp.{k}.", c.num_layers + k
            if wanted is not None and not any(n.startswith(ours) for n in wanted):
                continue
            if hf + "eh_proj.weight" not in hf_state:  # none stored: they start from their initialisation
                continue
            for theirs, name in self.MTP_MAP.items():
                out[ours + name] = get(hf_state, hf + theirs)
            inner = None if wanted is None else {n.replace(ours + "layer.", f"layers.{i}.") for n in wanted}
            for name, t in self.layer_to_canonical(hf_state, i, inner).items():
                out[ours + "layer." + name[len(f"layers.{i}."):]] = t
        return out

    def to_hf(self, state):
        out = super().to_hf(state)
        c = self.config
        for k in range(c.mtp_num_layers or 0):
            hf, ours, i = f"model.layers.{c.num_layers + k}.", f"mtp.{k}.", c.num_layers + k
            self.layer_to_hf(self._mtp_state(state, k), i, out)
            for theirs, name in self.MTP_MAP.items():
                out[hf + theirs] = state[ours + name]
            out[hf + "embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()  # (files hold each once)
            out[hf + "shared_head.head.weight"] = out.get("lm_head.weight", out["model.embed_tokens.weight"]).clone()
        return out



class _DeepSeekMoE(_MoEFamily):
    """DeepSeek-V3's mixture of experts (also GLM-4.5's): sigmoid scores, the score bias
    (`e_score_correction_bias`) choosing, group-limited top-k (`n_group`, `topk_group`: groups scored by their
    top 2), renormalised (`norm_topk_prob`) and scaled (`routed_scaling_factor`) weights, ungated shared experts
    (`n_shared_experts` x the expert width) and the first `first_k_dense_replace` layers dense."""

    shared, shared_block, shared_gated, sigmoid_routing = True, "shared_experts", False, True

    @classmethod
    def _moe_config(cls, hf, config):
        name = cls.hf_class.replace("ForCausalLM", "")
        experts, k = int(hf.n_routed_experts), int(hf.num_experts_per_tok)
        if bool(hf.norm_topk_prob) != (k > 1):  # Megatron's sigmoid router renormalises top-k > 1 only
            _refuse(name, "norm_topk_prob", hf.norm_topk_prob, f"with num_experts_per_tok {k}, the sigmoid router "
                    f"renormalises the top-k weights exactly when k > 1 (as Megatron-LM's)")
        groups, chosen = int(hf.n_group or 1), int(hf.topk_group or 1)
        if chosen >= groups:  # every group is chosen: plain top-k
            groups = chosen = None
        elif k // chosen != 2:
            _refuse(name, "topk_group", chosen, f"a group is scored by its top 2 experts there and by its top "
                    f"num_experts_per_tok // topk_group = {k // chosen} in Megatron-LM's group-limited routing")
        dense = int(hf.first_k_dense_replace)
        shared = int(hf.n_shared_experts or 0) * int(hf.moe_intermediate_size)
        scale = float(hf.routed_scaling_factor)
        return _replace(config, num_experts=experts, moe_router_topk=k,
                        moe_ffn_hidden_size=int(hf.moe_intermediate_size),
                        moe_layer_freq=1 if dense == 0 else [int(i >= dense) for i in range(hf.num_hidden_layers)],
                        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                        moe_router_dtype="fp32",  # (transformers' router: F.linear of fp32 casts)
                        moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
                        moe_router_num_groups=groups, moe_router_group_topk=chosen,
                        moe_shared_expert_intermediate_size=shared or None)

    def _first_dense(self):
        c = self.config
        dense = next((i for i in range(c.num_layers) if c.mlp_type_of(i) == "moe"), c.num_layers)
        return dense if all(c.mlp_type_of(i) == "moe" for i in range(dense, c.num_layers)) else None

    def _moe_wanted(self):
        c = self.config
        if not c.num_experts:
            return {}  # (--num-experts is wanted first)
        k, chosen = c.moe_router_topk, c.moe_router_group_topk
        return {"--moe-router-score-function sigmoid": c.moe_router_score_function == "sigmoid",
                "dense layers first, then MoE layers only (--moe-layer-freq)": self._first_dense() is not None,
                "--moe-shared-expert-intermediate-size a multiple of --moe-ffn-hidden-size":
                    (c.moe_shared_expert_intermediate_size or 0) % c.moe_ffn_hidden_size == 0,
                "--moe-router-topk // --moe-router-group-topk = 2 (groups are scored by their top 2)":
                    not chosen or chosen >= c.moe_router_num_groups or k // chosen == 2}

    def family_fields(self):
        c = self.config
        return dict(super().family_fields(), n_routed_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk,
                    moe_intermediate_size=c.moe_ffn_hidden_size,
                    n_shared_experts=c.moe_shared_expert_intermediate_size // c.moe_ffn_hidden_size,
                    routed_scaling_factor=c.moe_router_topk_scaling_factor or 1.0,
                    n_group=c.moe_router_num_groups or 1, topk_group=c.moe_router_group_topk or 1,
                    first_k_dense_replace=self._first_dense(), norm_topk_prob=c.moe_router_topk > 1)


def _replace(config: ModelConfig, **fields) -> ModelConfig:
    return dataclasses.replace(config, **fields)


class MixtralAdapter(_MoEFamily, MistralAdapter):
    family, hf_class, config_class = "mixtral", "MixtralForCausalLM", "MixtralConfig"
    options = ("Mistral's, every layer a mixture of experts: softmax top-k renormalised (--num-experts, "
               "--moe-router-topk)")
    refused = "`router_jitter_noise` > 0, as Mistral's"
    moe_block, expert_names = "block_sparse_moe", ("w1", "w3", "w2")  # on disk (transformers 5 fuses them on load)

    @classmethod
    def _moe_config(cls, hf, config):
        if getattr(hf, "router_jitter_noise", 0.0):
            _refuse("Mixtral", "router_jitter_noise", hf.router_jitter_noise, "routing noise is not implemented")
        return _replace(config, num_experts=hf.num_local_experts, moe_router_topk=hf.num_experts_per_tok,
                        moe_ffn_hidden_size=hf.intermediate_size, moe_layer_freq=1)

    def _moe_wanted(self):
        c = self.config
        return {"--moe-layer-freq 1": all(c.mlp_type_of(i) == "moe" for i in range(c.num_layers)),
                "no --moe-router-pre-softmax": not c.moe_router_pre_softmax,
                "--moe-ffn-hidden-size = --ffn-hidden-size": c.moe_ffn_hidden_size == c.ffn_hidden_size}

    def family_fields(self):
        c = self.config
        fields = dict(super().family_fields(), num_local_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk)
        if c.kv_channels is None:
            fields["head_dim"] = None  # MixtralConfig keeps the default head size unset
        return fields


def _qwen_moe_config(hf, config, shared: bool) -> ModelConfig:
    """Qwen2-MoE / Qwen3-MoE: MoE where (layer + 1) % decoder_sparse_step == 0 and not in mlp_only_layers;
    norm_topk_prob renormalises the top-k softmax probabilities (without it: softmax, then top-k)."""
    experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts")
    step, dense = int(getattr(hf, "decoder_sparse_step", 1) or 1), set(getattr(hf, "mlp_only_layers", None) or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(hf.num_hidden_layers)]
    fields = dict(num_experts=experts, moe_router_topk=hf.num_experts_per_tok,
                  moe_ffn_hidden_size=hf.moe_intermediate_size,
                  moe_layer_freq=1 if all(pattern) else pattern, moe_router_pre_softmax=not hf.norm_topk_prob)
    if shared:
        fields.update(moe_shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
                      moe_shared_expert_gate=True)
    return _replace(config, **fields)


def _qwen_moe_fields(c: ModelConfig, shared: bool) -> dict:
    fields = dict(num_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk,
                  moe_intermediate_size=c.moe_ffn_hidden_size, norm_topk_prob=not c.moe_router_pre_softmax,
                  decoder_sparse_step=1, mlp_only_layers=[i for i in range(c.num_layers) if c.mlp_type_of(i) != "moe"])
    if shared:
        fields["shared_expert_intermediate_size"] = c.moe_shared_expert_intermediate_size
    return fields


class Qwen2MoeAdapter(_MoEFamily, Qwen2Adapter):
    family, hf_class, config_class = "qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig"
    options = ("Qwen2's, MoE layers by decoder_sparse_step / mlp_only_layers (--moe-layer-freq), a sigmoid-gated "
               "shared expert, norm_topk_prob (off: --moe-router-pre-softmax)")
    refused = "as Qwen2's"
    shared = True  # sigmoid-gated

    @classmethod
    def _moe_config(cls, hf, config):
        return _qwen_moe_config(hf, config, shared=True)

    def family_fields(self):
        return dict(super().family_fields(), **_qwen_moe_fields(self.config, shared=True))


class Qwen3MoeAdapter(_MoEFamily, Qwen3Adapter):
    family, hf_class, config_class = "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig"
    options = "Qwen3's, MoE layers by decoder_sparse_step / mlp_only_layers, norm_topk_prob, no shared expert"
    refused = "as Qwen3's"

    @classmethod
    def _moe_config(cls, hf, config):
        return _qwen_moe_config(hf, config, shared=False)

    def family_fields(self):
        return dict(super().family_fields(), **_qwen_moe_fields(self.config, shared=False))


class Glm4MoeAdapter(_StoredMTP, _DeepSeekMoE, LlamaAdapter):
    family, hf_class, config_class = "glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeConfig"
    options = ("Llama's, rope on part of each head (`partial_rotary_factor` = --rotary-percent), optional Q/K/V "
               "biases (`attention_bias` = --add-qkv-bias) and per-head Q/K norms (`use_qk_norm` = --qk-layernorm); "
               "DeepSeek's MoE: sigmoid routing with the score bias (--moe-router-enable-expert-bias; its GEMM in "
               "fp32: --moe-router-dtype fp32), groups "
               "(--moe-router-num-groups / --moe-router-group-topk), `routed_scaling_factor` "
               "(--moe-router-topk-scaling-factor), shared experts, the first layers dense (--moe-layer-freq)")
    refused = ("`norm_topk_prob` off with top-k > 1, `topk_group` with topk // topk_group != 2, as Llama's; its MTP "
               "layers (model.layers.{L + k}) are read and written as --mtp-num-layers")
    partial_rotary = True
    REFUSED_BIASES = ("mlp_bias",)  # `attention_bias` is Q/K/V's (the output projection never has one)

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.qkv_bias, self.qk_norm = config.add_qkv_bias, config.qk_layernorm  # either way, as the config says

    @classmethod
    def _rope(cls, hf):
        return _rope_of(hf, partial=True)

    @classmethod
    def config_from_hf(cls, hf):
        params = getattr(hf, "rope_parameters", None) or {}
        percent = float(params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)) or 1.0)
        return _replace(super().config_from_hf(hf), add_qkv_bias=bool(hf.attention_bias),
                        qk_layernorm=bool(hf.use_qk_norm), rotary_percent=percent)

    def family_fields(self):
        c = self.config
        rope = {"rope_type": "default"} if not c.rope_scaling else dict(c.rope_scaling)
        return dict(super().family_fields(), attention_bias=c.add_qkv_bias, use_qk_norm=c.qk_layernorm,
                    rope_parameters=dict(rope, rope_theta=c.rotary_base, partial_rotary_factor=c.rotary_percent),
                    num_nextn_predict_layers=c.mtp_num_layers or 0)


def _rope_order(pos: int, interleaved_to_halves: bool) -> torch.Tensor:
    """The rope features' order: DeepSeek's checkpoints hold each rotated pair side by side (x0, x1), (x2, x3),
    ... and rotate them de-interleaved, [x0, x2, ... | x1, x3, ...] (transformers' apply_rotary_pos_emb_interleave,
    megatron-core's MLA); the model here rotates halves, so the rows making those features are permuted."""
    halves = torch.cat([torch.arange(0, pos, 2), torch.arange(1, pos, 2)])
    return halves if interleaved_to_halves else torch.argsort(halves)


def permute_rope_rows(t: torch.Tensor, block: int, pos: int, to_halves: bool) -> torch.Tensor:
    """`t` [blocks x block, ...] with the rope features last in each block: those rows reordered (_rope_order)."""
    blocks = t.reshape(-1, block, *t.shape[1:])
    order = torch.cat([torch.arange(block - pos), block - pos + _rope_order(pos, to_halves)])
    return blocks[:, order].reshape(t.shape).contiguous()


# transformers' DeepseekV3Attention builds q_a_layernorm / kv_a_layernorm with its default eps
HF_LATENT_NORM_EPS = 1e-6


def mla_rope_blocks(config: ModelConfig) -> dict:
    """MLA's projections whose rows make rope features (canonical names inside a layer) -> the size of their row
    blocks, the rope features last in each: a head of the query, the whole kv down projection (latent, then the
    shared rope key)."""
    head = config.qk_head_dim + config.qk_pos_emb_head_dim
    return {"attention.q.weight": head, "attention.q_up.weight": head,
            "attention.kv_down.weight": config.kv_lora_rank + config.qk_pos_emb_head_dim}


def deepseek_rope_rows(state: dict, config: ModelConfig, to_halves: bool) -> dict:
    """`state` (canonical names) with MLA's rope rows permuted from DeepSeek's interleaved order, which HF's
    DeepSeek-V3 checkpoints and megatron-core's MLA keep, to the halves hybrid rotates (`to_halves`), or back;
    unchanged without MLA. Optimizer moments are permuted as their parameters."""
    if not config.multi_latent_attention:
        return state
    blocks = mla_rope_blocks(config)
    out = {}
    for name, t in state.items():
        block = next((size for rest, size in blocks.items() if name.endswith("." + rest)), None)
        out[name] = t if block is None else permute_rope_rows(t, block, config.qk_pos_emb_head_dim, to_halves)
    return out


class DeepseekV3Adapter(_StoredMTP, _DeepSeekMoE, LlamaAdapter):
    family, hf_class, config_class = "deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config"
    options = ("Llama's (yarn rope included), multi-head latent attention (--multi-latent-attention: `q_lora_rank` "
               "or none, `kv_lora_rank`, `qk_nope_head_dim` = --qk-head-dim, `qk_rope_head_dim` = "
               "--qk-pos-emb-head-dim, `v_head_dim`; YaRN's `mscale_all_dim` on the softmax scale), DeepSeek's MoE "
               "(as GLM-4.5's); also Kimi-K2 and DeepSeek-V3.1/R1")
    refused = ("`attention_bias`, `rope_interleave` false, `num_key_value_heads` != `num_attention_heads`, as "
               "GLM-4.5's MoE; its MTP layers (model.layers.{L + k}) are read and written as --mtp-num-layers")

    qk_norm = True  # MLA's latent norms (hybrid.model.mla), which megatron-core's --qk-layernorm means with MLA
    mla = True

    def _layer_map(self) -> dict:
        return dict(self.LAYER_MAP)  # (the latent norms are mapped with the projections)

    @classmethod
    def config_from_hf(cls, hf):
        name = "DeepseekV3"
        if getattr(hf, "rope_interleave", True) is False:
            _refuse(name, "rope_interleave", False, "DeepSeek's rope features are read in their interleaved order")
        if (hf.num_key_value_heads or hf.num_attention_heads) != hf.num_attention_heads:
            _refuse(name, "num_key_value_heads", hf.num_key_value_heads, "MLA has a key and value per head")
        if float(hf.rms_norm_eps) != HF_LATENT_NORM_EPS:
            _refuse(name, "rms_norm_eps", hf.rms_norm_eps,
                    f"transformers' DeepseekV3 computes its latent norms with eps "
                    f"{HF_LATENT_NORM_EPS} whatever rms_norm_eps says, hybrid's MLA (as megatron-core's) with the "
                    f"model's one epsilon")
        return _replace(super().config_from_hf(hf), multi_latent_attention=True, kv_channels=None, qk_layernorm=True,
                        num_query_groups=hf.num_attention_heads, q_lora_rank=hf.q_lora_rank,
                        kv_lora_rank=hf.kv_lora_rank, qk_head_dim=hf.qk_nope_head_dim,
                        qk_pos_emb_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim)

    def check_exportable(self):
        super().check_exportable()
        if not self.config.multi_latent_attention:
            raise ConfigError(f"exporting to {self.hf_class} needs --multi-latent-attention.")
        if self.config.norm_epsilon != HF_LATENT_NORM_EPS:
            raise ConfigError(f"exporting to {self.hf_class} needs --norm-epsilon {HF_LATENT_NORM_EPS} (the model's is "
                              f"{self.config.norm_epsilon}): transformers computes the latent norms with eps "
                              f"{HF_LATENT_NORM_EPS} whatever rms_norm_eps says, so the export would be another model.")

    def family_fields(self):
        c = self.config
        return dict(super().family_fields(), q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
                    qk_nope_head_dim=c.qk_head_dim, qk_rope_head_dim=c.qk_pos_emb_head_dim, v_head_dim=c.v_head_dim,
                    rope_interleave=True, num_mtp_layers=c.mtp_num_layers or 0,
                    head_dim=c.qk_pos_emb_head_dim)  # (its rope's, there)

    def _mla_tensors(self, i: int) -> dict:
        """HF name -> (canonical name, shape) of layer i's MLA projections and norms."""
        c = self.config
        p, ours = f"model.layers.{i}.self_attn.", f"layers.{i}.attention."
        n, h, d, kv, pos = c.num_attention_heads, c.hidden_size, c.head_dim, c.kv_lora_rank, c.qk_pos_emb_head_dim
        if c.q_lora_rank is None:
            tensors = {p + "q_proj.weight": (ours + "q.weight", (n * d, h))}
        else:
            r = c.q_lora_rank
            tensors = {p + "q_a_proj.weight": (ours + "q_down.weight", (r, h)),
                       p + "q_a_layernorm.weight": (ours + "q_down_norm.weight", (r,)),
                       p + "q_b_proj.weight": (ours + "q_up.weight", (n * d, r))}
        return dict(tensors, **{
            p + "kv_a_proj_with_mqa.weight": (ours + "kv_down.weight", (kv + pos, h)),
            p + "kv_a_layernorm.weight": (ours + "kv_down_norm.weight", (kv,)),
            p + "kv_b_proj.weight": (ours + "kv_up.weight", (n * (c.qk_head_dim + c.v_head_dim), kv))})

    def attention_to_canonical(self, hf_state, i, out):
        read = {name: expect(hf_name, get(hf_state, hf_name), shape)
                for hf_name, (name, shape) in self._mla_tensors(i).items()}
        out.update(deepseek_rope_rows(read, self.config, to_halves=True))

    def attention_to_hf(self, state, i, out):
        ours = deepseek_rope_rows({name: state[name] for name, _ in self._mla_tensors(i).values()}, self.config,
                                  to_halves=False)
        out.update({hf_name: ours[name] for hf_name, (name, _) in self._mla_tensors(i).items()})


class GptOssAdapter(LlamaAdapter):
    family, hf_class, config_class = "gpt_oss", "GptOssForCausalLM", "GptOssConfig"
    options = ("attention sinks (--softmax-type learnable), sliding-window and full layers (`layer_types`: "
               "--window-size with --window-attn-skip-freq), YaRN rope, biases everywhere (--add-bias-linear: Q/K/V, "
               "output, router, experts), every layer a softmax top-k MoE whose experts' clamped quick-GeGLU is "
               "--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value `swiglu_limit`")
    refused = ("`swiglu_alpha` other than 1.702, `attention_bias` false, as Llama's (MXFP4 weights: save them "
               "dequantized)")
    qkv_bias = True  # (Q/K/V's biases as --add-bias-linear's, with the output's)
    REFUSED_BIASES = ("mlp_bias",)
    LAYER_MAP = dict(LlamaAdapter.LAYER_MAP,
                     **{"model.layers.{}.self_attn.o_proj.bias": "layers.{}.attention.dense.bias",
                        "model.layers.{}.self_attn.sinks": "layers.{}.attention.sinks"})

    @classmethod
    def config_from_hf(cls, hf):
        name = "GptOss"
        if float(hf.swiglu_alpha) != 1.702:
            _refuse(name, "swiglu_alpha", hf.swiglu_alpha, "the quick-GeGLU's alpha is 1.702 (megatron-core's)")
        if not hf.attention_bias:
            _refuse(name, "attention_bias", False, "GPT-OSS's attention has biases here (--add-bias-linear)")
        sliding = sliding_layers(hf, name)
        config = super().config_from_hf(hf)
        return _replace(config, swiglu=False, quick_geglu=True, glu_linear_offset=1.0,
                        activation_func_clamp_value=float(hf.swiglu_limit), add_bias_linear=True, add_qkv_bias=False,
                        attention_sinks=True, num_experts=hf.num_local_experts, moe_router_topk=hf.num_experts_per_tok,
                        moe_ffn_hidden_size=hf.intermediate_size, moe_layer_freq=1,
                        sliding_window=int(hf.sliding_window) if any(sliding) else None,
                        window_attn_skip_freq=window_pattern(sliding) if any(sliding) else None)

    @classmethod
    def _window(cls, hf, name: str):
        return None  # (set from layer_types above)

    def check_exportable(self):
        c = self.config
        wanted = {"rope": c.position_embedding_type == "rope", "RMSNorm": c.normalization == "RMSNorm",
                  "--add-bias-linear": c.add_bias_linear, "--softmax-type learnable": c.attention_sinks,
                  "--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value":
                      c.quick_geglu and c.glu_linear_offset == 1.0 and c.activation_func_clamp_value is not None,
                  "--num-experts on every layer (--moe-layer-freq 1)":
                      bool(c.num_experts) and all(c.mlp_type_of(i) == "moe" for i in range(c.num_layers)),
                  "softmax top-k routing (no --moe-router-pre-softmax, scaling, score bias, groups, shared experts)":
                      bool(c.num_experts) and c.moe_router_score_function == "softmax"
                      and not (c.moe_router_pre_softmax or c.moe_router_topk_scaling_factor
                               or c.moe_router_enable_expert_bias or c.moe_router_num_groups
                               or c.moe_shared_expert_intermediate_size),
                  "none of --qk-layernorm, --add-qkv-bias, --sandwich-norms, --rotary-percent, --apply-layernorm-1p, "
                  "--scale-embeddings, --local-rotary-base, --softmax-scale, --multi-latent-attention, "
                  "--mtp-num-layers": not (
                      c.qk_layernorm or c.add_qkv_bias or c.sandwich_norms or c.rotary_percent != 1.0
                      or c.apply_layernorm_1p or c.scale_embeddings or c.local_rotary_base is not None
                      or c.softmax_scale is not None or c.multi_latent_attention or c.mtp_num_layers)}
        missing = [what for what, ok in wanted.items() if not ok]
        if missing:
            raise ConfigError(f"exporting to {self.hf_class} needs {', '.join(missing)}.")

    def family_fields(self):
        c = self.config
        kinds = layer_types(c)
        return dict(intermediate_size=c.moe_ffn_hidden_size, num_local_experts=c.num_experts,
                    num_experts_per_tok=c.moe_router_topk, sliding_window=c.sliding_window or 128, layer_types=kinds,
                    attention_bias=True, swiglu_limit=c.activation_func_clamp_value, swiglu_alpha=1.702)

    def mlp_to_canonical(self, hf_state, i, out, wanted=None):
        """GPT-OSS's fused experts (gate_up_proj [E, h, 2f], its gate and up columns interleaved; down_proj
        [E, f, h]; their biases) -> each expert's fc1 = [gate; up] and fc2, [out, in]; the router's weight and bias."""
        c = self.config
        hf, ours = f"model.layers.{i}.mlp.", f"layers.{i}.mlp."
        e, h, f = c.num_experts, c.hidden_size, c.moe_ffn_hidden_size
        out[ours + "router.weight"] = expect(hf + "router.weight", get(hf_state, hf + "router.weight"), (e, h))
        out[ours + "router.bias"] = expect(hf + "router.bias", get(hf_state, hf + "router.bias"), (e,))
        mine = [j for j in range(e) if wanted is None or f"{ours}{EXPERTS[1:]}{j}.fc1.weight" in wanted]
        if not mine:
            return
        gate_up = expect(hf + "experts.gate_up_proj", get(hf_state, hf + "experts.gate_up_proj"), (e, h, 2 * f))
        gate_up_bias = expect(hf + "experts.gate_up_proj_bias", get(hf_state, hf + "experts.gate_up_proj_bias"),
                              (e, 2 * f))
        down = expect(hf + "experts.down_proj", get(hf_state, hf + "experts.down_proj"), (e, f, h))
        down_bias = expect(hf + "experts.down_proj_bias", get(hf_state, hf + "experts.down_proj_bias"), (e, h))
        for j in mine:
            expert = f"{ours}{EXPERTS[1:]}{j}."
            out[expert + "fc1.weight"] = torch.cat([gate_up[j][:, 0::2].t(), gate_up[j][:, 1::2].t()]).contiguous()
            out[expert + "fc1.bias"] = torch.cat([gate_up_bias[j][0::2], gate_up_bias[j][1::2]]).contiguous()
            out[expert + "fc2.weight"] = down[j].t().contiguous()
            out[expert + "fc2.bias"] = down_bias[j].clone()

    def mlp_to_hf(self, state, i, out):
        c = self.config
        hf, ours = f"model.layers.{i}.mlp.", f"layers.{i}.mlp."
        out[hf + "router.weight"], out[hf + "router.bias"] = state[ours + "router.weight"], state[ours + "router.bias"]
        experts = [f"{ours}{EXPERTS[1:]}{j}." for j in range(c.num_experts)]

        def interleaved(t):  # [gate; up] along dim 0 -> gate and up alternating
            gate, up = t.chunk(2, dim=0)
            return torch.stack([gate, up], dim=1).reshape(t.shape)
        out[hf + "experts.gate_up_proj"] = torch.stack([interleaved(state[x + "fc1.weight"]).t() for x in experts])
        out[hf + "experts.gate_up_proj_bias"] = torch.stack([interleaved(state[x + "fc1.bias"]) for x in experts])
        out[hf + "experts.down_proj"] = torch.stack([state[x + "fc2.weight"].t() for x in experts])
        out[hf + "experts.down_proj_bias"] = torch.stack([state[x + "fc2.bias"] for x in experts])


FAMILIES = {a.family: a for a in (GPT2Adapter, LlamaAdapter, MistralAdapter, Qwen2Adapter, Qwen3Adapter, GemmaAdapter,
                                  Gemma3Adapter, MixtralAdapter, Qwen2MoeAdapter, Qwen3MoeAdapter, Glm4MoeAdapter,
                                  DeepseekV3Adapter, GptOssAdapter)}
BY_HF_CLASS = {a.hf_class: a for a in FAMILIES.values()}


def family_of(config: ModelConfig) -> str:
    """The recorded family, else the one the options name (a model trained from flags)."""
    if config.family is not None:
        if config.family not in FAMILIES:
            raise ConfigError(f"the checkpoint's family {config.family!r} is not one of {', '.join(FAMILIES)}.")
        return config.family
    if config.position_embedding_type == "learned_absolute":
        return "gpt2"
    if config.multi_latent_attention:
        return "deepseek_v3"
    if config.attention_sinks or config.quick_geglu:
        return "gpt_oss"
    if config.num_experts:
        if config.moe_router_score_function == "sigmoid":
            return "glm4_moe"
        return "qwen2_moe" if config.moe_shared_expert_intermediate_size else \
            "qwen3_moe" if config.qk_layernorm else "mixtral"
    if config.sandwich_norms:
        return "gemma3"
    if config.geglu or config.scale_embeddings or (config.apply_layernorm_1p and config.normalization == "RMSNorm"):
        return "gemma"
    if config.qk_layernorm:
        return "qwen3"
    if config.add_qkv_bias:
        return "qwen2"
    return "mistral" if config.sliding_window is not None else "llama"


def infer_family(config: ModelConfig):
    """The family a model built from flags is recorded as: the one its options name, if that family can
    express it (else None: such a model trains, and export says which option no family has)."""
    candidate = family_of(config)
    try:
        FAMILIES[candidate](config).check_exportable()
    except ConfigError:
        return None
    return candidate


def adapter_for_model(config: ModelConfig) -> Adapter:
    """The adapter that exports this model (its recorded family), after checking it can."""
    adapter = FAMILIES[family_of(config)](config)
    adapter.check_exportable()
    return adapter


def markdown_table() -> str:
    """README: the families, what each maps to, and what is refused."""
    rows = ["| family (recorded) | transformers class | maps to | refused (one message each) |", "|---|---|---|---|"]
    rows += [f"| `{a.family}` | `{a.hf_class}` | {a.options} | {a.refused} |" for a in FAMILIES.values()]
    return "\n".join(rows)
