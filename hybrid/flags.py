"""Megatron-LM's command-line flags, in Megatron-LM's --help groups (network size, regularization,
training, initialization, learning rate, checkpointing, mixed precision, distributed, validation,
data and dataloader, tokenizer, logging), plus DeepSpeed's and this project's own.

Parsing only: what the flags mean together is checked in hybrid.config.build_run_config.
"""

from __future__ import annotations

import argparse
import ast

from hybrid.capabilities import SCHEDULE_NAMES
from hybrid.errors import ConfigError
from hybrid.megatron_compat import add_compat_args


class FlagParser(argparse.ArgumentParser):
    """argparse whose errors are one line naming the flag (no usage dump), exit code 2."""

    def error(self, message):
        raise ConfigError(f"{message} (see --help for the flags launch/train.py accepts)")


def _window_size(value: str) -> tuple[int, int]:
    """Megatron-LM's --window-size "(left, right)" (or "left,right"); -1 = unbounded."""
    try:
        left, right = (int(part) for part in value.strip("()[] ").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT such as 4095,0, got {value!r}") from None
    return left, right


def _normalization(value: str) -> str:
    return {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(value.lower(), value)



def _add_network_size_args(p):
    g = p.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "yarn", "alibi"],
                   help="learned_absolute | rope | yarn (rope with YaRN scaling: --rotary-scaling-factor, --yarn-*; "
                        "alibi is refused)")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="alias of --position-embedding-type rope")
    g.add_argument("--no-position-embedding", action="store_true", help="no learned position table (with rope)")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="rope rotates the first int(head dim x this) features of each head, the rest pass (GLM-4.5: "
                        "0.5)")
    g.add_argument("--normalization", default="LayerNorm", type=_normalization, choices=["LayerNorm", "RMSNorm"],
                   help="LayerNorm | RMSNorm (any case, as Megatron-DeepSpeed scripts write rmsnorm)")
    g.add_argument("--layernorm-epsilon", "--norm-epsilon", dest="norm_epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--num-key-value-heads", type=int, default=None,
                   help="Megatron-DeepSpeed's spelling: --group-query-attention --num-query-groups N")
    g.add_argument("--kv-channels", type=int, default=None, help="the head dimension (default hidden/heads; "
                   "Qwen3 and Gemma use their own)")
    g.add_argument("--add-qkv-bias", action="store_true", help="a bias on Q, K and V only (Qwen2)")
    g.add_argument("--qk-layernorm", action="store_true", help="a --normalization norm over each head of Q and K "
                   "(Qwen3)")
    g.add_argument("--qk-norm-across-heads", action="store_true",
                   help="with --qk-layernorm: one RMSNorm over all of Q's heads and one over all of K's (MiniMax-M2)")
    g.add_argument("--llama-4-scaling-beta", type=float, default=None, metavar="B",
                   help="queries x (1 + B ln(1 + floor(position / --llama-4-scaling-length))): Mistral 4's "
                        "long-context attention temperature (B 0.1)")
    g.add_argument("--llama-4-scaling-length", type=int, default=None, metavar="L",
                   help="with --llama-4-scaling-beta: its length (Mistral 4: 8192, its original context)")
    g.add_argument("--window-size", type=_window_size, default=None, metavar="LEFT,0",
                   help="sliding-window attention: each token attends itself and LEFT tokens before it "
                        "(Mistral's sliding_window = LEFT + 1); Megatron-LM's (left, right) with right 0")
    g.add_argument("--window-attn-skip-freq", type=_window_skip_freq, default=None, metavar="N|LIST",
                   help="with --window-size: every N-th layer (1-based) attends fully, the others through the window, "
                        "or a 0/1 list per layer (1: windowed), e.g. ([1]*5+[0])*2 (Gemma 3's 5 local : 1 global)")
    g.add_argument("--local-rotary-base", type=float, default=None,
                   help="the windowed layers' rope base, without rope scaling (Gemma 3: 10000; --rotary-base is the "
                        "full-attention layers')")
    g.add_argument("--softmax-scale", type=float, default=None,
                   help="attention scores times this (default 1/sqrt(head dim); Gemma 3: query_pre_attn_scalar^-0.5)")
    g.add_argument("--sandwich-norms", action="store_true",
                   help="a norm on the attention's and on the MLP's output too, before each residual (Gemma 2/3)")
    g.add_argument("--global-kv-channels", type=int, default=None,
                   help="the full-attention layers' head size where not --kv-channels (Gemma 4's global_head_dim)")
    g.add_argument("--global-num-query-groups", type=int, default=None,
                   help="the full-attention layers' KV heads where not --num-query-groups (Gemma 4's "
                        "num_global_key_value_heads)")
    g.add_argument("--attention-k-eq-v", action="store_true",
                   help="the full-attention layers' keys serve as their values: no value projection (Gemma 4)")
    g.add_argument("--rmsnorm-fp32-scale", action="store_true",
                   help="RMSNorm multiplies by its weight in fp32 and casts after (Gemma 4's numerics; Llama's casts "
                        "first): the same model, other roundings in bf16")
    g.add_argument("--v-norm", action="store_true",
                   help="each value head RMS-normed without a weight (Gemma 4)")
    g.add_argument("--rotary-proportional-percent", type=float, default=None, metavar="P",
                   help="proportional rope on the full-attention layers: the first P of each head's frequencies "
                        "turn, the other feature pairs pass unrotated (Gemma 4: 0.25)")
    g.add_argument("--final-logit-softcapping", type=float, default=None, metavar="C",
                   help="logits -> C tanh(logits / C) (Gemma 2 and 4's final_logit_softcapping)")
    g.add_argument("--layer-scalars", type=_floats, default=None, metavar="LIST",
                   help="each layer's output times this constant, one per layer, comma-separated (Gemma 4's "
                        "layer_scalar; --load-hf reads them from the checkpoint)")
    g.add_argument("--moe-gemma4-block", action="store_true",
                   help="Gemma 4's MoE block (26B-A4B): the shared experts (its dense MLP) and the routed experts each "
                        "normed after, the routed ones reading their own norm of the residual; the router reading the "
                        "residual RMS-normalised times a learned per-feature scale, its weights times a learned "
                        "per-expert scale")
    g.add_argument("--per-layer-input-size", type=int, default=0, metavar="P",
                   help="per-layer inputs (Gemma 4 E2B/E4B's hidden_size_per_layer_input): a table of P features per "
                        "layer and token plus a projection of the embeddings, gated into each layer's output")
    g.add_argument("--num-kv-shared-layers", type=int, default=0, metavar="N",
                   help="the last N layers attend with the keys and values of the last earlier layer of their kind "
                        "(windowed or full) and project queries only (Gemma 4 E2B/E4B)")
    g.add_argument("--double-wide-shared-mlp", action="store_true",
                   help="with --num-kv-shared-layers: those layers' MLPs twice --ffn-hidden-size wide (Gemma 4)")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.1+ rope scaling (low/high frequency factors 1/4, original length 8192)")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="with --use-rope-scaling (Llama 3.2: 32)")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=float, default=None,
                   help="linear rope scaling: positions divided by this factor")
    g.add_argument("--rope-type", default=None, choices=["rope", "yarn"],
                   help="with --multi-latent-attention: its rope (default yarn, as megatron-core's MLA)")
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0, help="YaRN's factor (DeepSeek-V3: 40)")
    g.add_argument("--mscale", type=float, default=1.0, help="YaRN's mscale (the tables' temperature)")
    g.add_argument("--mscale-all-dim", type=float, default=0.0,
                   help="YaRN's mscale_all_dim (MLA: also the softmax scale x mscale(factor, this)^2)")
    g.add_argument("--yarn-original-max-position-embeddings", type=int, default=None,
                   help="YaRN: the context the model was trained at (default 4096, megatron-core's)")
    g.add_argument("--enable-gpt-oss", action="store_true",
                   help="Megatron-LM's post-training switch: GPT-OSS's YaRN (factor 32, original context 131072, "
                        "betas 32 / 1, the correction range not rounded), over the other rope flags")
    g.add_argument("--yarn-beta-fast", type=float, default=32.0)
    g.add_argument("--yarn-beta-slow", type=float, default=1.0)
    g.add_argument("--yarn-correction-range-round-to-int", dest="yarn_correction_range_round_to_int",
                   action="store_true", default=True)
    g.add_argument("--no-yarn-correction-range-round-to-int", dest="yarn_correction_range_round_to_int",
                   action="store_false")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek-V2/V3's multi-head latent attention (--q-lora-rank, --kv-lora-rank, --qk-head-dim, "
                        "--qk-pos-emb-head-dim, --v-head-dim)")
    g.add_argument("--experimental-attention-variant", default=None, choices=["dsa", "gated_delta_net"],
                   help="dsa: DeepSeek sparse attention beside --multi-latent-attention (DeepSeek-V3.2): each query "
                        "attends the --dsa-indexer-topk keys a lightning indexer scores highest (frozen, or trained by "
                        "--dsa-indexer-loss-coeff); gated_delta_net: Gated DeltaNet linear attention on the layers "
                        "--linear-attention-freq names (Qwen3-Next, Qwen3.5)")
    g.add_argument("--linear-attention-freq", type=_linear_attention_freq, default=None,
                   help="gated_delta_net: N (every N-th layer, 1-based, attends fully; the others are linear) or a "
                        "0/1 list per layer (1: linear), as megatron-core")
    g.add_argument("--linear-conv-kernel-dim", type=int, default=4, help="gated_delta_net: the causal conv's taps")
    g.add_argument("--linear-key-head-dim", type=int, default=128, help="gated_delta_net: query / key head size")
    g.add_argument("--linear-value-head-dim", type=int, default=128, help="gated_delta_net: value head size")
    g.add_argument("--linear-num-key-heads", type=int, default=16, help="gated_delta_net: query / key heads")
    g.add_argument("--linear-num-value-heads", type=int, default=32,
                   help="gated_delta_net: value heads (a multiple of the key heads)")
    g.add_argument("--linear-attention-chunk-size", type=int, default=64,
                   help="gated_delta_net: tokens per chunk of the chunked training form (the mathematics does not "
                        "depend on it; the speed and memory do)")
    g.add_argument("--attention-output-gate", action="store_true",
                   help="each attention head's output times sigmoid of a projection of the layer's input (Qwen3.5, "
                        "Qwen3-Next; megatron-core's)")
    g.add_argument("--dsa-indexer-topk", type=int, default=2048, help="DSA: the keys each query attends")
    g.add_argument("--dsa-indexer-n-heads", type=int, default=64, help="DSA: the indexer's heads")
    g.add_argument("--dsa-indexer-head-dim", type=int, default=128, help="DSA: the indexer's head size")
    g.add_argument("--dsa-indexer-topk-freq", type=int, default=1,
                   help="DSA index sharing (GLM-5): past the offset every N-th layer runs its indexer and the layers "
                        "between reuse its choice (megatron-core's; 1: every layer runs its own)")
    g.add_argument("--dsa-indexer-skip-topk-offset", type=int, default=0,
                   help="DSA index sharing: the first layers that always run their indexer (1-based layer L runs it "
                        "when max(L - offset, 0) is a multiple of the frequency)")
    g.add_argument("--dsa-indexer-loss-coeff", type=float, default=0.0,
                   help="DSA: train the indexer by its KL divergence to the main attention, times this "
                        "(megatron-core's; its inputs detached, so the LM loss does not reach it); 0: the indexer "
                        "frozen, as transformers runs it")
    g.add_argument("--dsa-indexer-use-sparse-loss", action="store_true",
                   help="DSA: that KL over each query's chosen top-k keys only (DeepSeek's sparse stage; default: over "
                        "every causal key, its dense warm-up)")
    g.add_argument("--mla-latent-norm-epsilon", type=float, default=None,
                   help="MLA: its latent norms' epsilon where it is not --norm-epsilon (transformers' DeepSeek models: "
                        "1e-6)")
    g.add_argument("--q-lora-rank", type=int, default=None, help="MLA: the queries' latent rank (none: one projection)")
    g.add_argument("--kv-lora-rank", type=int, default=32, help="MLA: the keys' and values' latent rank")
    g.add_argument("--qk-head-dim", type=int, default=128, help="MLA: each query/key head's features without rope")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64, help="MLA: each query/key head's rope features")
    g.add_argument("--v-head-dim", type=int, default=128, help="MLA: each value head's features")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="multi-token prediction (DeepSeek-V3): this many layers after the decoder, depth k predicting "
                        "the token k + 1 ahead; trained, not used by evaluation or generation")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="the multi-token prediction losses' weight (their mean's), as Megatron-LM")
    g.add_argument("--softmax-type", default="vanilla", choices=["vanilla", "learnable"],
                   help="learnable: a learned sink logit per head in the attention's softmax (GPT-OSS); Megatron's "
                        "off-by-one is not built")
    g.add_argument("--quick-geglu", action="store_true",
                   help="gated MLP gate x sigmoid(1.702 gate) x up (GPT-OSS's experts) instead of --swiglu")
    g.add_argument("--glu-linear-offset", type=float, default=0.0, help="--quick-geglu's up half + this (GPT-OSS: 1)")
    g.add_argument("--activation-func-clamp-value", type=float, default=None,
                   help="--quick-geglu's gate clamped <= this and its up half to +-this first (GPT-OSS: 7)")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="norms scale by (1 + weight), weights starting at 0 (Gemma's RMSNorm)")
    g.add_argument("--geglu", action="store_true", help="gated tanh-GeLU MLP (Gemma) instead of --swiglu / GeLU")
    g.add_argument("--scale-embeddings", action="store_true",
                   help="multiply the word embeddings by sqrt(--hidden-size) (Gemma)")
    _add_moe_args(p)
    g.add_argument("--attention-backend", default=None, choices=["auto", "flash", "fused", "unfused", "local"],
                   help="flash = --use-flash-attn; auto/fused/unfused/local = SDPA (torch picks its kernel)")
    g.add_argument("--use-flash-attn", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--padded-vocab-size", type=int, default=None,
                   help="the embedding's rows (>= the tokenizer's vocabulary; Qwen2.5's 152064), then padded for TP "
                        "by --make-vocab-size-divisible-by")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true")


