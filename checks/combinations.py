"""Every pair of the axes and features the capability table knows (and the triples users run), on at most
4 CPU ranks with a tiny model: each combination is either refused before any rank starts, by a rule of the
table (hybrid.capabilities) with its message, or trains 4 iterations whose losses equal one rank's (dropout off;
fp32 within 1e-5 relative; bf16 and FP8 compared with one rank's bf16 / FP8 run; every cell within 5% of the
loss's own change over the 4 iterations, so a wrong update cannot pass as rounding; with dropout the layouts draw
other masks and only the resume is compared) and resumes from its iteration-2 checkpoint with iterations 3-4
bitwise those of the uninterrupted run.

    python checks/combinations.py                     # the whole sweep: matrix in checks/results/
    python checks/combinations.py --only tp2_sp+pp2,ep2+cp2 --quick

Writes checks/results/combinations.md (the pair matrix and the triples) and combinations.png (a heatmap),
and prints one JSON line per combination. The runs go through launch/train.py's own entry
(hybrid.training.run.run_training) on gloo ranks kept in a pool (checks/rank_pool.py), so a combination
costs seconds, not a process start.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MOE = ["--num-experts", 4, "--moe-router-topk", 2, "--moe-ffn-hidden-size", 24, "--disable-bias-linear",
       "--moe-aux-loss-coeff", 0.1, "--moe-z-loss-coeff", 0.01]
PP2 = ["--pipeline-model-parallel-size", 2]


@dataclass(frozen=True)
class Feature:
    """One axis or option: its flags, the ranks it multiplies the world by, what it changes."""

    flags: tuple
    ranks: int = 1  # the factor on the world size
    kind: str = "layout"  # layout: same mathematics as one rank; model / precision / dropout: changes it
    group: str = ""  # features of one group are alternatives (never paired)
    paired: bool = True  # in the sweep's singles and pairs (False: only in the triples that name it)


DSA = ("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
       "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", 16, "--kv-lora-rank", 12, "--qk-head-dim", 8,
       "--qk-pos-emb-head-dim", 4, "--v-head-dim", 6, "--experimental-attention-variant", "dsa",
       "--dsa-indexer-topk", 8, "--dsa-indexer-n-heads", 4, "--dsa-indexer-head-dim", 8)
GEMMA4 = ("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--geglu", "--scale-embeddings",
          "--qk-layernorm", "--sandwich-norms", "--window-size", "2,0", "--window-attn-skip-freq", 2,
          "--local-rotary-base", 10000, "--rotary-proportional-percent", 0.25, "--softmax-scale", 1, "--kv-channels", 8,
          "--global-kv-channels", 16, "--v-norm", "--rmsnorm-fp32-scale", "--final-logit-softcapping", 5,
          "--layer-scalars", "0.9,1.1,0.8,1.2")
FEATURES = {
    "dp2": Feature((), 2, group="dp"),
    "tp2": Feature(("--tensor-model-parallel-size", 2), 2, group="tp"),
    "tp2_sp": Feature(("--tensor-model-parallel-size", 2, "--sequence-parallel"), 2, group="tp"),
    "cp2": Feature(("--context-parallel-size", 2), 2, group="sequence"),
    "ulysses2": Feature(("--ds-sequence-parallel-size", 2), 2, group="sequence"),
    "pp2": Feature(tuple(PP2), 2, group="pp"),
    "pp2_interleaved": Feature(tuple(PP2 + ["--num-virtual-stages-per-pipeline-rank", 2]), 2, group="pp"),
    "pp2_zero_bubble": Feature(tuple(PP2 + ["--pipeline-schedule", "zero-bubble",
                                            "--num-virtual-stages-per-pipeline-rank", 2]), 2, group="pp"),
    "pp2_zbv": Feature(tuple(PP2 + ["--pipeline-schedule", "zbv"]), 2, group="pp"),
    "pp2_dualpipev": Feature(tuple(PP2 + ["--pipeline-schedule", "dualpipev"]), 2, group="pp"),
    "ep2": Feature(tuple(MOE + ["--expert-model-parallel-size", 2]), 2, group="moe"),  # experts over DP 2
    "zero1": Feature(("--zero-stage", 1), group="zero"),
    "zero2": Feature(("--zero-stage", 2), group="zero"),
    "zero3": Feature(("--zero-stage", 3), group="zero"),
    "offload": Feature(("--deepspeed", os.path.join(ROOT, "ds_configs", "zero1_offload.json")), group="zero"),
    "zero3_offload": Feature(("--deepspeed", os.path.join(ROOT, "ds_configs", "zero3_offload.json")), group="zero"),
    "recompute_full": Feature(("--recompute-granularity", "full"), group="recompute"),
    "recompute_selective": Feature(("--recompute-granularity", "selective"), group="recompute"),
    "compile": Feature(("--torch-compile",)),
    "moe": Feature(tuple(MOE), kind="model", group="moe"),
    "documents": Feature(("--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"), kind="model"),
    "llama": Feature(("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                      "--group-query-attention", "--num-query-groups", 2, "--untie-embeddings-and-output-weights"),
                     kind="model", group="family"),
    "qwen3": Feature(("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--qk-layernorm",
                      "--kv-channels", 16, "--group-query-attention", "--num-query-groups", 2),
                     kind="model", group="family"),
    "gemma": Feature(("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--geglu",
                      "--apply-layernorm-1p", "--scale-embeddings"), kind="model", group="family"),
    # DeepSeek-V3's attention: query and key-value latents, heads of 8 + 4 (rope) and values of 6, YaRN's default
    "mla": Feature(("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                    "--disable-bias-linear", "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", 16,
                    "--kv-lora-rank", 12, "--qk-head-dim", 8, "--qk-pos-emb-head-dim", 4, "--v-head-dim", 6),
                   kind="model", group="family"),
    # DeepSeek-V3.2's sparse attention: MLA with its frozen indexer choosing each query's top 8 keys (of 32)
    "dsa": Feature(DSA, kind="model", group="family"),
    # DSA's indexer trained by its KL loss to the main attention (megatron-core's), over every causal key and, sparse,
    # over the chosen ones only, in triples
    "dsa_loss": Feature(DSA + ("--dsa-indexer-loss-coeff", 0.5), kind="model", group="family", paired=False),
    "dsa_sparse_loss": Feature(DSA + ("--dsa-indexer-loss-coeff", 0.5, "--dsa-indexer-use-sparse-loss"),
                               kind="model", group="family", paired=False),
    # GLM-5's: DSA with index sharing (layers 2 and 4 attend the keys layers 1 and 3 chose), in triples
    "dsa_shared": Feature(("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                           "--disable-bias-linear", "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", 16,
                           "--kv-lora-rank", 12, "--qk-head-dim", 8, "--qk-pos-emb-head-dim", 4, "--v-head-dim", 6,
                           "--experimental-attention-variant", "dsa", "--dsa-indexer-topk", 8,
                           "--dsa-indexer-n-heads", 4, "--dsa-indexer-head-dim", 8, "--dsa-indexer-topk-freq", 2,
                           "--dsa-indexer-skip-topk-offset", 1), kind="model", group="family", paired=False),
    # MiniMax-M2's attention: Q/K RMSNorms across all heads (their statistics summed over TP), rope on half a head
    "heads_norm": Feature(("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                           "--qk-layernorm", "--qk-norm-across-heads", "--kv-channels", 16, "--group-query-attention",
                           "--num-query-groups", 2, "--rotary-percent", 0.5), kind="model", group="family"),
    # Mistral 4's query temperature past 8 positions (each CP rank's positions its own), in triples
    "query_temperature": Feature(("--position-embedding-type", "rope", "--llama-4-scaling-beta", 0.3,
                                  "--llama-4-scaling-length", 8), kind="model", paired=False),
    # Gemma 4's (31B form): windowed layers (3) and full ones with heads of 16 (windowed: 8) and 4 KV heads (2) whose
    # keys are the values, values normed, proportional rope on the full layers, unscaled scores, layer scalars,
    # soft-capped logits
    "gemma4": Feature(GEMMA4 + ("--group-query-attention", "--num-query-groups", 2, "--global-num-query-groups", 4,
                                "--attention-k-eq-v"), kind="model", group="family"),
    # its E2B/E4B form: per-layer inputs (4 features per layer), the last 2 layers attending with layers 0's and 1's
    # keys and values, their MLPs twice as wide (pipelines and full recompute refused by the table), in triples
    "gemma4_e": Feature(GEMMA4 + ("--per-layer-input-size", 4, "--num-kv-shared-layers", 2,
                                  "--double-wide-shared-mlp"), kind="model", group="family", paired=False),
    # its 26B-A4B form: that attention with Gemma 4's MoE block beside every dense MLP, in triples
    "gemma4_moe": Feature(GEMMA4 + ("--group-query-attention", "--num-query-groups", 2, "--global-num-query-groups", 4,
                                    "--attention-k-eq-v", *MOE, "--moe-shared-expert-intermediate-size", 32,
                                    "--moe-gemma4-block"), kind="model", group="family", paired=False),
    # Qwen3.5's: layers 0 and 2 Gated DeltaNet (2 key heads, each with 2 value heads; chunks of 4 over the 16
    # positions), 1 and 3 gated full attention with rope on half a head, zero-centred norms
    "gdn": Feature(("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--qk-layernorm",
                    "--apply-layernorm-1p", "--rotary-percent", 0.5, "--attention-output-gate",
                    "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", 2,
                    "--linear-num-key-heads", 2, "--linear-num-value-heads", 4, "--linear-key-head-dim", 8,
                    "--linear-value-head-dim", 8, "--linear-attention-chunk-size", 4), kind="model", group="family"),
    "mtp": Feature(("--position-embedding-type", "rope", "--mtp-num-layers", 1, "--mtp-loss-scaling-factor", 0.3),
                   kind="model"),  # (rope: the depths see positions as rope does)
    "window": Feature(("--window-size", "4,0"), kind="model"),
    "bf16": Feature(("--bf16",), kind="precision"),
    "fp8": Feature(("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"), kind="precision", group="fp8"),
    "fp8_delayed": Feature(("--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", 4,
                            "--fp8-amax-compute-algo", "max"), kind="precision", group="fp8"),
    "dropout": Feature(("--hidden-dropout", 0.1, "--attention-dropout", 0.1), kind="dropout"),
    # torch.optim.Muon's update (hybrid.training.muon), compared with one rank's Muon run (fp32's tolerance: at
    # this model's learning rate the bf16 Newton-Schulz's roundings stay far below it, 2e-7 measured)
    "muon": Feature(("--optimizer", "muon"), kind="optimizer"),
    # LoRA (hybrid.model.lora): PEFT's fresh adapters on the attention's projections (every family, MoE included),
    # the base frozen; compared with one rank's LoRA run. lora_all: every projection (the MLP's too), in triples
    "lora": Feature(("--lora-rank", 4, "--lora-alpha", 16, "--lora-target-modules", "q_proj", "k_proj", "v_proj",
                     "o_proj"), kind="model", group="lora"),
    "lora_all": Feature(("--lora-rank", 4, "--lora-alpha", 16, "--lora-target-modules", "all-linear"), kind="model",
                        group="lora", paired=False),
    # one sample per micro-batch: as many micro-batches at DP 2 as DualPipeV's 2 x PP needs (the one-rank run's
    # mean over the same 8 samples is the same)
    "micro1": Feature(("--micro-batch-size", 1), group="batch", paired=False),
}
PIPELINES = ("pp2", "pp2_interleaved", "pp2_zero_bubble", "pp2_zbv", "pp2_dualpipev")
# the triples users run (TP x PP with ZeRO, CP x TP, EP x TP, EP x CP, ...), within 4 ranks
TRIPLES = [("tp2_sp", "pp2", "zero1"), ("tp2_sp", "pp2_interleaved", "llama"), ("cp2", "tp2_sp", "llama"),
           ("ep2", "tp2_sp", "zero1"), ("ep2", "cp2", "zero2"), ("cp2", "pp2", "documents"),
           ("ulysses2", "tp2_sp", "documents"), ("tp2_sp", "pp2", "recompute_full"), ("dp2", "zero3", "llama"),
           ("cp2", "dp2", "zero3")]
# every schedule at PP 2 x DP 2 with ZeRO-2, ZeRO-3 and ZeRO-3 + offload (the one runtime), and TP 2 x PP 2 ZeRO-3
TRIPLES += [("dp2", pipeline, *(("micro1",) if pipeline == "pp2_dualpipev" else ()), zero)
            for pipeline in PIPELINES for zero in ("zero2", "zero3", "zero3_offload")]
TRIPLES += [("tp2_sp", "pp2", "zero3"), ("tp2_sp", "pp2", "dp2", "zero3")]  # (DP 1 and DP 2: ZeRO-3 shards)
# a pipeline with ZeRO-1 offload at DP 2 (ZeRO at DP 1 shards nothing: those pairs run here, at DP 2)
TRIPLES += [("dp2", pipeline, *(("micro1",) if pipeline == "pp2_dualpipev" else ()), "offload")
            for pipeline in PIPELINES]
SHARDING = ("zero2", "zero3", "offload", "zero3_offload")  # paired with a pipeline only at DP 2 (in TRIPLES)
# Muon under ZeRO's partitions (each matrix gathered and orthogonalized on one owner rank), with TP and PP
TRIPLES += [("dp2", "zero1", "muon"), ("dp2", "zero2", "muon"), ("dp2", "zero3", "muon"), ("tp2_sp", "zero3", "muon"),
            ("dp2", "pp2", "muon"), ("tp2_sp", "pp2", "muon"), ("dp2", "zero3", "bf16", "muon"),
            ("ep2", "zero1", "muon"), ("ep2", "tp2_sp", "muon")]
# LoRA on every projection with the layouts that split its adapters: TP + SP (A whole beside the column-parallel
# QKV and gate/up, B split), ZeRO-3's partitions, the pipeline's stages, the schedules with a split backward
TRIPLES += [("tp2_sp", "llama", "lora_all"), ("dp2", "zero3", "lora_all"), ("dp2", "zero2", "llama", "lora_all"),
            ("pp2", "llama", "lora_all"), ("pp2_zbv", "lora_all"), ("tp2_sp", "pp2", "lora_all"),
            ("cp2", "llama", "lora_all"), ("dp2", "offload", "lora_all"), ("dp2", "zero3", "bf16", "lora_all")]
# 2026's mechanisms with the layouts that split them: DSA's indexer under TP + SP and pipelines with experts and
# ZeRO-3; the norms across heads at TP 2 with a pipeline; the query temperature with the sequence split
TRIPLES += [("tp2_sp", "pp2", "dsa"), ("ep2", "tp2_sp", "dsa"), ("dp2", "zero3", "dsa"),
            ("tp2_sp", "pp2", "heads_norm"),
            ("cp2", "llama", "query_temperature"), ("tp2_sp", "llama", "query_temperature"),
            ("pp2", "mla", "query_temperature"), ("cp2", "documents", "query_temperature"),
            ("tp2_sp", "pp2", "dsa_shared"), ("dp2", "zero3", "dsa_shared"), ("ep2", "pp2", "dsa_shared"),
            ("dp2", "pp2_zbv", "dsa_shared"), ("compile", "dsa_shared")]
# DSA's indexer trained by its KL loss: TP + SP (its projections gathered, their gradients summed over TP; the
# attention's heads summed over TP for the target), a pipeline, ZeRO-3 (its weights gathered with their attention), EP
TRIPLES += [("tp2_sp", "dsa_loss"), ("pp2", "dsa_loss"), ("dp2", "zero3", "dsa_loss"), ("ep2", "tp2_sp", "dsa_loss"),
            ("tp2_sp", "pp2", "dsa_sparse_loss"), ("dp2", "zero2", "dsa_sparse_loss"), ("dp2", "dsa_loss"),
            ("tp2", "dsa_loss"), ("recompute_full", "dsa_loss"), ("compile", "dsa_loss"),
            ("tp2_sp", "zero3", "dsa_loss"), ("pp2_zbv", "dsa_loss")]
# Gemma 4's E2B/E4B form: its per-layer inputs and KV-sharing layers under TP + SP, the sequence split and ZeRO-3;
# a pipeline and full recompute refused by the table
TRIPLES += [("tp2_sp", "dp2", "gemma4_e"), ("cp2", "tp2_sp", "gemma4_e"), ("dp2", "zero3", "gemma4_e"),
            ("ulysses2", "gemma4_e"), ("recompute_selective", "gemma4_e"), ("pp2", "gemma4_e"),
            ("recompute_full", "gemma4_e"), ("dp2", "offload", "gemma4_e")]
# and its MoE block (26B-A4B) with the layouts that split it: EP with TP + SP and with a pipeline, ZeRO-3, CP
TRIPLES += [("ep2", "tp2_sp", "gemma4_moe"), ("ep2", "pp2", "gemma4_moe"), ("dp2", "zero3", "gemma4_moe"),
            ("cp2", "gemma4_moe"), ("tp2_sp", "pp2", "gemma4_moe")]
# Gated DeltaNet with the layouts that split it: TP + SP with a pipeline, the heads' all-to-all under CP and Ulysses
# with packed documents, its experts (Qwen3.5-MoE) over EP with TP + SP, ZeRO-3
TRIPLES += [("tp2_sp", "pp2", "gdn"), ("cp2", "documents", "gdn"), ("ulysses2", "documents", "gdn"),
            ("ep2", "tp2_sp", "gdn"), ("dp2", "zero3", "gdn"), ("cp2", "tp2", "gdn"), ("pp2_zbv", "documents", "gdn")]
MAX_RANKS = 8  # (the pairs need at most 4; one triple TP 2 x PP 2 x DP 2)
LOSS_TOL = {"fp32": 1e-5, "bf16": 2e-2}
# what a passing cell proved: equal to a run it is not (one rank, or one rank with its model options), only its own
# determinism and resume (its reference would be itself: never called equal), or only its resume (dropout)
PASSED = ("equal", "deterministic", "resumed")
CHANGE_FRACTION = 0.05  # of the loss's relative change over a cell's 4 iterations (about 5e-3 here)


def _tiny(data: str, save) -> list:
    """The cell's run; `save` None: nothing saved (a resumed run, whose checkpoint no one reads)."""
    assets = os.path.join(ROOT, "hybrid", "data", "default")
    return [str(f) for f in ["--num-layers", 4, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 16,
            "--max-position-embeddings", 16, "--micro-batch-size", 2, "--global-batch-size", 8, "--train-iters", 4,
            "--lr", 1e-3, "--min-lr", 1e-4, "--lr-decay-style", "cosine", "--lr-warmup-iters", 1,
            "--weight-decay", 0.01, "--clip-grad", 1.0, "--hidden-dropout", 0, "--attention-dropout", 0, "--seed", 7,
            "--log-interval", 1, "--eval-iters", 0, "--no-progress-bar", "--data-path", data, "--vocab-file",
            os.path.join(assets, "vocab.json"), "--merge-file", os.path.join(assets, "merges.txt"),
            "--make-vocab-size-divisible-by", 8, "--split", "98,2,0", "--num-workers", 0,
            *(["--save", save, "--save-interval", 2] if save else [])]]


