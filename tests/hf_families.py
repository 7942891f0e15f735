"""Tiny random models of every supported HuggingFace family, made from transformers' own config
classes and saved locally (nothing from a hub). Every parameter and saved buffer is perturbed (HF initialises
norms to 1 or 0 and biases and score biases to 0), so a tensor mapped to the wrong place changes the logits."""

from __future__ import annotations

import torch

VOCAB_SIZE = 8192  # the embedded tokenizer's, so launched runs can read the embedded corpus

COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)

# family -> (transformers config class, model class, config fields): each exercises its family's options
FAMILY_CONFIGS = {
    # Llama 3.2 style: llama3 rope scaling, tied; the original length 16 (8192 in Llama 3) so that the
    # scaling changes frequencies that matter within these short sequences
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(  # Q/K/V biases, tied (Qwen2.5 small models)
        num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(  # Q/K norms, head_dim 16 != 32 / 4, untied
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, rms_norm_eps=1e-6)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(  # sliding window 8 < the sequences, untied
        num_key_value_heads=2, sliding_window=8, tie_word_embeddings=False, rms_norm_eps=1e-5)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(  # GeGLU, (1 + w) norms, sqrt(h) embeddings, MQA, head 16
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    # Gemma's options plus (1 + w) Q/K norms, sandwich norms, window-8 layers 0, 1, 3 and a full layer 2, each
    # kind its own rope (the full layer's linearly scaled), query_pre_attn_scalar 24 != head_dim 16
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rms_norm_eps=1e-6, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh")),
    # Gemma 4 (its 31B's form): plain-weight norms, unscaled scores, normed values, window-6 layers 0, 2 and full
    # layers 1, 3 with head 32 (sliding: 16) and 4 KV heads (sliding: 2) whose keys are the values, proportional rope (a
    # quarter of the full layers' frequencies turn), soft-capped logits (small: the cap bites), untied; the
    # `layer_scalar` buffers perturbed as every saved buffer is
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=4, attention_k_eq_v=True,
        hidden_size_per_layer_input=0, num_kv_shared_layers=0, tie_word_embeddings=False, rms_norm_eps=1e-6,
        sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2, final_logit_softcapping=2.0,
        rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        pad_token_id=0, hidden_activation="gelu_pytorch_tanh")),
    # Gemma 4's E2B/E4B form: per-layer inputs (8 features per layer and token), the last 2 layers attending with
    # the keys and values of layers 0 (windowed) and 1 (full), their MLPs twice as wide; values projected, the full
    # layers' head 32 (sliding: 16); tied
    "gemma4_e": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, global_head_dim=32, attention_k_eq_v=False, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB_SIZE, num_kv_shared_layers=2, use_double_wide_mlp=True,
        tie_word_embeddings=True, rms_norm_eps=1e-6, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"] * 2, final_logit_softcapping=2.0,
        rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        pad_token_id=0, hidden_activation="gelu_pytorch_tanh")),
}
DENSE = list(FAMILY_CONFIGS)
# mixtures of experts: 4 experts, top-2, each family's own routing and layer choice
FAMILY_CONFIGS.update({
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(  # every layer MoE, renormalised top-2, window 8
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, rms_norm_eps=1e-5)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(  # gated shared expert, no renorm, dense layer 3
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[3],
        tie_word_embeddings=False, rms_norm_eps=1e-6)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(  # Q/K norms, renormalised top-2, MoE every 2nd
        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[], tie_word_embeddings=False, rms_norm_eps=1e-6)),
    # DeepSeek's MoE: 8 experts in 4 groups, top-2 from the best group, sigmoid with the score bias, scaled x 2.5,
    # a shared expert, layer 0 dense; rope on half of each 16-wide head (linearly scaled), Q/K/V biases, Q/K norms
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        n_shared_experts=1, n_group=4, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
        norm_topk_prob=True, attention_bias=True, use_qk_norm=True, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # MLA: query rank 16, latent 12, heads of 8 + 4 (rope, stored interleaved) and values of 6; YaRN x 4 over 16
    # positions
    # with mscale 1 / mscale_all_dim 0.7 (the tables and the softmax scale both scaled); DeepSeek's MoE (8 experts, 4
    # groups of which 2 are chosen, top-4), layer 0 dense
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        n_routed_experts=8, num_experts_per_tok=4, moe_intermediate_size=24, n_shared_experts=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
        tie_word_embeddings=False, rms_norm_eps=1e-6, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 16,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7})),
    # attention sinks, Q/K/V/O biases, window-8 layers 0 and 2 and full layers 1 and 3, YaRN x 4 over 16 positions
    # (untruncated ramp); 4 biased experts and a biased router, the quick-GeGLU clamped at 0.2 (so that it clamps)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, swiglu_limit=0.2, tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 150000.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})),
    # DeepSeek-V3's MLA and YaRN with Llama 4's query temperature past 16 positions (beta 0.3); a softmax top-2 of
    # 8 experts, renormalised and scaled x 2.5 (the router without a score bias), a shared expert, layer 0 dense
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM", dict(
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1, n_group=1,
        topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
        tie_word_embeddings=False, rms_norm_eps=1e-6, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 0.7, "llama_4_scaling_beta": 0.3})),
    # Q/K RMSNorms across all heads (q_norm over 4 x 16 features, k_norm over 2 x 16), rope on half of each head
    # (`rotary_dim` 8, the released checkpoints' field); every layer a sigmoid top-2 of 4 experts chosen with the
    # score bias, renormalised
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
        rotary_dim=8, tie_word_embeddings=False, rms_norm_eps=1e-6)),
    # DeepSeek-V3's (MLA, YaRN, its MoE) with DeepSeek sparse attention: an indexer of 8 heads of 16 choosing the top
    # 8 keys of each query (of up to 40), so that most queries attend a subset
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        n_routed_experts=8, num_experts_per_tok=4, moe_intermediate_size=24, n_shared_experts=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
        tie_word_embeddings=False, rms_norm_eps=1e-6, index_topk=8, index_n_heads=8, index_head_dim=16,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 16,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7})),
    # GLM-5: DeepSeek-V3.2's with index sharing (layers 1 and 3 attend the keys layers 0 and 2 chose), the indexer's
    # rope interleaved, rms_norm_eps 1e-5 beside the latent norms' 1e-6; one group of experts
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1, n_group=1,
        topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
        tie_word_embeddings=False, rms_norm_eps=1e-5, index_topk=8, index_n_heads=8, index_head_dim=16,
        indexer_types=["full", "shared", "full", "shared"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Gemma 4's 26B-A4B form: the 31B form's attention with an MoE block beside every dense MLP (4 experts of width
    # 16, top 2; the router's input and expert scales and the block's norms perturbed as every weight is)
    "gemma4_moe": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        FAMILY_CONFIGS["gemma4"][2], enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)),
})
# Gated DeltaNet families (Qwen3.5, Qwen3-Next): layers 0-2 linear, 3 full with its output gate, as their
# full_attention_interval 4; 2 key heads of 8 features, each serving 2 value heads of 6 (v != k: a swapped dimension
# fails), a conv of 4 taps, rope on a quarter of each 8-feature head; tests/test_gated_delta_net.py
_GDN = dict(num_key_value_heads=2, head_dim=8, linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_conv_kernel_dim=4, tie_word_embeddings=False, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
_GDN_MOE = dict(_GDN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                shared_expert_intermediate_size=24)
FAMILY_CONFIGS.update({
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _GDN),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", _GDN_MOE),
    # Qwen3-Next: the grouped projections; layer 1's MLP dense (mlp_only_layers), top-k not renormalised
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(_GDN_MOE, mlp_only_layers=[1], norm_topk_prob=False)),
})
LINEAR_ATTENTION = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss", "mistral4", "minimax_m2",
       "deepseek_v32", "glm_moe_dsa", "gemma4_moe"]