def _add_regularization_args(p):
    g = p.add_argument_group("regularization")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=None)
    g.add_argument("--clip-grad", type=float, default=None)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    # Megatron-LM's Muon flags, with torch.optim.Muon's defaults (Megatron-LM's own: momentum 0.9, no Nesterov)
    g.add_argument("--muon-momentum", type=float, default=0.95, help="--optimizer muon: the momentum")
    g.add_argument("--muon-use-nesterov", action=argparse.BooleanOptionalAction, default=True,
                   help="--optimizer muon: Nesterov momentum (torch.optim.Muon's default; --no-muon-use-nesterov)")
    g.add_argument("--muon-num-ns-steps", type=int, default=5, help="--optimizer muon: Newton-Schulz iterations")
    g.add_argument("--muon-scale-mode", default="original", choices=["original", "match_rms_adamw"],
                   help="--optimizer muon: torch.optim.Muon's adjust_lr_fn (original: sqrt(max(1, rows / cols)); "
                        "match_rms_adamw: 0.2 sqrt(max(rows, cols)))")
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0,
                   help="--optimizer muon: Megatron-LM's extra factor on the update; only 1.0 (torch.optim.Muon has "
                        "none)")


def _add_training_args(p):
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--rampup-batch-size", nargs=3, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="ramp the global batch linearly from START by INCREMENT over SAMPLES samples")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None, help="run length in samples (Megatron-LM)")
    g.add_argument("--train-epochs", type=int, default=None,
                   help="--sft: run length in passes over the training conversations' packed windows "
                        "(becomes --train-samples: epochs x windows)")
    g.add_argument("--train-tokens", type=int, default=None,
                   help="stop once this many tokens were consumed (Megatron-DeepSpeed)")
    g.add_argument("--exit-interval", type=int, default=None, help="stop after an iteration divisible by this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (with --save) and stop once the run has lasted this long")
    g.add_argument("--optimizer", default=None, choices=["adam", "sgd", "muon"],
                   help="muon: torch.optim.Muon on the transformer layers' weight matrices (each HF projection its "
                        "own), AdamW (--adam-*) on embeddings, the output layer, norms and biases")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default="uniform", choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--checkpoint-activations", action="store_true", help="alias: --recompute-granularity full")
    g.add_argument("--checkpoint-num-layers", type=int, default=None, help="alias of --recompute-num-layers")
    g.add_argument("--recompute-activations", action="store_true", help="alias: --recompute-granularity selective")
    g.add_argument("--cpu-offloading", action="store_true",
                   help="with --recompute-granularity full: the checkpointed layer inputs wait for backward in host "
                        "memory (DeepSpeed's activation_checkpointing.cpu_checkpointing; copied on a side CUDA stream)")
    g.add_argument("--activations-checkpoint-method", default=None, choices=["uniform", "block"],
                   help="older Megatron: --recompute-granularity full --recompute-method METHOD")
    g.add_argument("--freeze-layers", default=None, help="layer ranges to freeze, e.g. 0-5,8")
    g.add_argument("--freeze-embeddings", action="store_true")
    g.add_argument("--torch-compile", action="store_true",
                   help="compile each transformer layer with torch.compile (regional compilation); not with ZeRO-3")


