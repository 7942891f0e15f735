"""megatron-core itself as the reference for Megatron-LM checkpoints: builds its GPTModel at TP = the
number of ranks (gloo, CPU), writes the checkpoints Megatron-LM's `save_checkpoint` writes, and its
logits and per-token loss on a fixed batch.

    python -m tests.megatron_reference OUT --family llama|qwen2|qwen3|gpt2|qwen2_moe|mixtral|glm4_moe --tp 2 [--ep 1]
        [--iteration 7]
    python -m tests.megatron_reference OUT --family F --tp 2 --check WRITTEN_DIR torch [--check ...]  (megatron-core
        loads each)

writes, under OUT:
  torch_dist/  `--ckpt-format torch_dist` (megatron-core's dist_checkpointing.save of the model's
               sharded_state_dict, with the common state Megatron-LM adds: args, iteration, ...)
  torch/       `--ckpt-format torch` (legacy): iter_N/mp_rank_TT[_EEE]/model_optim_rng.pt, with Transformer
               Engine's key names (`linear_qkv.layer_norm_weight`, `_extra_state`), as Megatron-LM saves
               by default (Transformer Engine cannot be installed on a CPU machine; megatron-core's own
               sharded_state_dict maps the local spec's norms to the same names); experts as SequentialMLP
               names them (`mlp.experts.local_experts.J.linear_fc1.weight`)
  torch_te_grouped/, torch_grouped/ (MoE families) the legacy files with TEGroupedMLP's expert names
               (`mlp.experts.linear_fc1.weightJ`), and with the legacy GroupedMLP's `mlp.experts.weight1/2`
               (a GroupedMLP model that megatron-core's dist_checkpointing.load filled from torch_dist)
  reference.pt {"windows" (2 x seq + 1 tokens), "tokens", "labels" (the next tokens), "logits" (full
               vocabulary), "loss" (per token: megatron-core's vocabulary-parallel cross-entropy), "args"}

CPU stand-ins (megatron-core calls CUDA unconditionally): torch.cuda.synchronize / current_device for its
writer, CudaRNGStatesTracker.fork for its forward (dropout is 0); for MLA, Transformer Engine's core attention
(CoreAttentionStandIn: megatron-core's own takes no value head size of its own) and TELinear; the sliding-window
mask; for MoE, its router's unbound
te_general_gemm, GroupedMLP's grouped_gemm check (built and loaded, never run), and its torch norms'
refusal of SP (which only concerns their gradients).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Llama style: RMSNorm, SwiGLU, GQA, RoPE, no biases, untied output layer; the other families differ from it
LLAMA = dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False,
             position_embedding_type="rope", untie=True, num_query_groups=2, use_rope_scaling=False)
FAMILIES = {
    "llama": dict(LLAMA, use_rope_scaling=True),  # llama3 rope scaling
    # Qwen2 style: Llama's with biases on Q, K, V and a tied output layer
    "qwen2": dict(LLAMA, add_qkv_bias=True, untie=False),
    # Qwen3 style: Llama's with per-head Q/K norms
    "qwen3": dict(LLAMA, qk_layernorm=True),
    # GPT-2 style: LayerNorm, fused bias + tanh GeLU, learned positions, biases, tied
    "gpt2": dict(normalization="LayerNorm", swiglu=False, add_bias_linear=True, add_qkv_bias=False,
                 qk_layernorm=False, position_embedding_type="learned_absolute", untie=False, num_query_groups=4,
                 use_rope_scaling=False),
}
# mixtures of experts: Qwen2-MoE style (softmax over every expert, then top-k unnormalised; a sigmoid-gated
# shared expert) and Mixtral style (top-k softmax, no shared expert), every layer MoE
MOE = {"qwen2_moe": dict(LLAMA, add_qkv_bias=True), "mixtral": dict(LLAMA),
       # GLM-4.5 style: rope on half of each head, QKV bias, Q/K norms; DeepSeek's MoE (sigmoid scores with the
       # expert bias choosing, 4 groups of which each token's experts come from 1, scaled x 2.5, an ungated
       # shared expert)
       "glm4_moe": dict(LLAMA, add_qkv_bias=True, qk_layernorm=True, rotary_percent=0.5),
       # DeepSeek-V3 style: multi-latent attention (a low-rank query, the latent norms --qk-layernorm means with MLA,
       # a value head of its own size, megatron-core's YaRN with mscale_all_dim on the softmax scale), --norm-epsilon
       # 1e-6 (transformers' latent norms have no other), and GLM-4.5's DeepSeek MoE
       "deepseek_v3": dict(LLAMA, qk_layernorm=True, num_query_groups=4, eps=1e-6, mtp=2, mla=dict(
           q_lora_rank=24, kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=10, rope_type="yarn",
           rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0))}
FAMILIES.update(MOE)
MOE_ARGS = {
    "qwen2_moe": dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_router_pre_softmax=True,
                      moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True),
    "mixtral": dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96, moe_router_pre_softmax=False,
                    moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False),
    "glm4_moe": dict(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32, moe_router_pre_softmax=False,
                     moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=False,
                     moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_num_groups=4, moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5),
}
MOE_ARGS["deepseek_v3"] = MOE_ARGS["glm4_moe"]
# GPT-OSS style (Megatron-LM's examples/post_training/modelopt/conf/openai/gpt-oss-20b.sh, scaled down): learned
# sinks (--softmax-type learnable), windowed and full layers alternating (--window-size 3,0 --window-attn-skip-freq 2),
# biases everywhere (--add-bias-linear: QKV, output, router, experts), the clamped quick-GeGLU (--quick-geglu
# --glu-linear-offset 1 --activation-func-clamp-value 7), a softmax top-2 router over 4 experts, --enable-gpt-oss's YaRN
FAMILIES["gpt_oss"] = dict(LLAMA, swiglu=False, add_bias_linear=True, add_qkv_bias=False, gpt_oss=True)
MOE_ARGS["gpt_oss"] = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_router_pre_softmax=False,
                           moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False)
MOE.update(gpt_oss=FAMILIES["gpt_oss"])
GPT_OSS = dict(softmax_type="learnable", glu_linear_offset=1.0, activation_func_clamp_value=7.0, window_size=(3, 0),
               window_attn_skip_freq=2)
GPT_OSS_YARN = dict(yarn_rotary_scaling_factor=32.0, yarn_original_max_position_embeddings=131072, yarn_beta_fast=32.0,
                    yarn_beta_slow=1.0, yarn_mscale=1.0, yarn_mscale_all_dim=0.0,
                    yarn_correction_range_round_to_int=False)
ROUTER_ARGS = ("moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups",
               "moe_router_group_topk", "moe_router_topk_scaling_factor")  # where a family sets them
MTP_SCALE = 0.3  # --mtp-loss-scaling-factor
MLA_ORIGINAL_CONTEXT = 4096  # MLATransformerConfig's original_max_position_embeddings (no Megatron-LM argument sets it)
SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, seq_length=16, vocab=256)


def _cpu_stand_ins() -> None:
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core.tensor_parallel import random as mrandom
    mrandom.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    from megatron.core.transformer.moe import experts, moe_utils
    moe_utils.te_general_gemm = None  # (an unbound name when Transformer Engine is absent)
    experts.gg.assert_grouped_gemm_is_available = lambda: None  # GroupedMLP is built, never run
    from megatron.core.transformer import multi_latent_attention
    if not isinstance(multi_latent_attention.TELinear, type):  # (a MagicMock without Transformer Engine; MLA asks
        multi_latent_attention.TELinear = type("TransformerEngineAbsent", (), {})  # isinstance of it)
    from megatron.core.fusions import fused_softmax

    def window_mask(sq, skv, window_size):  # megatron-core's sliding-window mask, made on the CPU (it asks for CUDA)
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])
    fused_softmax.get_sliding_window_causal_mask = window_mask
    from megatron.core.transformer import torch_norm  # its norms refuse SP (their gradients' sync): forward only
    new = torch_norm.WrappedTorchNorm.__new__

    def norm_without_sp(cls, config, *args, **kwargs):
        config = copy.copy(config)
        config.sequence_parallel = False
        return new(cls, config, *args, **kwargs)
    torch_norm.WrappedTorchNorm.__new__ = norm_without_sp


class CoreAttentionStandIn(torch.nn.Module):
    """What Transformer Engine's DotProductAttention computes for MLA (megatron-core's local one takes no separate key
    and value head sizes): causal softmax attention at MLA's softmax scale, [s, b, heads, d] in, [s, b, heads x v]
    out."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, k_channels=None,
                 v_channels=None, **kwargs):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, **kwargs):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).flatten(2)