FAMILIES = DENSE + MOE + LINEAR_ATTENTION
RECORDED = {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "gemma": "gemma",
            "gemma3": "gemma3", "gemma4": "gemma4", "gemma4_e": "gemma4", "gemma4_moe": "gemma4",
            "mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen3_moe": "qwen3_moe", "glm4_moe": "glm4_moe",
            "deepseek_v3": "deepseek_v3", "gpt_oss": "gpt_oss", "mistral4": "mistral4",
            "minimax_m2": "minimax_m2", "deepseek_v32": "deepseek_v32",
            "glm_moe_dsa": "glm_moe_dsa", "qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe",
            "qwen3_next": "qwen3_next"}


def save_embedded_tokenizer(path):
    """The embedded corpus's tokenizer (the test data's), saved as a transformers tokenizer."""
    from hybrid.data import default as default_data
    from hybrid.data.tokenizer import GPT2BPETokenizer
    GPT2BPETokenizer(str(default_data.VOCAB), str(default_data.MERGES)).to_transformers().save_pretrained(path)


def make_family(family: str, path, seed: int = 0, tokenizer: bool = True, **overrides):
    """Save a tiny random `family` model (and the embedded tokenizer) to `path`; returns the
    transformers model (eval mode)."""
    import transformers
    config_cls, model_cls, fields = FAMILY_CONFIGS[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **fields, **overrides})
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        saved = model.state_dict()
        for name, b in model.named_buffers():  # the routers' score biases (e_score_correction_bias): zeros in HF
            if name in saved and b.is_floating_point():
                b.add_(0.1 * torch.randn_like(b))
    if overrides.get("dtype") == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    if tokenizer:
        save_embedded_tokenizer(path)
    return model.eval()