def _add_initialization_args(p):
    g = p.add_argument_group("initialization")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--init-method-std", type=float, default=0.02)


def _add_learning_rate_args(p):
    g = p.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear", choices=["constant", "linear", "cosine"])
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-decay-tokens", type=int, default=None, help="decay over tokens (Megatron-DeepSpeed)")
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-tokens", type=int, default=None, help="warm up over tokens (Megatron-DeepSpeed)")


def _add_checkpointing_args(p):
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--async-save", action="store_true",
                   help="copy each checkpoint to host memory and write it in the background while training goes on; "
                        "'latest' moves once it is complete (at the next log line, save or the end of the run)")
    g.add_argument("--load-hf", default=None, metavar="HF_DIR",
                   help="start from a local HuggingFace model directory (Llama, Mistral, Qwen2/3, Gemma, GPT-2): "
                        "its architecture, weights (converted at this run's layout) and tokenizer; the LR schedule "
                        "starts at 0. A checkpoint in --load, when there is one, is resumed instead")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--allow-unsafe-checkpoint-load", action="store_true",
                   help="UNSAFE: unpickle checkpoint files fully, which runs any code they hold; only for files "
                        "you trust (by default every file is read with weights_only=True and an allow-list)")
    g.add_argument("--universal-checkpoint", action="store_true",
                   help="load the --load directory's universal checkpoint (made by conversion/checkpoint_util.py "
                        "--saver universal) at any TP/PP/DP/ZeRO layout, with optimizer state (Megatron-DeepSpeed)")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model architecture and parallel sizes from the --load checkpoint")
    g.add_argument("--no-save-rng", action="store_true",
                   help="checkpoints hold no RNG states: a resumed run's dropout continues from its own seeds")