def _flags(names) -> list:
    out = []
    for name in names:
        out += list(FEATURES[name].flags)
    return [str(f) for f in out]


def _world(names) -> int:
    world = 1
    for name in names:
        world *= FEATURES[name].ranks
    return world


def _refusal(argv: list, world: int):
    """The table's rule refusing these flags at this world size (no rank is started), or None; other
    ConfigErrors (a value no combination allows) are reported as refusals outside the table."""
    from hybrid.capabilities import RefusedCombination
    from hybrid.config import build_run_config, tokenizer_kwargs
    from hybrid.data.tokenizer import build_tokenizer
    from hybrid.errors import ConfigError
    from hybrid.flags import build_parser
    try:
        args = build_parser().parse_args(argv)
        tokenizer = build_tokenizer(**tokenizer_kwargs(args))
        build_run_config(args, world, tokenizer.vocab_size, None, getattr(tokenizer, "eod", None))
    except RefusedCombination as error:
        return {"rule": error.rule, "message": str(error)}
    except ConfigError as error:
        return {"rule": None, "message": str(error)}
    return None


def _train_on_rank(argv: list) -> int:
    """One launch/train.py run on this pool rank (its own process group of the world), its output to
    /dev/null (the sweep prints one JSON line per combination)."""
    from hybrid.training.run import run_training
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
        try:
            return run_training(argv)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _run(argv: list, world: int, timeout: float) -> list:
    from checks.launch_helpers import read_log
    from checks.rank_pool import run_on_ranks
    log = argv[argv.index("--log-json") + 1]
    if os.path.exists(log):
        os.remove(log)
    codes = run_on_ranks(_train_on_rank, world, argv, timeout=timeout)
    if any(codes):
        raise RuntimeError(f"exit status {codes}")
    return [r["lm_loss"] for r in read_log(log) if "consumed_samples" in r]