def megatron_args(family: str, tp: int, iteration: int, ep: int = 1) -> argparse.Namespace:
    """The args Megatron-LM's save_checkpoint stores (its argparse names and the values validate_args
    derives), for this model."""
    f, s = FAMILIES[family], SHAPE
    from megatron.core.transformer.enums import AttnBackend
    return argparse.Namespace(
        num_layers=s["num_layers"], hidden_size=s["hidden_size"], ffn_hidden_size=s["ffn_hidden_size"],
        num_attention_heads=s["num_attention_heads"], group_query_attention=f["num_query_groups"] != 4,
        num_query_groups=f["num_query_groups"], kv_channels=s["hidden_size"] // s["num_attention_heads"],
        max_position_embeddings=s["seq_length"], seq_length=s["seq_length"],
        position_embedding_type=f["position_embedding_type"], rotary_base=10000,
        rotary_percent=f.get("rotary_percent", 1.0),
        rotary_interleaved=False, use_rope_scaling=f["use_rope_scaling"], rope_scaling_factor=8.0,
        rotary_seq_len_interpolation_factor=None, normalization=f["normalization"], norm_epsilon=f.get("eps", 1e-5),
        apply_layernorm_1p=False, swiglu=f["swiglu"], openai_gelu=False, squared_relu=False,
        bias_gelu_fusion=True, add_bias_linear=f["add_bias_linear"], add_qkv_bias=f["add_qkv_bias"],
        qk_layernorm=f["qk_layernorm"], untie_embeddings_and_output_weights=f["untie"],
        padded_vocab_size=s["vocab"], make_vocab_size_divisible_by=128, vocab_size=None,
        tokenizer_type="NullTokenizer", tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=_etp(family, tp),
        sequence_parallel=family in MOE and tp > 1, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.0, moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
        transformer_impl="transformer_engine", ckpt_format="torch_dist", params_dtype=torch.float32,
        bf16=False, fp16=False, attention_backend=AttnBackend.auto, multi_latent_attention="mla" in f,
        mtp_num_layers=f.get("mtp"), mtp_loss_scaling_factor=MTP_SCALE,
        **(dict(GPT_OSS, quick_geglu=True, enable_gpt_oss=True) if f.get("gpt_oss") else {}),
        **f.get("mla", {}),
        consumed_train_samples=iteration * 8, consumed_valid_samples=0, global_batch_size=8, micro_batch_size=4,
        train_iters=20, lr=3e-4, min_lr=3e-5, lr_decay_style="cosine", lr_decay_iters=20, lr_warmup_iters=2,
        lr_warmup_fraction=None, lr_warmup_init=0.0, weight_decay=0.01, iteration=iteration,
        **MOE_ARGS.get(family, {"num_experts": None}))