def _add_mixed_precision_args(p):
    g = p.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale (fp16); dynamic if unset")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce gradients in bf16 (DeepSpeed's communication_data_type); needs --bf16")
    add_fp8_flags(g)
    g.add_argument("--fp8-param-gather", action="store_true",
                   help="refused: DeepSpeed's ZeRO gathers parameters in their own dtype (see README)")


def add_fp8_flags(g) -> None:
    """FP8 (Megatron-LM's flags) on torchao.float8's casts (hybrid.parallel.fp8): training's and evaluation's."""
    g.add_argument("--fp8-format", default=None, choices=["e4m3", "hybrid"],
                   help="FP8 GEMMs in the transformer layers' linear layers: e4m3 everywhere, or hybrid (gradients "
                        "e5m2); embeddings, output layer, norms and attention stay in the high precision")
    g.add_argument("--fp8-recipe", default=None, choices=["tensorwise", "rowwise", "delayed", "mxfp8", "blockwise"],
                   help="scaling: tensorwise / rowwise (torchao's recipes), delayed (an amax history per tensor, "
                        "Megatron-LM's default, taken when --fp8-format is given alone); mxfp8 and blockwise are "
                        "refused (not built); without --fp8-format it is refused")
    g.add_argument("--fp8-amax-history-len", type=int, default=1, help="delayed: iterations of amax history")
    g.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"],
                   help="delayed: the scale from the newest amax or the history's largest")
    g.add_argument("--fp8-margin", type=int, default=0, help="delayed: scales divided by 2^margin")
    g.add_argument("--first-last-layers-bf16", action="store_true",
                   help="keep the first --num-layers-at-start-in-bf16 and last --num-layers-at-end-in-bf16 "
                        "transformer layers out of FP8")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=1)
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=1)


def _floats(text: str) -> tuple:
    """A comma-separated list of numbers (--layer-scalars)."""
    try:
        return tuple(float(x) for x in text.strip("[]() ").split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None


def _window_skip_freq(text: str):
    """Megatron-LM's --window-attn-skip-freq: N or a per-layer 0/1 list, spelled as --moe-layer-freq's."""
    try:
        return _moe_layer_freq(text)
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(str(error).replace("--moe-layer-freq", "--window-attn-skip-freq")) from None


def _linear_attention_freq(text: str):
    """megatron-core's --linear-attention-freq: N or a per-layer 0/1 list, spelled as --moe-layer-freq's."""
    try:
        return _moe_layer_freq(text)
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(str(error).replace("--moe-layer-freq", "--linear-attention-freq")) from None


def _moe_layer_freq(text: str):
    """Megatron-LM's --moe-layer-freq: N (every N-th layer, from layer 0) or a per-layer 0/1 list, written
    as a list ("[1,0,1,0]") or Megatron's expression ("([1]*3+[0])*2"); read without eval."""
    try:
        return int(text)
    except ValueError:
        pass

    def value(node):
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(text)
    try:
        layers = value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {text!r}: give N or a list of 0/1 per layer, e.g. "
                                         f"[1,0,1,0] or ([1]*3+[0])*2") from None
    if not isinstance(layers, list):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {text!r}: a list of 0/1 per layer, or N")
    return layers