def _rewind(save: str, to: str) -> None:
    """The checkpoint directory as it was at iteration 2 (`to`: a copy)."""
    from hybrid.checkpoint.files import tag_for, write_latest  # (after ROOT is on the path: run as a script too)
    shutil.copytree(save, to)
    shutil.rmtree(os.path.join(to, tag_for(4)), ignore_errors=True)
    write_latest(to, tag_for(2))


def evaluate_combination(names: tuple, data: str, work: str, baselines: dict, timeout: float = 300) -> dict:
    """The outcome of one combination: skipped (over MAX_RANKS), refused (by a table rule), equal (and
    resumed bitwise), differs, crashed."""
    world = _world(names)
    result = {"combination": "+".join(names), "ranks": world}
    if world > MAX_RANKS:
        return dict(result, status="skipped", why=f"needs {world} ranks", reference=None)
    save = os.path.join(work, result["combination"])
    base = _tiny(data, save) + _flags(names)
    refusal = _refusal(base, world)
    if refusal is not None:
        return dict(result, status="refused" if refusal["rule"] else "refused outside the table",
                    reference=f"the capability table's rule {refusal['rule']}" if refusal["rule"] else None,
                    **refusal)
    start = time.time()
    try:
        losses = _run(base + ["--log-json", save + ".jsonl"], world, timeout)
        rewound = save + "_rewound"
        _rewind(save, rewound)
        resumed = _run(_tiny(data, None) + _flags(names) + ["--load", rewound, "--log-json", save + "_r.jsonl"],
                       world, timeout)
    except Exception as error:  # a crash or a hang: the cell says so
        return dict(result, status="crashed", error=f"{type(error).__name__}: {str(error)[-1500:]}",
                    seconds=time.time() - start, reference=None)
    result.update(losses=losses, seconds=time.time() - start)
    if resumed != losses[2:]:
        return dict(result, status="resume differs", resumed=resumed, reference="its own uninterrupted run")
    kinds = {FEATURES[n].kind for n in names}
    if "dropout" in kinds:  # layouts draw other masks (per TP / CP rank): only the resume is compared
        return dict(result, status="resumed", reference="its own uninterrupted run (dropout: the resume only)")
    # bf16 gradients are DeepSpeed's ZeRO stage's choice (ZeRO-0 accumulates them in fp32, ZeRO-1/2/3 keep bf16):
    # a bf16 cell is compared with one rank at its own ZeRO stage (a layout changes neither)
    model_names = tuple(n for n in names if FEATURES[n].kind in ("model", "precision", "optimizer")
                        or n == "ep2"  # EP 2 brings its MoE model
                        or ("bf16" in names and FEATURES[n].group == "zero"))
    key = tuple(sorted("moe" if n == "ep2" else n for n in model_names))
    if key not in baselines:
        one = [f for n in key for f in _flags([n])]
        baselines[key] = _run(_tiny(data, None) + one + ["--log-json", save + "_one.jsonl"], 1, timeout)
    want = baselines[key]
    tol = tolerance(want, "bf16" if "bf16" in names else "fp32")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
    itself = world == 1 and sorted(_flags(names)) == sorted(_flags(key))
    result.update(one_rank=want, max_relative_difference=worst, tolerance=tol,
                  reference="itself: determinism and resume only" if itself else
                  "one rank" + (f" with {'+'.join(key)}" if key else ""))
    if worst > tol or not len(losses) == len(want) == 4:
        return dict(result, status="differs")
    return dict(result, status="deterministic" if itself else "equal")


