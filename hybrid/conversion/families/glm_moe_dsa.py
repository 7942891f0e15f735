"""GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3.2's MLA, MoE and sparse attention with two changes: index sharing
(`indexer_types`: a "shared" layer has no indexer and attends the keys the previous "full" layer's indexer chose;
--dsa-indexer-topk-freq / --dsa-indexer-skip-topk-offset) and its indexer's rope features stored interleaved, as
MLA's (permuted to the halves hybrid rotates, mla_rope), with its latent norms at eps 1e-6 beside the model's
rms_norm_eps (--mla-latent-norm-epsilon)."""

from __future__ import annotations

import dataclasses

import torch

from hybrid.conversion.families.adapter import refuse
from hybrid.conversion.families.deepseek_v32 import DeepseekV32Adapter
from hybrid.conversion.families.mla_rope import rope_order


class GlmMoeDsaAdapter(DeepseekV32Adapter):
    family, hf_class, config_class = "glm_moe_dsa", "GlmMoeDsaForCausalLM", "GlmMoeDsaConfig"
    options = ("DeepSeek-V3.2's, `indexer_types` (index sharing: --dsa-indexer-topk-freq, "
               "--dsa-indexer-skip-topk-offset, or their pattern), the indexer's rope interleaved, `rms_norm_eps` "
               "beside the latent norms' 1e-6 (--mla-latent-norm-epsilon)")
    refused = ("`indexer_types` other than full/shared or with a shared first layer, as DeepSeek-V3.2's; its stored "
               "MTP layer is skipped, as transformers skips it")

    @classmethod
    def config_from_hf(cls, hf):
        kinds = list(getattr(hf, "indexer_types", None) or ["full"] * hf.num_hidden_layers)
        if set(kinds) - {"full", "shared"} or kinds[0] != "full" or len(kinds) != hf.num_hidden_layers:
            refuse("GlmMoeDsa", "indexer_types", kinds, "one full or shared per layer, the first full")
        share = [int(kind == "shared") for kind in kinds]
        return dataclasses.replace(super().config_from_hf(hf), dsa_index_share=share if any(share) else None)

    def family_fields(self):
        c = self.config
        share = c.dsa_index_share or [0] * c.num_layers
        return dict(super().family_fields(), indexer_types=["shared" if s else "full" for s in share])

    def indexer_tensors(self, i: int) -> dict:
        return {} if self.config.dsa_source(i) is not None else super().indexer_tensors(i)

    def _indexer_rope(self, tensors: dict, to_halves: bool) -> dict:
        """The indexer's rope features (the first qk_pos_emb_head_dim of each head of wq_b and of wk, k_norm's
        weight and bias with them: the norm does not mix features) from GLM-5's interleaved order to halves, or back."""
        c = self.config
        pos, dim = c.qk_pos_emb_head_dim, c.dsa_indexer_head_dim
        order = torch.cat([rope_order(pos, to_halves), torch.arange(pos, dim)])
        out = {}
        for name, t in tensors.items():
            if name.endswith(".indexer.wq_b"):
                t = t.reshape(-1, dim, t.size(-1))[:, order].reshape(t.shape)
            elif name.rsplit(".", 1)[1] in ("wk", "k_norm_weight", "k_norm_bias"):
                t = t[order]
            out[name] = t.contiguous()
        return out

    def attention_to_canonical(self, hf_state, i, out):
        part = {}
        super().attention_to_canonical(hf_state, i, part)
        out.update(self._indexer_rope(part, to_halves=True))

    def attention_to_hf(self, state, i, out):
        ours = {name: state[name] for name, _ in self.indexer_tensors(i).values()}
        super().attention_to_hf(dict(state, **self._indexer_rope(ours, to_halves=False)), i, out)