def _add_moe_args(p):
    g = p.add_argument_group("mixture of experts (Megatron-LM's flags)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="split each layer's experts over this many ranks inside DP (all-to-all token dispatch)")
    g.add_argument("--moe-layer-freq", type=_moe_layer_freq, default=1,
                   help="N: every N-th layer from layer 0 is MoE; or a 0/1 list per layer")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's width (default --ffn-hidden-size)")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"])
    g.add_argument("--moe-router-dtype", default=None, choices=["fp32", "fp64"],
                   help="fp32: the router's GEMM in fp32 under bf16 (megatron-core's; --load-hf of DeepSeek-V3 and "
                        "GLM-4.5 sets it, as transformers routes them); default: the input's dtype")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over every expert, then top-k (Qwen2-MoE without norm_topk_prob)")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="group-limited routing: the experts in this many equal groups (DeepSeek-V3: 8)")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="group-limited routing: each token's experts come from the this many groups whose top "
                        "topk / N scores sum highest (DeepSeek-V3: 4)")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "none"])
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="auxiliary-loss-free balancing: a score bias per expert moved after each step (sigmoid)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-shared-expert-gate", action="store_true", help="sigmoid-gated shared experts (Qwen2-MoE)")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="each expert takes at most ceil(tokens x k / E x factor) tokens; default dropless")
    g.add_argument("--moe-token-drop-policy", default="probs", choices=["probs", "position"])
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="with --moe-expert-capacity-factor: every expert gets exactly its capacity of rows (the "
                        "kept ones, then zero-weight padding), so the dispatch needs no host sync at any EP")
    g.add_argument("--moe-routing-replay", nargs="?", const="R3", default=None, choices=["R3", "R2"],
                   help="--grpo: the training forward routes each token to recorded experts, weighed by the live "
                        "router (which keeps learning; megatron-core's RouterReplay): R3 (the default) the experts "
                        "the generator chose (verl's R3, slime's rollout routing replay), R2 those the trainer chose "
                        "with the weights that generated the batch (verl's R2: later --grpo-iterations passes route "
                        "as the first); without it the share that differs is logged only (routing_mismatch)")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="one grouped GEMM for all local experts (torch._grouped_mm) where the device has it")
    g.add_argument("--moe-token-dispatcher-type", default="alltoall", choices=["alltoall", "allgather", "flex"],
                   help="accepted; tokens always travel by all-to-all (the same values)")


def _add_distributed_args(p):
    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--no-async-tensor-model-parallel-allreduce", action="store_true",
                   help="run each column-parallel layer's backward TP all-reduce (SP: reduce-scatter) after its "
                        "weight gradient instead of beside it (the default overlaps them; same values)")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split each sequence over this many ranks (ring attention over K/V blocks, Megatron's "
                        "causal load balancing); gradients and ZeRO span DP x CP")
    g.add_argument("--ds-sequence-parallel-size", type=int, default=1,
                   help="DeepSpeed-Ulysses: split each sequence over this many ranks, all-to-all to whole sequences "
                        "of heads / N around attention (deepspeed.sequence); gradients and ZeRO span DP x N")
    g.add_argument("--cp-comm-type", nargs="+", default=["p2p"],
                   help="context-parallel communication: p2p (the K/V ring; the one built)")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--pipeline-partition", "--pp-partition-method", dest="pipeline_partition", default="parameters",
                   help="1f1b: how the layers are divided over the stages, as DeepSpeed's PipelineModule divides "
                        "them: parameters (balanced by parameter counts) | uniform | comma-separated layers per stage "
                        "(e.g. 3,5)")
    g.add_argument("--pipeline-schedule", default=None,
                   choices=SCHEDULE_NAMES,
                   help="every schedule runs in torch.distributed.pipelining, each stage registered with DeepSpeed "
                        "(ZeRO-0/1/2/3, offload): 1f1b (one stage per rank, the default), interleaved-1f1b "
                        "(Megatron's virtual stages; default when virtual stages are set), zero-bubble (interleaved, "
                        "each backward split into input- and weight-gradient steps), zbv (zero-bubble V: 2 stages per "
                        "rank, first and last on rank 0), dualpipev (DeepSeek's DualPipe on a V)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers in each virtual stage; virtual stages per rank = num-layers / (PP x this)")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="virtual pipeline stages per rank (current Megatron-LM's spelling of the setting above)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="ZeRO-1 when the DeepSpeed config sets no stage")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="default: nccl on CUDA, gloo on CPU")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                   help="set by older launchers; the environment's LOCAL_RANK is used")


def _add_validation_args(p):
    g = p.add_argument_group("validation")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)