def tolerance(one_rank: list, precision: str) -> float:
    """The largest relative difference from one rank a cell may show: its precision's (fp32 1e-5, bf16 2e-2),
    and never more than CHANGE_FRACTION of the loss's own relative change over the cell's iterations, so a
    layout whose update is wrong (a change as large as the training's own) cannot pass as rounding."""
    change = abs(one_rank[-1] - one_rank[0]) / abs(one_rank[0])
    return min(LOSS_TOL[precision], CHANGE_FRACTION * change)


def all_combinations() -> list:
    singles = [n for n in FEATURES if FEATURES[n].paired]
    pairs = [(a, b) for a, b in itertools.combinations(singles, 2)
             if not (FEATURES[a].group and FEATURES[a].group == FEATURES[b].group)
             and not ({a, b} & set(PIPELINES) and {a, b} & set(SHARDING))]  # (at DP 2, in TRIPLES)
    return [(n,) for n in singles] + pairs + TRIPLES


def write_matrix(results: list, out_dir: str, summary: dict) -> None:
    """combinations.md (pairs as a matrix, then the triples) and combinations.png (a heatmap)."""
    by = {r["combination"]: r for r in results}
    short = {"equal": "ok", "deterministic": "det", "resumed": "res", "refused": "R", "refused outside the table": "R*",
             "skipped": "-", "differs": "DIFF", "resume differs": "RESUME", "crashed": "CRASH",
             "passed on rerun": "FLAKY"}
    names = [n for n in FEATURES if FEATURES[n].paired]
    lines = ["# Combination sweep (checks/combinations.py)", "",
             "ok: 4 iterations equal one rank (relative difference within min(1e-5 fp32 / 2e-2 bf16, 5% of the "
             "loss's own change over the 4 iterations); bf16 and FP8 against one rank's bf16 / FP8 run) and the "
             "resume from iteration 2 is bitwise; det: a one-rank cell whose reference would be itself (the same "
             "flags): it proves determinism and the resume only, and is not counted as equal; res: with dropout the "
             "layouts draw other masks, so only the resume is compared; R: refused by a capability-table rule before "
             "any rank starts; -: needs more ranks than the sweep runs; DIFF / RESUME / CRASH: a failure; FLAKY: "
             "failed, then passed when run again (a failure to explain). Every result in combinations.json names "
             "its reference. A pipeline with ZeRO-2/3 or offload is run at DP 2 (ZeRO at DP 1 shards nothing): "
             "those cells show the DP 2 triple's result. The diagonal is the feature alone.", "",
             f"{summary['combinations']} combinations ("
             + ", ".join(f"{n} {s}" for s, n in summary["by_status"].items())
             + f"); wall time {summary.get('sweep_seconds', summary['seconds']) / 60:.1f} minutes on "
             f"{os.cpu_count()} CPU cores" + (f" (the cells run again: {summary['seconds'] / 60:.1f} minutes)"
                                              if "sweep_seconds" in summary else "") + ".", "",
             "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for a in names:
        row = []
        for b in names:
            key = a if a == b else next((k for k in (f"{a}+{b}", f"{b}+{a}", f"dp2+{a}+{b}", f"dp2+{b}+{a}",
                                                     f"dp2+{a}+micro1+{b}", f"dp2+{b}+micro1+{a}") if k in by), None)
            row.append(short.get(by[key]["status"], "?") if key in by else "")
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    lines += ["", "## Triples", "", "| combination | ranks | result |", "|---|---|---|"]
    lines += [f"| {'+'.join(t)} | {by['+'.join(t)]['ranks']} | {by['+'.join(t)]['status']} |" for t in TRIPLES
              if "+".join(t) in by]
    refusals = sorted({(r["rule"], r["combination"]) for r in results if r.get("rule")})
    lines += ["", "## Refusals (rule: combinations)", ""]
    for rule in sorted({rule for rule, _ in refusals}):
        lines.append(f"- `{rule}`: " + ", ".join(c for r, c in refusals if r == rule))
    reruns = [r for r in results if "rerun_of" in r]

    def _first_outcome(first: dict) -> str:
        return first.get("error") or first.get("message") or first.get("rule") or ""

    if reruns:
        lines += ["", "## Cells run again (--rerun-failed)", ""]
        lines += [f"- {r['combination']}: {r['status']} in {r.get('seconds', 0):.0f} s; first "
                  f"{r['rerun_of']['status']} after {r['rerun_of'].get('seconds', 0):.0f} s "
                  f"({_first_outcome(r['rerun_of'])[-120:]!r})"
                  for r in reruns]
    with open(os.path.join(out_dir, "combinations.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    colors = {"ok": 1.0, "det": 0.75, "res": 0.85, "R": 0.6, "R*": 0.4, "-": 0.8, "DIFF": 0.0, "RESUME": 0.1,
              "CRASH": 0.0, "FLAKY": 0.2, "": float("nan")}
    grid = []
    for line in lines[8:8 + len(names)]:
        grid.append([colors.get(cell.strip(), float("nan")) for cell in line.split("|")[2:-1]])
    fig, ax = plt.subplots(figsize=(11, 10))
    ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1)
    ax.set_xticks(range(len(names)), names, rotation=90)
    ax.set_yticks(range(len(names)), names)
    ax.set_title("pairs: green = equal one rank and resumes; light = deterministic / resume only; yellow = refused")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "combinations.png"), dpi=80)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="comma-separated combinations (features joined by +)")
    p.add_argument("--out", default=os.path.join(ROOT, "checks", "results"))
    p.add_argument("--quick", action="store_true", help="do not write the matrix")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--rerun-failed", action="store_true",
                   help="run again only the failed cells of --out's combinations.json and rewrite the matrix")
    a = p.parse_args()
    from checks.launch_helpers import copy_default_corpus
    work = tempfile.mkdtemp(prefix="combinations-")
    data = copy_default_corpus(work)
    combos = [tuple(c.split("+")) for c in a.only.split(",")] if a.only else all_combinations()
    earlier = {}
    if a.rerun_failed:  # the earlier sweep's cells, its failures run again (each says it was rerun)
        with open(os.path.join(a.out, "combinations.json")) as f:
            saved = json.load(f)
        earlier = {r["combination"]: r for r in saved["results"]}
    results, baselines, start = [], {}, time.time()
    for names in combos:
        before = earlier.get("+".join(names))
        if before is not None and before["status"] in PASSED + ("refused", "skipped"):
            results.append(before)
            continue
        result = evaluate_combination(names, data, work, baselines, a.timeout)
        if before is not None:  # a cell that failed and passes again is a failure to explain, not a pass
            result["rerun_of"] = {k: v for k, v in before.items() if k in ("status", "error", "seconds")}
            if result["status"] in PASSED:
                result = dict(result, status="passed on rerun", passed_as=result["status"])
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "one_rank")}), flush=True)
    summary = {"combinations": len(results), "seconds": time.time() - start,
               "by_status": {s: sum(r["status"] == s for r in results) for s in sorted({r["status"] for r in results})}}
    if earlier:
        summary["sweep_seconds"] = saved["summary"].get("sweep_seconds", saved["summary"]["seconds"])
    print(json.dumps(summary), flush=True)
    if not a.quick:
        write_matrix(results, a.out, summary)
        with open(os.path.join(a.out, "combinations.json"), "w") as f:
            json.dump({"summary": summary, "results": results}, f, indent=1)
    from checks.rank_pool import close_pools
    close_pools()
    return 0 if all(r["status"] in PASSED + ("refused", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
