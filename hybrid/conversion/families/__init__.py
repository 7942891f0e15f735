"""The HuggingFace families hybrid imports and exports: one file each, one registry line each (`FAMILIES` below), the
family recorded in every checkpoint (`ModelConfig.family`). Each adapter maps its family's config to a ModelConfig
and back, and its state dict to our canonical names and back; how each tensor splits over TP is not restated here:
it is read from the layers (hybrid.checkpoint.tp_layout). Every config field that would change the numerics and that
the model does not implement is refused by name, never dropped.

Modules:
  adapter      the StateDictAdapter protocol, the Adapter base, shared checks (shape, presence, refusal)
  options      rope, sliding windows and layer_types, the flags only some families export
  moe          ExpertLayout (where an MoE layer's router and experts sit) and the shared MoE config mappings
  mtp          stored multi-token prediction layers (DeepSeek-V3, GLM-4.5)
  mla_rope     MLA's rope rows between DeepSeek's interleaved order and the halves hybrid rotates
  llama        Llama, the decoder the other Llama-style families change by fields and components
  gpt2, mistral, qwen2, qwen3, gemma, gemma3, mixtral, qwen2_moe, qwen3_moe, glm4_moe, deepseek_v3, gpt_oss
               one family each
  linear_attention
               Gated DeltaNet layers and gated full attention (Qwen3-Next, Qwen3.5)
  mistral4, minimax_m2, deepseek_v32, glm_moe_dsa, gemma4, qwen3_next, qwen3_5, qwen3_5_moe
               one family each (2026's)

Adding a family: one file with its adapter, and one line in FAMILIES.
"""

from __future__ import annotations

from hybrid.conversion.families.adapter import Adapter, StateDictAdapter
from hybrid.conversion.families.deepseek_v3 import DeepseekV3Adapter
from hybrid.conversion.families.deepseek_v32 import DeepseekV32Adapter
from hybrid.conversion.families.gemma import GemmaAdapter
from hybrid.conversion.families.gemma3 import Gemma3Adapter
from hybrid.conversion.families.gemma4 import Gemma4Adapter
from hybrid.conversion.families.glm_moe_dsa import GlmMoeDsaAdapter
from hybrid.conversion.families.glm4_moe import Glm4MoeAdapter
from hybrid.conversion.families.gpt2 import GPT2Adapter
from hybrid.conversion.families.gpt_oss import GptOssAdapter
from hybrid.conversion.families.llama import LlamaAdapter
from hybrid.conversion.families.minimax_m2 import MiniMaxM2Adapter
from hybrid.conversion.families.mistral import MistralAdapter
from hybrid.conversion.families.mistral4 import Mistral4Adapter
from hybrid.conversion.families.mixtral import MixtralAdapter
from hybrid.conversion.families.qwen2 import Qwen2Adapter
from hybrid.conversion.families.qwen2_moe import Qwen2MoeAdapter
from hybrid.conversion.families.qwen3 import Qwen3Adapter
from hybrid.conversion.families.qwen3_5 import Qwen3_5Adapter
from hybrid.conversion.families.qwen3_5_moe import Qwen3_5MoeAdapter
from hybrid.conversion.families.qwen3_moe import Qwen3MoeAdapter
from hybrid.conversion.families.qwen3_next import Qwen3NextAdapter
from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig

FAMILIES: dict[str, type[StateDictAdapter]] = {a.family: a for a in (
    GPT2Adapter,
    LlamaAdapter,
    MistralAdapter,
    Qwen2Adapter,
    Qwen3Adapter,
    GemmaAdapter,
    Gemma3Adapter,
    MixtralAdapter,
    Qwen2MoeAdapter,
    Qwen3MoeAdapter,
    Glm4MoeAdapter,
    DeepseekV3Adapter,
    GptOssAdapter,
    Mistral4Adapter,
    MiniMaxM2Adapter,
    DeepseekV32Adapter,
    GlmMoeDsaAdapter,
    Gemma4Adapter,
    Qwen3NextAdapter,
    Qwen3_5Adapter,
    Qwen3_5MoeAdapter,
)}
BY_HF_CLASS = {a.hf_class: a for a in FAMILIES.values()}

__all__ = ["Adapter", "StateDictAdapter", "FAMILIES", "BY_HF_CLASS", "family_of", "infer_family",
           "adapter_for_model", "markdown_table", *(a.__name__ for a in FAMILIES.values())]


def family_of(config: ModelConfig) -> str:
    """The recorded family, else the one the options name (a model trained from flags)."""
    if config.family is not None:
        if config.family not in FAMILIES:
            raise ConfigError(f"the checkpoint's family {config.family!r} is not one of {', '.join(FAMILIES)}.")
        return config.family
    if config.position_embedding_type == "learned_absolute":
        return "gpt2"
    if config.linear_attention_freq is not None:  # Qwen3.5-MoE: experts on every layer, their top-k renormalised
        if not config.num_experts:
            return "qwen3_5"
        every = len(config.moe_layers) == config.num_layers and not config.moe_router_pre_softmax
        return "qwen3_5_moe" if every else "qwen3_next"
    if config.multi_latent_attention and config.dsa_indexer_topk is not None:  # GLM-5 shares its indexers' choice
        return "glm_moe_dsa" if config.dsa_index_share else "deepseek_v32"
    if config.multi_latent_attention:  # Mistral 4: its query temperature, or a softmax router
        softmax_moe = config.num_experts and config.moe_router_score_function == "softmax"
        return "mistral4" if config.llama_4_scaling_beta is not None or softmax_moe else "deepseek_v3"
    if config.moe_gemma4_block or (config.sandwich_norms and (config.v_norm or not config.apply_layernorm_1p)):
        return "gemma4"
    if config.attention_sinks or config.quick_geglu:
        return "gpt_oss"
    if config.num_experts:
        if config.moe_router_score_function == "sigmoid":
            return "minimax_m2" if config.qk_norm_across_heads else "glm4_moe"
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


def adapter_for_model(config: ModelConfig) -> StateDictAdapter:
    """The adapter that exports this model (its recorded family), after checking it can."""
    adapter = FAMILIES[family_of(config)](config)
    adapter.check_exportable()
    return adapter


def markdown_table() -> str:
    """README: the families, what each maps to, and what is refused."""
    rows = ["| family (recorded) | transformers class | maps to | refused (one message each) |", "|---|---|---|---|"]
    rows += [f"| `{a.family}` | `{a.hf_class}` | {a.options} | {a.refused} |" for a in FAMILIES.values()]
    return "\n".join(rows)