def _add_data_args(p):
    g = p.add_argument_group("data and dataloader")
    g.add_argument("--data-path", nargs="+", default=None, help="prefix, or weight prefix weight prefix ...")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--train-data-path", nargs="+", default=None, help="the train split's own blend (all its documents)")
    g.add_argument("--valid-data-path", nargs="+", default=None, help="the valid split's own blend")
    g.add_argument("--test-data-path", nargs="+", default=None, help="the test split's own blend")
    g.add_argument("--data-cache-path", default=None,
                   help="directory for the sample-index cache (default: beside the data)")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--num-workers", type=int, default=0)
    g.add_argument("--data-impl", "--dataset-impl", dest="data_impl", default="mmap", choices=["mmap"])
    g.add_argument("--mmap-bin-files", dest="mmap_bin_files", action="store_true", default=True,
                   help="memory-map the .bin files (always done; accepted)")
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false",
                   help="accepted: the .bin files are memory-mapped either way, which reads the same tokens")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss at positions whose input token is EOD")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="packed documents: each token attends only tokens of its own document (after the last EOD)")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="packed documents: positions restart at 0 after each EOD token")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="the iteration's loss is the mean over every valid token of the global batch (default: "
                        "the mean of each micro-batch's token mean; equal unless --eod-mask-loss masks tokens)")
    g.add_argument("--sft", action="store_true",
                   help="supervised fine-tuning on conversations: --data-path names JSONL / Parquet files or datasets "
                        "save_to_disk directories (messages, ShareGPT, Alpaca, prompt/completion or input_ids rows), "
                        "tokenized with the tokenizer's chat template, loss on the assistant's tokens, packed")
    g.add_argument("--sft-train-on-prompt", action="store_true",
                   help="--sft: every token of a conversation takes loss (default: the assistant's only)")
    g.add_argument("--sft-truncation", default="truncate", choices=["truncate", "drop"],
                   help="--sft: a conversation longer than --seq-length + 1 tokens is cut to it or dropped (counted)")
    g.add_argument("--sft-skip-bad", action="store_true",
                   help="--sft: count and skip malformed rows (default: stop at the first, naming file and line)")
    g.add_argument("--sft-streaming", action="store_true",
                   help="--sft / --dpo: tokenize the training rows in a background process while training runs "
                        "(a shuffle buffer, a cache of tokenized blocks beside the data) instead of the whole file "
                        "before the first iteration")
    g.add_argument("--sft-shuffle-buffer", type=int, default=10000, metavar="N",
                   help="--sft-streaming: conversations held in the shuffle buffer (datasets' IterableDataset.shuffle)")
    g.add_argument("--dpo", action="store_true",
                   help="direct preference optimisation: --data-path holds TRL's prompt/chosen/rejected rows; the "
                        "reference model is --load-hf's, frozen")
    g.add_argument("--dpo-beta", type=float, default=0.1, help="--dpo: the KL weight beta")
    g.add_argument("--dpo-label-smoothing", type=float, default=0.0,
                   help="--dpo: the probability that a preference label is wrong (conservative DPO; sigmoid loss)")
    g.add_argument("--dpo-loss-type", default="sigmoid", choices=["sigmoid", "ipo"], help="--dpo: TRL's loss_type")
    g.add_argument("--dpo-max-length", type=int, default=0, metavar="N",
                   help="--dpo: TRL's max_length, each side's most tokens (prompt + answer); both sides share one "
                        "window, so at most --seq-length / 2 (the default)")
    g.add_argument("--dpo-max-prompt-length", type=int, default=0, metavar="N",
                   help="--dpo: a prompt keeps its last N tokens before the sides are cut (TRL 0.x's "
                        "max_prompt_length; default: the whole prompt, as TRL 1.x)")
    g.add_argument("--dpo-truncation-mode", default="keep_start", choices=["keep_start", "keep_end"],
                   help="--dpo: TRL's truncation_mode: a side longer than --dpo-max-length keeps its start (a pair "
                        "whose prompt alone fills it is dropped, as TRL drops it) or its end")
    g.add_argument("--dpo-reference-logps", default=None, metavar="FILE",
                   help="--dpo: the reference model's log-probabilities of every window, read from FILE, or computed "
                        "once before training and written there; either way training holds no reference model")
    g.add_argument("--grpo", action="store_true",
                   help="reinforcement learning (TRL's GRPO) on the engine's own completions: --data-path holds prompt "
                        "rows (JSONL / Parquet: 'prompt' text or messages, or 'messages'; other columns go to the "
                        "rewards), none: the embedded arithmetic task; --global-batch-size counts completions")
    g.add_argument("--reward-function", nargs="+", default=None, metavar="FILE.py:NAME",
                   help="--grpo: reward functions with TRL's signature (prompts, completions, completion_ids, "
                        "**columns) -> list of floats (default: the embedded task's digits and exact_answer)")
    g.add_argument("--reward-weights", nargs="+", type=float, default=None,
                   help="--grpo: one weight per --reward-function (default 1 each)")
    g.add_argument("--grpo-group-size", type=int, default=8, help="--grpo: completions per prompt (num_generations)")
    g.add_argument("--grpo-epsilon", type=float, default=0.2, help="--grpo: the ratio's clip range (epsilon)")
    g.add_argument("--grpo-epsilon-high", type=float, default=None,
                   help="--grpo: the upper clip (DAPO's clip-higher; default --grpo-epsilon)")
    g.add_argument("--grpo-beta", type=float, default=0.0,
                   help="--grpo: the KL weight to the starting policy (--load-hf's, frozen); 0: none, as TRL")
    g.add_argument("--grpo-loss-type", default="dapo",
                   choices=["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"],
                   help="--grpo: TRL's loss_type: the clipped surrogate as per-sequence means (grpo), a token mean "
                        "over the batch (dapo; bnpo: per micro-batch), sums over rows x --max-new-tokens (dr_grpo) or "
                        "per-sequence sums (luspo); CISPO's clipped, detached ratio times the log-probability (a "
                        "token mean); SAPO's soft gate (per-sequence means); VESPO's gamma-weighted sequence ratio "
                        "(a token mean)")
    g.add_argument("--grpo-importance-sampling-level", default="token", choices=["token", "sequence"],
                   help="--grpo: one ratio per token, or per sequence (GSPO: its tokens' mean log-ratio)")
    g.add_argument("--grpo-delta", type=float, default=None,
                   help="--grpo: the ratio's upper bound in the clipped losses (TRL's delta: two-sided clipping)")
    g.add_argument("--grpo-sapo-temperature-pos", type=float, default=1.0,
                   help="--grpo-loss-type sapo: the gate's temperature for positive advantages")
    g.add_argument("--grpo-sapo-temperature-neg", type=float, default=1.05,
                   help="--grpo-loss-type sapo: the gate's temperature for negative advantages")
    for sign, k, lam in (("pos", 2.0, 3.0), ("neg", 3.0, 2.0)):
        g.add_argument(f"--grpo-vespo-k-{sign}", type=float, default=k,
                       help=f"--grpo-loss-type vespo: the gamma weight's k for {sign}itive advantages")
        g.add_argument(f"--grpo-vespo-lambda-{sign}", type=float, default=lam,
                       help=f"--grpo-loss-type vespo: the gamma weight's lambda for {sign}itive advantages")
    g.add_argument("--grpo-rollout-correction", default=None,
                   choices=["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"],
                   help="--grpo: weigh each token's loss by exp(trainer - sampler log-probability) per token or per "
                        "sequence, truncated to or masked outside [min, max] (TRL's vLLM importance sampling "
                        "correction, verl's TIS / MIS); default off")
    g.add_argument("--grpo-rollout-correction-clip-min", type=float, default=None,
                   help="--grpo-rollout-correction: the ratio's lower bound (default none)")
    g.add_argument("--grpo-rollout-correction-clip-max", type=float, default=3.0,
                   help="--grpo-rollout-correction: the ratio's upper bound (default 3.0, TRL's)")
    g.add_argument("--grpo-off-policy-mask-threshold", type=float, default=None,
                   help="--grpo: drop a negative-advantage sequence whose mean KL(sampler || trainer) exceeds this "
                        "(DeepSeek-V3.2's off-policy sequence masking)")
    g.add_argument("--grpo-top-entropy-quantile", type=float, default=1.0,
                   help="--grpo: train the policy term on this share of each micro-batch's highest-entropy completion "
                        "tokens, over the data-parallel ranks (TRL's top_entropy_quantile; 1.0: every token)")
    g.add_argument("--grpo-mask-truncated-completions", action="store_true",
                   help="--grpo: completions that reach --max-new-tokens without an end token train on nothing")
    g.add_argument("--grpo-scale-rewards", default="group", choices=["group", "batch", "none"],
                   help="--grpo: divide advantages by the group's (or batch's) reward std; none: Dr. GRPO")
    g.add_argument("--grpo-iterations", type=int, default=1,
                   help="--grpo: optimizer steps on each generation batch (TRL's num_iterations)")
    g.add_argument("--max-new-tokens", type=int, default=64,
                   help="--grpo: the completion limit (every turn's tokens and the environment's replies together)")
    g.add_argument("--grpo-dynamic-sampling", action="store_true",
                   help="--grpo: DAPO's dynamic sampling: groups whose rewards all agree are dropped and more prompts "
                        "sampled until the batch is full (verl's filter_groups)")
    g.add_argument("--grpo-dynamic-sampling-max-rounds", type=int, default=8,
                   help="--grpo-dynamic-sampling: sampling rounds per batch at most (then topped up with dropped "
                        "groups)")
    g.add_argument("--grpo-reasoning-gym", nargs="+", default=None, metavar="TASK",
                   help="--grpo: prompts and reward from reasoning_gym's tasks (basic_arithmetic, chain_sum, ...; "
                        "pip install reasoning-gym), its own scorer the reward unless --reward-function is given")
    g.add_argument("--grpo-reasoning-gym-size", type=int, default=None,
                   help="--grpo-reasoning-gym: entries per task (seeded by --seed; default 1000)")
    g.add_argument("--grpo-environment", default=None, metavar="FILE.py:NAME",
                   help="--grpo: multi-turn rollouts: a class (or factory) with Gym's step(text) (and reset(**columns),"
                        " get_reward()), one instance per completion; its replies are masked from the loss")
    g.add_argument("--grpo-max-turns", type=int, default=4,
                   help="--grpo-environment: the model's turns per episode at most")
    g.add_argument("--grpo-max-tokens-per-turn", type=int, default=None,
                   help="--grpo-environment: a turn's tokens at most (default: the completion's remaining budget)")
    g.add_argument("--temperature", type=float, default=1.0, help="--grpo: the sampling temperature (> 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="--grpo: nucleus sampling (transformers' top_p)")
    g.add_argument("--top-k", type=int, default=0, help="--grpo: top-k sampling (0: off)")
    g.add_argument("--legacy-data-rules", action="store_true",
                   help="split rounding and blended sample counts of Megatron-DeepSpeed / Megatron-LM before "
                        "megatron-core (default: megatron-core's rules), to resume runs started there")


def _add_tokenizer_args(p):
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default=None,
                   choices=["GPT2BPETokenizer", "HFTokenizer", "HuggingFaceTokenizer", "PretrainedFromHF",
                            "NullTokenizer", "GPTSentencePieceTokenizer", "SentencePieceTokenizer", "Llama2Tokenizer"])
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", "--tokenizer-name-or-path", dest="tokenizer_model", default=None,
                   help="a local HF tokenizer directory or a SentencePiece .model file")
    g.add_argument("--vocab-size", type=int, default=None)


