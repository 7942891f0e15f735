"""DeepSeek-V3.2 (DeepseekV32ForCausalLM; -Exp and the release): DeepSeek-V3 with DeepSeek sparse attention, a
lightning indexer beside each layer's MLA choosing the `index_topk` keys each query attends (hybrid.model.dsa;
--experimental-attention-variant dsa). Its indexer's rope features come first in each head and are stored in
halves, so they are read as they are; MLA's as DeepSeek-V3's (mla_rope)."""

from __future__ import annotations

import dataclasses

from hybrid.conversion.families.adapter import expect, get, refuse
from hybrid.conversion.families.deepseek_v3 import DeepseekV3Adapter

# the indexer's tensors: HF name in the layer's self_attn.indexer -> our name in its attention.indexer
INDEXER = {"wq_b.weight": "wq_b", "wk.weight": "wk", "k_norm.weight": "k_norm_weight", "k_norm.bias": "k_norm_bias",
           "weights_proj.weight": "weights_proj"}


class DeepseekV32Adapter(DeepseekV3Adapter):
    family, hf_class, config_class = "deepseek_v32", "DeepseekV32ForCausalLM", "DeepseekV32Config"
    options = ("DeepSeek-V3's, and DeepSeek sparse attention: `index_topk` = --dsa-indexer-topk, `index_n_heads` = "
               "--dsa-indexer-n-heads, `index_head_dim` = --dsa-indexer-head-dim (the indexer frozen, as transformers "
               "runs it without gradient), `mlp_layer_types` (--moe-layer-freq)")
    refused = ("`layer_types` other than indexed_attention, `q_lora_rank` none, as DeepSeek-V3's; its stored MTP "
               "layer is skipped, as transformers skips it")
    stores_mtp = False  # (transformers ignores model.layers.{L}: _keys_to_ignore_on_load_unexpected)
    dsa = True

    @classmethod
    def config_from_hf(cls, hf):
        kinds = sorted(set(getattr(hf, "layer_types", None) or ["indexed_attention"]))
        if kinds != ["indexed_attention"]:
            refuse("DeepseekV32", "layer_types", kinds, "every layer is DSA's indexed attention")
        if not hf.q_lora_rank:
            refuse("DeepseekV32", "q_lora_rank", hf.q_lora_rank, "its indexer reads the query latent")
        config = super().config_from_hf(hf)
        types = list(getattr(hf, "mlp_layer_types", None) or [])
        if types:
            pattern = [int(t == "sparse") for t in types]
            config = dataclasses.replace(config, moe_layer_freq=1 if all(pattern) else pattern)
        return dataclasses.replace(config, dsa_indexer_topk=int(hf.index_topk),
                                   dsa_indexer_n_heads=int(hf.index_n_heads),
                                   dsa_indexer_head_dim=int(hf.index_head_dim))

    def family_fields(self):
        c = self.config
        fields = dict(super().family_fields(), index_topk=c.dsa_indexer_topk, index_n_heads=c.dsa_indexer_n_heads,
                      index_head_dim=c.dsa_indexer_head_dim,
                      mlp_layer_types=["sparse" if c.mlp_type_of(i) == "moe" else "dense"
                                       for i in range(c.num_layers)])
        for field in ("rope_interleave", "num_mtp_layers"):  # (not fields of DeepseekV32Config)
            fields.pop(field)
        return fields

    def indexer_tensors(self, i: int) -> dict:
        """HF name -> (canonical name, shape) of layer i's indexer."""
        c = self.config
        heads, dim, h = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim, c.hidden_size
        shapes = {"wq_b": (heads * dim, c.q_lora_rank), "wk": (dim, h), "k_norm_weight": (dim,),
                  "k_norm_bias": (dim,), "weights_proj": (heads, h)}
        return {f"model.layers.{i}.self_attn.indexer.{hf}": (f"layers.{i}.attention.indexer.{ours}", shapes[ours])
                for hf, ours in INDEXER.items()}

    def attention_to_canonical(self, hf_state, i, out):
        super().attention_to_canonical(hf_state, i, out)
        out.update({name: expect(hf_name, get(hf_state, hf_name), shape)
                    for hf_name, (name, shape) in self.indexer_tensors(i).items()})

    def attention_to_hf(self, state, i, out):
        super().attention_to_hf(state, i, out)
        out.update({hf_name: state[name] for hf_name, (name, _) in self.indexer_tensors(i).items()})
