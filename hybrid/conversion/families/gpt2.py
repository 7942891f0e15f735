"""GPT-2 (GPT2LMHeadModel): learned positions, LayerNorm, tanh-GeLU MLP, biases, a tied head. Its Conv1D stores
weights as [in, out], and c_attn's output is [all q | all k | all v] (ours is grouped per head)."""

from __future__ import annotations

import torch

from hybrid.conversion.families.adapter import Adapter, dtype_of, expect, get, refuse
from hybrid.conversion.families.options import extras
from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig
from hybrid.model.qkv import fuse_qkv, split_qkv_flat


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
            refuse("GPT-2", "activation_function", hf.activation_function, "only the tanh GeLU (gelu_new) matches")
        for field in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if getattr(hf, field, False):
                refuse("GPT-2", field, True, "not implemented")
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
                and c.hidden_size == c.num_attention_heads * c.head_dim and not extras(c)):
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