def _scheduler_state(args) -> dict:
    """What Megatron-LM's OptimizerParamScheduler.state_dict() holds after `iteration` steps."""
    return {"max_lr": args.lr, "lr_warmup_steps": args.lr_warmup_iters * args.global_batch_size,
            "num_steps": args.consumed_train_samples, "lr_decay_style": args.lr_decay_style,
            "lr_decay_steps": args.lr_decay_iters * args.global_batch_size, "min_lr": args.min_lr,
            "start_wd": args.weight_decay, "end_wd": args.weight_decay, "wd_incr_style": "constant",
            "wd_incr_steps": args.train_iters * args.global_batch_size}


def build_model(family: str, tp: int, ep: int = 1, grouped: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    f, s = FAMILIES[family], SHAPE
    gated = f["swiglu"]
    moe = {}
    if family in MOE:
        m = MOE_ARGS[family]
        moe = dict(num_moe_experts=m["num_experts"], moe_router_topk=m["moe_router_topk"],
                   moe_ffn_hidden_size=m["moe_ffn_hidden_size"], moe_router_pre_softmax=m["moe_router_pre_softmax"],
                   moe_shared_expert_intermediate_size=m["moe_shared_expert_intermediate_size"],
                   moe_shared_expert_gate=m["moe_shared_expert_gate"], moe_token_dispatcher_type="allgather",
                   moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, expert_model_parallel_size=ep,
                   expert_tensor_parallel_size=_etp(family, tp),
                   sequence_parallel=tp > 1, moe_grouped_gemm=grouped, **{k: m[k] for k in ROUTER_ARGS if k in m})
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    mla = f.get("mla")
    config = (MLATransformerConfig if mla else TransformerConfig)(
        num_layers=s["num_layers"], hidden_size=s["hidden_size"], num_attention_heads=s["num_attention_heads"],
        num_query_groups=f["num_query_groups"], ffn_hidden_size=s["ffn_hidden_size"], use_cpu_initialization=True,
        gated_linear_unit=gated or bool(f.get("gpt_oss")), activation_func=quick_gelu if f.get("gpt_oss") else
        F.silu if gated else F.gelu, bias_activation_fusion=not gated and not f.get("gpt_oss"),
        **(GPT_OSS if f.get("gpt_oss") else {}),
        normalization=f["normalization"], layernorm_epsilon=f.get("eps", 1e-5), add_bias_linear=f["add_bias_linear"],
        add_qkv_bias=f["add_qkv_bias"], qk_layernorm=f["qk_layernorm"], hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, tensor_model_parallel_size=tp, init_method_std=0.2, **moe,
        **(dict(mla, original_max_position_embeddings=MLA_ORIGINAL_CONTEXT) if mla else {}),
        **({"mtp_num_layers": f["mtp"], "mtp_loss_scaling_factor": MTP_SCALE} if f.get("mtp") else {}))
    spec = get_gpt_layer_local_spec(normalization=f["normalization"], qk_layernorm=f["qk_layernorm"],
                                    num_experts=moe.get("num_moe_experts"), moe_grouped_gemm=grouped,
                                    multi_latent_attention=bool(mla))
    if mla:
        spec.submodules.self_attention.submodules.core_attention = CoreAttentionStandIn
    if f.get("gpt_oss"):  # what --enable-gpt-oss sets on the config (Megatron-LM's post-training model builder)
        for name, value in GPT_OSS_YARN.items():
            setattr(config, name, value)
    mtp_spec = None
    if f.get("mtp"):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
        mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    model = GPTModel(config, spec, vocab_size=s["vocab"], max_sequence_length=s["seq_length"],
                     position_embedding_type="yarn" if f.get("gpt_oss") else f["position_embedding_type"],
                     parallel_output=False,
                     share_embeddings_and_output_weights=not f["untie"],
                     rope_scaling=f["use_rope_scaling"], rope_scaling_factor=8.0,
                     rotary_percent=f.get("rotary_percent", 1.0), mtp_block_spec=mtp_spec)
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a swapped name shows
        for name, param in model.named_parameters():
            if name.endswith("bias") or "layernorm" in name or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():  # the routers' expert biases (zeros until trained)
            if name.endswith("expert_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(5)) * 0.1)
    return model


# Transformer Engine's spelling of the local spec's norms (its fused norm + linear modules)
TE_NAMES = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


# multi-latent attention with Transformer Engine: the input norm stays a norm (TENorm), the latent norms are fused into
# the up projections, and the down projections are whole on every TP rank (TELinear, parallel_mode "duplicated";
# the local spec's ColumnParallelLinear splits them)
MLA_TE_NAMES = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}
MLA_DOWN = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight")


def te_state_dict(model, experts: str = "sequential") -> dict:
    """The model's state dict as Megatron-LM with Transformer Engine saves it (legacy format); an MoE
    layer's norm before its experts stays a plain norm (no fc1 to fuse it into), and its experts are named
    as SequentialMLP (`sequential`) or TEGroupedMLP (`te_grouped`) names them. (A collective with MLA: every
    rank calls it.)"""
    import re
    out = {}
    state = model.state_dict()
    moe = any(".mlp.router." in name for name in state)
    mla = model.config.multi_latent_attention
    for name, value in state.items():
        if mla and name.endswith(MLA_DOWN):
            shards = [torch.empty_like(value) for _ in range(dist.get_world_size())]
            dist.all_gather(shards, value.contiguous())  # (TP = the world in these references)
            value = torch.cat(shards)
        for local, te in (MLA_TE_NAMES if mla else TE_NAMES).items():
            if not (moe and local == "pre_mlp_layernorm."):
                name = name.replace(local, te)
        if mla and not moe:
            name = name.replace("pre_mlp_layernorm.", TE_NAMES["pre_mlp_layernorm."])
        if experts == "te_grouped":
            name = re.sub(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", r"mlp.experts.\2.weight\1",
                          name)
            if "local_experts" in name:
                continue
        out[name] = value if value is not None else None
    for name in list(out):  # TE modules keep an _extra_state (FP8 metadata; empty here)
        if name.endswith("linear_qkv.weight") or name.endswith("linear_fc1.weight"):
            out[name.rsplit(".", 1)[0] + "._extra_state"] = None
    return out


@contextlib.contextmanager
def _decoder_only(model):
    """The model's forward without its MTP layers (the decoder's logits and loss)."""
    process, layers = getattr(model, "mtp_process", False), model.config.mtp_num_layers
    model.mtp_process, model.config.mtp_num_layers = False, None
    try:
        yield
    finally:
        model.mtp_process, model.config.mtp_num_layers = process, layers


def _etp(family: str, tp: int) -> int:
    """The expert-TP: TP's, but 1 for experts with biases (megatron-core builds those only at expert-TP 1)."""
    return 1 if FAMILIES[family].get("gpt_oss") else tp


def _legacy_dir(out: str, fmt: str, tag: str, tp_rank: int, ep_rank: int, ep: int) -> str:
    return os.path.join(out, fmt, tag, f"mp_rank_{tp_rank:02d}" + (f"_{ep_rank:03d}" if ep > 1 else ""))


def _rank(rank: int, world: int, out: str, family: str, iteration: int, port: int, ep: int = 1) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _cpu_stand_ins()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    tp = world // ep
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=_etp(family, tp))
    torch.manual_seed(1234)
    model = build_model(family, tp, ep)
    args = megatron_args(family, tp, iteration, ep)
    tag = f"iter_{iteration:07d}"
    common = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
              "opt_param_scheduler": _scheduler_state(args), "num_floating_point_operations_so_far": 0}
    dist_dir = os.path.join(out, "torch_dist", tag)
    if rank == 0:
        os.makedirs(dist_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(dict(common, model=model.sharded_state_dict()), dist_dir)
    tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    legacy_args = argparse.Namespace(**dict(vars(args), ckpt_format="torch"))
    spellings = {"torch": te_state_dict(model)}
    if family in MOE and not FAMILIES[family].get("gpt_oss"):  # (grouped GEMMs have no expert biases)
        spellings["torch_te_grouped"] = te_state_dict(model, "te_grouped")
        dist.barrier()
        grouped = build_model(family, tp, ep, grouped=True)  # megatron-core fills GroupedMLP from torch_dist
        loaded = dist_checkpointing.load({"model": grouped.sharded_state_dict()}, dist_dir)
        grouped.load_state_dict(loaded["model"], strict=True)
        spellings["torch_grouped"] = te_state_dict(grouped)
    if rank == tp_rank + ep_rank * tp:  # one file per (TP, EP) rank
        for fmt, state in spellings.items():
            legacy = _legacy_dir(out, fmt, tag, tp_rank, ep_rank, ep)
            os.makedirs(legacy, exist_ok=True)
            torch.save(dict(common, args=legacy_args, model=state), os.path.join(legacy, "model_optim_rng.pt"))
    g = torch.Generator().manual_seed(7)  # two windows of seq + 1 tokens: inputs and their next tokens
    windows = torch.randint(0, SHAPE["vocab"] - 1, (2, SHAPE["seq_length"] + 1), generator=g)
    tokens, labels = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    positions = torch.arange(SHAPE["seq_length"]).expand(2, -1)
    mask = torch.triu(torch.ones(1, 1, SHAPE["seq_length"], SHAPE["seq_length"]), 1).bool()
    with torch.no_grad():
        mtp_losses = None
        if model.config.mtp_num_layers:  # each depth's mean loss, as megatron-core logs it (its training forward)
            from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
            model.output_layer.gather_output = False
            model.train()
            model(tokens, positions, mask, labels=labels)
            mtp_losses = MTPLossLoggingHelper.tracker["values"].clone()
            model.eval()
            model.output_layer.gather_output = True
        with _decoder_only(model):  # (megatron-core's forward with MTP layers takes labels and gives the loss only)
            logits = model(tokens, positions, mask)  # gathered over TP (parallel_output=False)
            model.output_layer.gather_output = False  # its loss: the vocabulary-parallel cross-entropy of each rank's
            loss = model(tokens, positions, mask, labels=labels)
    dist.barrier()
    if rank == 0:
        for fmt in ("torch_dist", *spellings):
            with open(os.path.join(out, fmt, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(iteration))
        torch.save({"windows": windows, "tokens": tokens, "labels": labels, "logits": logits, "loss": loss,
                    "args": vars(args),
                    "mtp_losses": mtp_losses},
                   os.path.join(out, "reference.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _load_into(model, directory: str, fmt: str, rank: int, ep: int = 1, te_names: bool = False) -> None:
    """megatron-core's own loaders: dist_checkpointing.load (torch_dist), or Megatron-LM's legacy
    torch.load + load_state_dict(strict=True). `te_names`: the torch_dist checkpoint names the norms as Transformer
    Engine does where the local spec's model, which the references are, has names of its own there (MLA's latent
    norms, an MoE layer's norm before its router)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    with open(os.path.join(directory, "latest_checkpointed_iteration.txt")) as f:
        tag = f"iter_{int(f.read().strip()):07d}"
    if fmt == "torch_dist":
        sharded = model.sharded_state_dict()
        if te_names:  # the keys a Transformer Engine model has where the local spec's differ (MLA's latent norms; an
            renames = dict(MLA_TE_NAMES)  # MoE layer's norm before its router, a TENorm there)
            if model.config.num_moe_experts and not model.config.multi_latent_attention:
                renames["mlp.linear_fc1.layer_norm_"] = "pre_mlp_layernorm."
            elif model.config.multi_latent_attention and not model.config.num_moe_experts:  # (no keys map there)
                renames["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
            for value in sharded.values():
                for local, te in renames.items():
                    value.key = value.key.replace(local, te)
        state = dist_checkpointing.load({"model": sharded}, os.path.join(directory, tag))
        model.load_state_dict(state["model"], strict=True)
    else:
        rank_dir = _legacy_dir(directory, "", tag, ps.get_tensor_model_parallel_rank(),
                               ps.get_expert_model_parallel_rank(), ep)
        content = torch.load(os.path.join(rank_dir, "model_optim_rng.pt"), weights_only=False)
        state = {}
        mla = model.config.multi_latent_attention
        for name, value in content["model"].items():  # Transformer Engine's names -> the local spec's
            for local, te in (*TE_NAMES.items(), *MLA_TE_NAMES.items()):
                name = name.replace(te, local)
            if mla and name.endswith(MLA_DOWN) and value.shape != model.state_dict()[name].shape:  # TE's whole ->
                value = value.chunk(ps.get_tensor_model_parallel_world_size())[ps.get_tensor_model_parallel_rank()]
            if not (name.endswith("._extra_state") and name not in model.state_dict()):
                state[name] = value
        model.load_state_dict(state, strict=True)


def _check(rank: int, world: int, out: str, family: str, reference: str, checks: list, port: int,
           ep: int = 1) -> None:
    """Every tensor of each `checks` (written, format) checkpoint (loaded by megatron-core) against the reference
    checkpoint's: OUT/check_FORMAT.pt each (one process group and one reference model for all of them)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _cpu_stand_ins()
    from megatron.core import parallel_state as ps
    tp = world // ep
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=_etp(family, tp))
    torch.manual_seed(99)  # other initial weights: a tensor the load missed shows
    source = build_model(family, tp, ep)
    # the reference in the legacy format: megatron-core caches a torch_dist checkpoint's metadata per process
    _load_into(source, os.path.join(reference, "torch"), "torch", rank, ep)
    a = source.state_dict()
    for written, fmt in checks:  # (one per format: each writes OUT/check_FORMAT.pt)
        target = build_model(family, tp, ep)
        _load_into(target, written, fmt, rank, ep, te_names=True)  # (hybrid writes Megatron-LM's default, TE's, names)
        b = target.state_dict()
        diffs = {k: (a[k] - b[k]).abs().max().item() for k in a if torch.is_tensor(a[k])}
        if fmt == "torch_dist":  # and what the local spec's model reads there (its own names where they differ)
            local = build_model(family, tp, ep)
            _load_into(local, written, fmt, rank, ep)
            c = local.state_dict()
            diffs.update({f"local:{k}": (a[k] - c[k]).abs().max().item() for k in a if torch.is_tensor(a[k])})
        gathered = [None] * world
        dist.all_gather_object(gathered, diffs)
        if rank == 0:
            torch.save({"diffs": gathered, "keys": sorted(diffs)}, os.path.join(out, f"check_{fmt}.pt"))
    dist.destroy_process_group()


# --- a short Megatron training run: megatron-core's data, model, DDP and optimizer ---------------------

TRAIN = dict(global_batch_size=8, micro_batch_size=4, lr=1e-3, weight_decay=0.01, seed=1234, save_at=3, iterations=5)


def _device_stand_ins() -> None:
    """megatron-core's optimizer makes its scalars with device='cuda': made on the CPU instead."""
    for fname in ("tensor", "zeros", "empty", "ones", "full"):
        original = getattr(torch, fname)

        def on_cpu(*args, _original=original, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return _original(*args, **kwargs)
        setattr(torch, fname, on_cpu)


def _train_batches(prefix: str, out: str, seq: int) -> list:
    """Each iteration's global batch of megatron-core's GPTDataset (split 100,0,0, the run's seed), in the
    order Megatron-LM's sampler serves them: samples [k gbs, (k + 1) gbs)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    class Tokenizer:  # what GPTDataset reads of a tokenizer (NullTokenizer --vocab-size 255: EOD 255)
        vocab_size, eod, pad = 256, 255, -1
        unique_identifiers = {"class": "NullTokenizer"}
    t = TRAIN
    config = GPTDatasetConfig(random_seed=t["seed"], sequence_length=seq, blend=([prefix], None), split="100,0,0",
                              path_to_cache=os.path.join(out, "core_cache"), tokenizer=Tokenizer(),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              create_attention_mask=False)
    total = t["iterations"] * t["global_batch_size"]
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [total, None, None], lambda: True, config).build()
    samples = [train[i] for i in range(total)]
    gbs = t["global_batch_size"]
    return [(torch.stack([s["tokens"] for s in samples[k * gbs:(k + 1) * gbs]]),
             torch.stack([s["labels"] for s in samples[k * gbs:(k + 1) * gbs]])) for k in range(t["iterations"])]


def _train_rank(rank: int, world: int, out: str, family: str, prefix: str, port: int) -> None:
    """TP = world: TRAIN["iterations"] Adam steps (megatron-core's FP32Optimizer, decoupled weight decay,
    no clipping: its clipping asserts CUDA tensors) on megatron-core's batches; a torch_dist checkpoint
    with the optimizer state (its model-space form, keyed by the model's sharded keys) after
    TRAIN["save_at"] steps; every step's loss."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _cpu_stand_ins()
    _device_stand_ins()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(1234)
    t, seq = TRAIN, SHAPE["seq_length"]
    model = build_model(family, world)
    model.output_layer.gather_output = False  # its loss: the vocabulary-parallel cross-entropy (see _rank)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=t["lr"], weight_decay=t["weight_decay"],
                                                       adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
                                                       clip_grad=0.0, bf16=False), [ddp])
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    gbs, steps = t["global_batch_size"], t["iterations"] * t["global_batch_size"]
    scheduler = OptimizerParamScheduler(  # as Megatron-LM's: per group lr x lr_mult, wd x wd_mult (0 on norms)
        optimizer, init_lr=t["lr"], max_lr=t["lr"], min_lr=t["lr"], lr_warmup_steps=0, lr_decay_steps=steps,
        lr_decay_style="constant", start_wd=t["weight_decay"], end_wd=t["weight_decay"], wd_incr_steps=steps,
        wd_incr_style="constant")
    batches = _train_batches(prefix, out, seq)  # (the builder's cache: rank 0 writes it, the others wait)
    positions = torch.arange(seq).expand(t["micro_batch_size"], -1)
    mask = torch.triu(torch.ones(1, 1, seq, seq), 1).bool()
    micro = t["global_batch_size"] // t["micro_batch_size"]
    losses = []
    for iteration, (tokens, labels) in enumerate(batches, start=1):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        total = 0.0
        for j in range(micro):
            rows = slice(j * t["micro_batch_size"], (j + 1) * t["micro_batch_size"])
            loss = ddp(tokens[rows], positions, mask, labels=labels[rows]).float().mean() / micro
            loss.backward()
            total += loss.item()
        ddp.finish_grad_sync()
        optimizer.step()
        scheduler.step(increment=gbs)
        losses.append(total)
        if iteration == t["save_at"]:
            args = megatron_args(family, world, iteration)
            args.consumed_train_samples = iteration * t["global_batch_size"]
            args.lr, args.min_lr, args.lr_decay_style = t["lr"], t["lr"], "constant"
            args.weight_decay = t["weight_decay"]
            directory = os.path.join(out, "trained", f"iter_{iteration:07d}")
            if rank == 0:
                os.makedirs(directory, exist_ok=True)
            dist.barrier()
            model_state = model.sharded_state_dict()
            metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
            dist_checkpointing.save({"model": model_state, "optimizer": optimizer.sharded_state_dict(
                model_state, metadata=metadata), "args": args, "checkpoint_version": 3.0, "iteration": iteration,
                "num_floating_point_operations_so_far": 0, "opt_param_scheduler": scheduler.state_dict()}, directory)
            if rank == 0:
                with open(os.path.join(out, "trained", "latest_checkpointed_iteration.txt"), "w") as f:
                    f.write(str(iteration))
    if rank == 0:
        torch.save({"losses": losses, "train": TRAIN}, os.path.join(out, "training.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--check", nargs=2, metavar=("WRITTEN_DIR", "FORMAT"), action="append", default=None,
                   help="load WRITTEN_DIR (torch_dist | torch) with megatron-core and compare it with OUT's checkpoint "
                        "(repeated: each, in one launch; at most one torch_dist)")
    p.add_argument("--family", default="llama", choices=sorted(FAMILIES))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--iteration", type=int, default=7)
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--train", metavar="DATA_PREFIX", default=None,
                   help="train TRAIN['iterations'] steps on DATA_PREFIX (OUT/trained: the checkpoint after "
                        "TRAIN['save_at'] steps, with the optimizer; OUT/training.pt: every step's loss)")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    import torch.multiprocessing as mp
    if a.train:
        mp.spawn(_train_rank, args=(a.tp, a.out, a.family, a.train, a.port), nprocs=a.tp)
        return
    if a.check:
        assert len({fmt for _, fmt in a.check}) == len(a.check), f"--check: one checkpoint per format, got {a.check}"
        mp.spawn(_check, args=(a.tp * a.ep, a.out, a.family, a.out, a.check, a.port, a.ep),
                 nprocs=a.tp * a.ep)
        return
    mp.spawn(_rank, args=(a.tp * a.ep, a.out, a.family, a.iteration, a.port, a.ep), nprocs=a.tp * a.ep)


if __name__ == "__main__":
    sys.exit(main())
