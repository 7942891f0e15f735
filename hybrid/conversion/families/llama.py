"""Llama (LlamaForCausalLM), and the decoder every other Llama-style family is: q/k/v projections become one fused
weight (hybrid.model.qkv), gate/up become fc1 = [gate; up]; transformers uses the rotate-half RoPE layout, as our
model does, so no permutation is needed. A family changes it by class fields (its options), by overriding one
mapping step (attention, MLP), or by composing a component: `experts` (moe.ExpertLayout) for MoE layers,
`stores_mtp` (mtp) for stored multi-token prediction layers."""

from __future__ import annotations

from typing import ClassVar

from hybrid.conversion.families import mtp
from hybrid.conversion.families.adapter import Adapter, dtype_of, expect, get, gated_to_canonical, gated_to_hf, \
    refuse, require
from hybrid.conversion.families.moe import ExpertLayout
from hybrid.conversion.families.options import gemma3_options, gemma4_options, rope_of, rope_parameters, window_of
from hybrid.model.config import ModelConfig
from hybrid.model.qkv import fuse_qkv, split_qkv_flat


class LlamaAdapter(Adapter):
    """Llama, and the base of the families that change a few of its options."""

    family, hf_class, config_class = "llama", "LlamaForCausalLM", "LlamaConfig"
    options = "RoPE (default, llama3 and linear scaling), RMSNorm, SwiGLU, no biases, GQA, any head_dim, tied or untied"
    refused = ("`attention_bias`, `mlp_bias`, `rope_scaling` types other than llama3/linear/yarn, "
               "`partial_rotary_factor` < 1, quantized weights (`quantization_config`)")
    hidden_act = "silu"  # the MLP's activation transformers reads from `hidden_act` (None: a family that ignores it)
    qkv_bias = False  # the HF class always has Q/K/V biases (Qwen2)
    qk_norm = False  # per-head Q/K RMSNorm (Qwen3)
    qk_norm_across = False  # the Q/K norms span every head (MiniMax-M2)
    query_temperature = False  # Llama 4's query temperature (--llama-4-scaling-beta; Mistral 4)
    dsa = False  # DeepSeek sparse attention (--experimental-attention-variant dsa; DeepSeek-V3.2)
    windowed = False  # sliding_window is part of the config (Mistral, Qwen2/3)
    gemma = False  # (1 + w) RMSNorm, GeGLU, embeddings x sqrt(hidden)
    gemma3 = False  # Gemma 3's options (options.gemma3_options) may be on
    gemma4 = False  # Gemma 4's options (options.gemma4_options) may be on, final logit soft-capping read
    partial_rotary = False  # rope may rotate part of each head (`partial_rotary_factor` = --rotary-percent)
    mla = False  # multi-latent attention (DeepSeek-V3)
    zero_centred_norms = False  # every RMSNorm scales by (1 + weight) (--apply-layernorm-1p; Qwen3-Next, Qwen3.5)
    gated_delta_net = False  # Gated DeltaNet layers and gated full attention (families.linear_attention)
    stores_mtp = False  # multi-token prediction layers in the checkpoint (families.mtp)
    experts: ClassVar[ExpertLayout | None] = None  # how its MoE layers are stored; None: a dense family
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
            refuse(name, "quantization_config", method, "quantized weights are read as they are stored, without "
                   "their scales; load the model with transformers and save_pretrained it dequantized (bf16)")
        for field in cls.REFUSED_BIASES:
            if getattr(hf, field, False):
                refuse(name, field, True, "biases on the output projection and MLP of this family are not "
                       "implemented (Qwen2's Q/K/V-only bias is)")
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", cls.hidden_act)
        if act != cls.hidden_act and cls.hidden_act is not None:
            refuse(name, "hidden_act", act, f"this family's MLP is {cls.hidden_act}-gated")
        for field in ("attn_logit_softcapping",) + (() if cls.gemma4 else ("final_logit_softcapping",)):
            if getattr(hf, field, None):
                refuse(name, field, getattr(hf, field), "logit soft-capping is not implemented")
        theta, scaling = cls._rope(hf)
        window = cls._window(hf, name)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        config = ModelConfig(
            num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
            num_query_groups=hf.num_key_value_heads or hf.num_attention_heads, vocab_size=hf.vocab_size,
            max_position_embeddings=hf.max_position_embeddings,
            ffn_hidden_size=getattr(hf, "intermediate_size", None) or hf.moe_intermediate_size,  # (MoE only: unused)
            position_embedding_type="rope", rotary_base=theta, rope_scaling=scaling, normalization="RMSNorm",
            norm_epsilon=hf.rms_norm_eps, swiglu=not cls.gemma, geglu=cls.gemma, add_bias_linear=False,
            add_qkv_bias=cls.qkv_bias, qk_layernorm=cls.qk_norm, sliding_window=window,
            kv_channels=None if head_dim * hf.num_attention_heads == hf.hidden_size else head_dim,
            apply_layernorm_1p=(cls.gemma and not cls.gemma4) or cls.zero_centred_norms, scale_embeddings=cls.gemma,
            untie_embeddings_and_output_weights=not getattr(hf, "tie_word_embeddings", False),
            hidden_dropout=0.0, attention_dropout=float(getattr(hf, "attention_dropout", 0.0)),
            init_method_std=hf.initializer_range, family=cls.family, hf_dtype=dtype_of(hf))
        return cls.moe_config(hf, config) if cls.experts else config

    @classmethod
    def moe_config(cls, hf, config: ModelConfig) -> ModelConfig:
        """`config` with the family's MoE options (families with `experts` define it)."""
        raise NotImplementedError

    def moe_wanted(self) -> dict:
        """What an export needs of the model's MoE options beyond ExpertLayout.wanted's (flag -> holds)."""
        return {}

    @classmethod
    def with_stored_layers(cls, config: ModelConfig, names) -> ModelConfig:
        return mtp.with_stored_depth(config, names) if cls.stores_mtp else config

    @classmethod
    def _rope(cls, hf) -> tuple:
        return rope_of(hf, partial=cls.partial_rotary)

    @classmethod
    def _window(cls, hf, name: str):
        return window_of(hf, name) if cls.windowed else None

    def check_exportable(self):
        c = self.config
        others = [flag for flag, on in gemma3_options(c).items() if on and not self.gemma3]
        others += [flag for flag, on in gemma4_options(c).items() if on and not self.gemma4]
        require(self.hf_class, {
            "rope": c.position_embedding_type == "rope", "RMSNorm": c.normalization == "RMSNorm",
            f"none of {', '.join(others)}": not others,
            "--disable-bias-linear": not c.add_bias_linear,
            ("--geglu" if self.gemma else "--swiglu"): c.geglu if self.gemma else c.swiglu,
            "--add-qkv-bias" + ("" if self.qkv_bias else " off"): c.add_qkv_bias == self.qkv_bias,
            "--qk-layernorm" + ("" if self.qk_norm else " off"): c.qk_layernorm == self.qk_norm,
            "--qk-norm-across-heads" + ("" if self.qk_norm_across else " off"):
                c.qk_norm_across_heads == self.qk_norm_across,
            "no --llama-4-scaling-beta": self.query_temperature or c.llama_4_scaling_beta is None,
            "--experimental-attention-variant dsa" + ("" if self.dsa else " off"):
                (c.dsa_indexer_topk is not None) == self.dsa,
            "--apply-layernorm-1p" + ("" if self.one_plus_norms else " off"):
                c.apply_layernorm_1p == self.one_plus_norms,
            "--experimental-attention-variant gated_delta_net and --attention-output-gate" +
            ("" if self.gated_delta_net else " off"):
                (c.linear_attention_freq is not None) == c.attention_output_gate == self.gated_delta_net,
            "--scale-embeddings" + ("" if self.gemma else " off"): c.scale_embeddings == self.gemma,
            "no --window-size": self.windowed or c.sliding_window is None,
            "no --rotary-percent": self.partial_rotary or c.rotary_percent == 1.0,
            "--sandwich-norms" + ("" if self.gemma3 else " off"): c.sandwich_norms == self.gemma3,
            "no --softmax-type learnable, --quick-geglu (GPT-OSS's)": not (c.attention_sinks or c.quick_geglu),
            "--multi-latent-attention" + ("" if self.mla else " off"): c.multi_latent_attention == self.mla,
            "no --mtp-num-layers (DeepSeek-V3's and GLM-4.5's layers)": self.stores_mtp or not c.mtp_num_layers})
        if self.experts:
            require(self.hf_class, self.experts.wanted(c, self.moe_wanted()))

    @property
    def one_plus_norms(self) -> bool:
        """Whether the family's RMSNorms scale by (1 + weight) (--apply-layernorm-1p)."""
        return (self.gemma and not self.gemma4) or self.zero_centred_norms

    def family_fields(self) -> dict:
        """The family's own fields of its HF config (and its spelling of shared ones)."""
        return {}

    def hf_config(self, tokenizer_ids: dict):
        import transformers  # transformers' import takes seconds: only when a config is made
        c = self.config
        fields = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_query_groups, head_dim=c.head_dim,
                      max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.norm_epsilon,
                      rope_parameters=rope_parameters(c), tie_word_embeddings=c.tied_embeddings,
                      hidden_act=self.hidden_act, initializer_range=c.init_method_std,
                      attention_dropout=c.attention_dropout, architectures=[self.hf_class], **tokenizer_ids)
        fields.update(self.family_fields())
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
        if self.stores_mtp:
            out.update(mtp.mtp_to_canonical(self, hf_state, wanted))
        return out

    def layer_to_canonical(self, hf_state, i, wanted=None):
        out = {}
        self.attention_to_canonical(hf_state, i, out)
        self.mlp_to_canonical(hf_state, i, out, wanted)
        for hf_tmpl, our_tmpl in self.layer_map().items():
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

    def layer_map(self) -> dict:
        return dict(self.LAYER_MAP, **(self.QK_NORM_MAP if self.qk_norm else {}))

    def mlp_to_canonical(self, hf_state, i: int, out: dict, wanted=None) -> None:
        if self.experts and self.config.mlp_type_of(i) == "moe":
            self.experts.to_canonical(self.config, hf_state, i, out, wanted)
        else:
            gated_to_canonical(hf_state, f"model.layers.{i}.mlp.", f"layers.{i}.mlp.", out)

    def mlp_to_hf(self, state: dict, i: int, out: dict) -> None:
        if self.experts and self.config.mlp_type_of(i) == "moe":
            self.experts.to_hf(self.config, state, i, out)
        else:
            gated_to_hf(state, f"layers.{i}.mlp.", f"model.layers.{i}.mlp.", out)

    def to_hf(self, state):
        self.check_exportable()
        c = self.config
        out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
               "model.norm.weight": state["final_norm.weight"]}
        if c.untie_embeddings_and_output_weights:
            out["lm_head.weight"] = state["output_layer.weight"]
        for i in range(c.num_layers):
            self.layer_to_hf(state, i, out)
        if self.stores_mtp:
            mtp.mtp_to_hf(self, state, out)
        return out

    def layer_to_hf(self, state: dict, i: int, out: dict) -> None:
        """Transformer layer `i`'s HF tensors (model.layers.{i}.*) from canonical `state`."""
        self.attention_to_hf(state, i, out)
        self.mlp_to_hf(state, i, out)
        for hf_tmpl, our_tmpl in self.layer_map().items():
            out[hf_tmpl.format(i)] = state[our_tmpl.format(i)]