def _add_logging_args(p):
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_true",
                   default=True,
                   help="stop at the first non-finite loss or gradient norm (the default, as Megatron-LM): "
                   "read on the device and checked at each log and before each save; no update is applied from it")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="train on through non-finite losses (DeepSpeed skips those steps)")
    g.add_argument("--log-json", default=None, help="rank 0 writes one JSON object per logged iteration")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", "--wandb-name", dest="wandb_exp_name", default=None)
    g.add_argument("--wandb-save-dir", default=None, help="where wandb writes its files")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="log allocated/peak accelerator memory with each log line")
    g.add_argument("--no-progress-bar", action="store_true")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="the accelerator's peak TFLOP/s for the logged MFU (default: the GPU's from a table of "
                        "A100, H100, H200, GH200, B200, L40S, L4 in the run's precision; CPU: no MFU)")
    g.add_argument("--profile", action="store_true",
                   help="torch.profiler traces of iterations --profile-step-start to --profile-step-end on "
                        "--profile-ranks, written to --profile-dir")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0])
    g.add_argument("--profile-dir", default=None,
                   help="where --profile writes (default: --tensorboard-dir, else SAVE/profile, else ./profile)")
    g.add_argument("--record-memory-history", action="store_true",
                   help="record CUDA allocations from the start and write a memory snapshot (torch's "
                        "memory_viz format) at --profile-step-end, on --profile-ranks")
    g.add_argument("--memory-snapshot-path", default="snapshot.pickle",
                   help="the snapshot file (rank r > 0 adds .rank{r}); default snapshot.pickle")


def _add_deepspeed_args(p):
    g = p.add_argument_group("deepspeed")
    g.add_argument("--deepspeed", nargs="?", const=True, default=None,
                   help="use DeepSpeed (always on); may be followed by the config path")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None)
    g.add_argument("--zero-stage", type=int, default=None, choices=[0, 1, 2, 3])


def _add_after_training_args(p):
    g = p.add_argument_group("after training (the embedded default runs all three)")
    g.add_argument("--export-hf", default=None,
                   help="after training, export the final --save checkpoint to this HuggingFace directory")
    g.add_argument("--sample-prompt", default=None,
                   help="after --export-hf, print a short continuation of this text generated by transformers")
    g.add_argument("--no-demo", action="store_true",
                   help="on the embedded default corpus: do not save to runs/default, export or print a sample")


def _add_lora_args(p):
    g = p.add_argument_group("LoRA (low-rank adapters, PEFT's names; the base model frozen)")
    g.add_argument("--lora-rank", type=int, default=None,
                   help="train low-rank adapters of this rank beside --lora-target-modules, every other weight frozen "
                        "(no gradients, no optimizer state); PEFT's r")
    g.add_argument("--lora-alpha", type=float, default=None, help="the adapters' output x alpha / rank (default 8)")
    g.add_argument("--lora-dropout", type=float, default=None, help="dropout on the adapters' input (default 0)")
    g.add_argument("--lora-target-modules", nargs="+", default=None,
                   help="the HF projections to adapt: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or "
                        "all-linear (default: q_proj v_proj, PEFT's for Llama-style models); the fused QKV and "
                        "gate/up carry one adapter per projection")
    g.add_argument("--lora-use-rslora", action="store_const", const=True, default=None,
                   help="rank-stabilised LoRA: alpha / sqrt(rank)")
    g.add_argument("--lora-modules-to-save", nargs="+", default=None, choices=["embed_tokens", "lm_head"],
                   help="modules that train whole beside the adapters (PEFT's modules_to_save; an untied model's)")
    g.add_argument("--load-lora", default=None,
                   help="start the adapters from this PEFT adapter directory (adapter_config.json + "
                        "adapter_model.safetensors); its config sets the LoRA flags (given ones must match)")


def _add_dry_run_args(p):
    g = p.add_argument_group("memory estimate (nothing is built)")
    g.add_argument("--dry-run", action="store_true",
                   help="print the memory per rank and pipeline stage (parameters, gradients, optimizer states, "
                        "activations) as a table and JSON, then exit")
    g.add_argument("--dry-run-world-size", type=int, default=None,
                   help="plan for this many ranks (default: the launcher's WORLD_SIZE, else 1)")
    g.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="with --dry-run: say whether the run fits in this much memory per GPU, and if not the "
                        "smallest change that would")


_GROUPS = (_add_network_size_args, _add_regularization_args, _add_training_args, _add_initialization_args,
           _add_learning_rate_args, _add_checkpointing_args, _add_mixed_precision_args, _add_distributed_args,
           _add_validation_args, _add_data_args, _add_tokenizer_args, _add_logging_args, _add_deepspeed_args,
           _add_after_training_args, _add_lora_args, _add_dry_run_args)


def build_parser() -> argparse.ArgumentParser:
    """Every flag launch/train.py accepts, grouped as Megatron-LM's --help groups them."""
    p = FlagParser(description="Train a GPT with Megatron-style parallelism on DeepSpeed.", allow_abbrev=False)
    for add in _GROUPS:
        add(p)
    add_compat_args(p)
    return p
