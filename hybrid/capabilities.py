"""What combines with what, declared once: every refused combination of schedule x ZeRO stage x
precision x recompute x compile x parallel axes x checkpoint options, with its reason and fix.

Flag checking (hybrid.config, hybrid.ds_config), the dry-run advisor (hybrid.dry_run: it only proposes
changes this table allows), the checkpoint checks (hybrid.training.resume) and the README (its
table is `markdown_table()`, checked by a test) all read this module. Flags without a feature behind
them are the other table (hybrid.megatron_compat). Pure: no DeepSpeed, no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from hybrid.errors import ConfigError

# --pipeline-schedule name -> its torch.distributed.pipelining class (every schedule runs on it; 1f1b with fewer
# micro-batches than stages runs as ScheduleGPipe, which its warmup then is)
TORCH_SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SCHEDULE_NAMES = tuple(TORCH_SCHEDULES)
SPLIT_BACKWARD = ("zero-bubble", "zbv", "dualpipev")  # backward split into input- and weight-gradient steps
V_SHAPED = ("zbv", "dualpipev")  # first and last stage on rank 0


@dataclass(frozen=True)
class Setup:
    """The settings a rule looks at, known from the flags before anything is built."""

    pp: int = 1  # --pipeline-model-parallel-size
    tp: int = 1  # --tensor-model-parallel-size
    schedule: str = "1f1b"  # --pipeline-schedule
    zero_stage: int = 0  # zero_optimization.stage
    precision: str = "fp32"  # fp32 | bf16 | fp16
    recompute: Optional[str] = None  # --recompute-granularity
    torch_compile: bool = False  # --torch-compile
    micro_batches: int = 1  # micro-batches per iteration per DP rank
    rampup: bool = False  # --rampup-batch-size
    universal_checkpoint: bool = False  # --universal-checkpoint
    flash_attn: bool = False  # --use-flash-attn
    grad_reduce_bf16: bool = False  # --grad-reduce-in-bf16
    accelerator: str = "cuda"  # "cpu" where DeepSpeed's accelerator is the CPU
    zero_source: str = "--zero-stage"  # where the ZeRO stage came from (named in messages)
    documents: bool = False  # --reset-attention-mask / --reset-position-ids
    cp: int = 1  # --context-parallel-size
    ulysses: int = 1  # --ds-sequence-parallel-size
    attention_dropout: bool = False  # --attention-dropout > 0
    experts: bool = False  # --num-experts
    ep: int = 1  # --expert-model-parallel-size
    sequence_parallel: bool = False  # --sequence-parallel (at TP > 1)
    seq_length: int = 0  # --seq-length (0: not known, the length rules do not apply)
    heads_per_tp: int = 0  # attention heads on one TP rank (0: not known)
    groups_per_tp: int = 0  # KV groups on one TP rank (0: not known)
    experts_on_every_stage: Optional[bool] = None  # every pipeline rank holds an MoE layer (None: not known yet)
    fp8: Optional[str] = None  # --fp8-recipe when --fp8-format is given
    fp8_param_gather: bool = False  # --fp8-param-gather
    cpu_offloading: bool = False  # --cpu-offloading (or activation_checkpointing.cpu_checkpointing)
    dpo: bool = False  # --dpo
    dpo_precomputed: bool = False  # --dpo-reference-logps FILE
    grpo: bool = False  # --grpo
    grpo_kl: bool = False  # --grpo-beta > 0 (a frozen reference model beside the engine)
    moe_capacity: bool = False  # --moe-expert-capacity-factor with experts
    fp32_grad_accumulation: bool = False  # the DeepSpeed config's data_types.grad_accum_dtype fp32 (with --bf16)
    optimizer: str = "adam"  # --optimizer
    offload_optimizer: bool = False  # the DeepSpeed config's zero_optimization.offload_optimizer
    mla: bool = False  # --multi-latent-attention
    dsa: bool = False  # --experimental-attention-variant dsa (DeepSeek sparse attention)
    dsa_shared: bool = False  # with GLM-5's index sharing (layers reusing an earlier layer's choice)
    dsa_sharing_split: Optional[bool] = None  # a sharing layer in another virtual stage than its source (None: unknown)
    per_layer_inputs: bool = False  # --per-layer-input-size > 0 (Gemma 4 E2B/E4B)
    kv_shared: bool = False  # --num-kv-shared-layers > 0 (Gemma 4 E2B/E4B)
    kv_sharing_split: Optional[bool] = None  # a KV-sharing layer in another virtual stage than its source (None: n/a)
    mtp: bool = False  # --mtp-num-layers > 0 (from the flags or a --load-hf checkpoint's layers)
    lora: bool = False  # --lora-rank > 0 (or --load-lora's)
    gated_delta_net: bool = False  # Gated DeltaNet layers (--linear-attention-freq; Qwen3.5, Qwen3-Next)
    output_gate: bool = False  # --attention-output-gate
    linear_key_heads_per_tp: int = 0  # Gated DeltaNet key heads on one TP rank (0: not known)

    @property
    def torch_schedule(self) -> bool:
        """A pipeline: its schedule runs on torch.distributed.pipelining (every schedule does)."""
        return self.pp > 1

    @property
    def split_backward(self) -> bool:
        return self.pp > 1 and self.schedule in SPLIT_BACKWARD


@dataclass(frozen=True)
class Rule:
    """One refused combination."""

    name: str  # a short identifier
    combination: str  # what is refused, for the README
    why: str  # the reason, for the README (what was tried where it was)
    refuses: Callable[[Setup], bool]
    message: Callable[[Setup], str]  # the error: names the flags and the fix


RULES = [
    Rule("cp-ulysses", "--context-parallel-size with --ds-sequence-parallel-size",
         "the sequence is split one way (the K/V ring) or the other (all-to-all around attention), not both",
         lambda s: s.cp > 1 and s.ulysses > 1,
         lambda s: f"--context-parallel-size {s.cp} with --ds-sequence-parallel-size {s.ulysses}: the sequence is "
                   f"split one way or the other; give one of them."),
    Rule("fp16-cpu", "--fp16 on a CPU", "DeepSpeed's CPU accelerator does not support fp16",
         lambda s: s.precision == "fp16" and s.accelerator == "cpu",
         lambda s: "--fp16 needs a GPU: DeepSpeed's CPU accelerator does not support fp16. Use --bf16, or drop --fp16 "
                   "to train in fp32."),
    Rule("bf16-fp32-accumulation-pipeline",
         "--bf16 with ZeRO-1 and fp32 gradient accumulation (data_types.grad_accum_dtype) with pipeline parallelism",
         "DeepSpeed 0.19's BF16_Optimizer (what that combination selects) adds every parameter's bf16 gradient to "
         "its fp32 accumulators after each backward pass and clears them at each forward; a pipeline rank runs "
         "several stages' backward passes between forwards (tried: the gradients came out wrong)",
         lambda s: s.pp > 1 and s.precision == "bf16" and s.zero_stage == 1 and s.fp32_grad_accumulation,
         lambda s: f"--bf16 with ZeRO-1 and \"data_types\": {{\"grad_accum_dtype\": \"fp32\"}} (from {s.zero_source}) "
                   f"at --pipeline-model-parallel-size {s.pp}: DeepSpeed's BF16_Optimizer, which that selects, "
                   f"accumulates once per forward, not per pipeline backward. Drop grad_accum_dtype (ZeRO-1 "
                   f"accumulates bf16 gradients into its fp32 partition), or use ZeRO-2."),
    Rule("dualpipev-micro-batches", "DualPipeV with fewer than 2 x PP micro-batches",
         "its schedule needs as many micro-batches as stages",
         lambda s: s.torch_schedule and s.schedule == "dualpipev" and s.micro_batches < 2 * s.pp,
         lambda s: f"--pipeline-schedule dualpipev needs at least as many micro-batches per iteration as stages "
                   f"(2 x {s.pp}); this run has {s.micro_batches} (--global-batch-size / (--micro-batch-size x "
                   f"data-parallel size)). Raise --global-batch-size."),
    Rule("torch-schedule-micro-batches",
         "interleaved 1F1B, zero-bubble or ZB-V with fewer micro-batches than PP",
         "torch.distributed.pipelining's multi-stage schedules need at least one micro-batch per pipeline rank (1f1b "
         "with fewer runs them all forward, then all backward: its own warmup and cooldown)",
         lambda s: s.torch_schedule and s.schedule != "1f1b" and s.micro_batches < s.pp,
         lambda s: f"--pipeline-schedule {s.schedule} needs at least as many micro-batches per iteration as "
                   f"pipeline ranks ({s.pp}); this run has {s.micro_batches} (--global-batch-size / "
                   f"(--micro-batch-size x data-parallel size)). Raise --global-batch-size."),
    Rule("compile-zero3", "--torch-compile with ZeRO-3",
         "ZeRO-3 gathers each layer's parameters in module hooks that torch.compile cannot trace",
         lambda s: s.torch_compile and s.zero_stage == 3,
         lambda s: "--torch-compile with ZeRO-3 is not supported: ZeRO-3 gathers each layer's parameters in module "
                   "hooks that torch.compile cannot trace. Use ZeRO-1/2 (ds_configs/zero1.json, zero2.json) with "
                   "--torch-compile, or drop --torch-compile."),
    Rule("rampup-pipeline", "--rampup-batch-size with pipeline parallelism",
         "torch.distributed.pipelining's schedules take their micro-batch count when they are built",
         lambda s: s.rampup and s.pp > 1,
         lambda s: "--rampup-batch-size with --pipeline-model-parallel-size > 1 is not supported (a pipeline "
                   "schedule fixes its micro-batch count when it is built); use a constant --global-batch-size."),
    Rule("universal-zero0-fp32", "--universal-checkpoint without ZeRO in fp32",
         "DeepSpeed loads universal checkpoints into its ZeRO-1/2/3 optimizers only",
         lambda s: s.universal_checkpoint and s.zero_stage == 0 and s.precision == "fp32",
         lambda s: "--universal-checkpoint needs a ZeRO optimizer (DeepSpeed loads universal checkpoints into "
                   "ZeRO-1/2/3): add --deepspeed ds_configs/zero1.json."),
    Rule("universal-zero3-tp", "--universal-checkpoint with ZeRO-3 at TP > 1",
         "DeepSpeed 0.19's ZeRO-3 universal load does not split tensors over TP",
         lambda s: s.universal_checkpoint and s.zero_stage == 3 and s.tp > 1,
         lambda s: "--universal-checkpoint with ZeRO-3 at --tensor-model-parallel-size > 1 is not supported: "
                   "DeepSpeed 0.19's ZeRO-3 universal load does not split tensors over TP. Resume with ZeRO-1/2 at "
                   "this TP (ds_configs/zero1.json), or with ZeRO-3 at TP 1."),
    Rule("flash-attn-cpu", "--use-flash-attn without a CUDA GPU", "flash-attn's kernels are CUDA kernels",
         lambda s: s.flash_attn and s.accelerator != "cuda",
         lambda s: "--use-flash-attn needs a CUDA GPU; drop --use-flash-attn to use torch's "
                   "scaled_dot_product_attention (SDPA, the default), or install it on a CUDA machine: "
                   "pip install -e '.[gpu]' (flash-attn)."),
    Rule("flash-attn-fp32", "--use-flash-attn in fp32", "flash-attn has no fp32 kernels",
         lambda s: s.flash_attn and s.precision == "fp32",
         lambda s: "--use-flash-attn needs --bf16 or --fp16 (flash-attn has no fp32 kernels); add one, or drop "
                   "--use-flash-attn for SDPA."),
    Rule("moe-zero3-ep", "--expert-model-parallel-size > 1 with ZeRO-3",
         "DeepSpeed 0.19's ZeRO-3 refuses its native MoE layers ('Native DeepSpeed MoE is not supported with ZeRO "
         "Stage 3'), whose expert groups expert parallelism needs (only its AutoEP layers, HF-module replacements "
         "without auxiliary losses, have ZeRO-3); at EP 1 ZeRO-3 partitions the experts over DP like any parameter",
         lambda s: s.experts and s.zero_stage == 3 and s.ep > 1,
         lambda s: f"--expert-model-parallel-size {s.ep} with ZeRO stage 3 (from {s.zero_source}): DeepSpeed 0.19's "
                   f"ZeRO-3 does not support its MoE expert groups. Use ds_configs/zero2.json or zero1.json with "
                   f"expert parallelism (expert optimizer states are partitioned over DP / EP), or ZeRO-3 at "
                   f"--expert-model-parallel-size 1 (experts partitioned over DP)."),
    Rule("moe-tp-without-sp", "--num-experts at TP > 1 without --sequence-parallel",
         "each TP rank routes its own sequence shard, as in Megatron-LM, so the tokens must be split over TP",
         lambda s: s.experts and s.tp > 1 and not s.sequence_parallel,
         lambda s: f"--num-experts with --tensor-model-parallel-size {s.tp} needs --sequence-parallel (each TP rank "
                   f"routes its own sequence shard, as in Megatron-LM)."),
    Rule("moe-stage-without-experts", "--num-experts with a pipeline rank that holds no MoE layer",
         "DeepSpeed reduces each optimizer group's gradient norm over the pipeline: a rank without experts has "
         "fewer groups and its reduction would wait forever",
         lambda s: s.experts and s.pp > 1 and s.experts_on_every_stage is False,
         lambda s: f"--num-experts with --pipeline-model-parallel-size {s.pp}: a pipeline rank holds no MoE layer "
                   f"(with --moe-layer-freq and this stage split); every pipeline rank needs at least one, as "
                   f"DeepSpeed reduces each optimizer group's gradient norm over the pipeline. Use --moe-layer-freq 1, "
                   f"or a --pipeline-partition giving each rank an MoE layer."),
    Rule("moe-universal-pipeline", "universal checkpoints of MoE models with pipeline parallelism",
         "the expert groups' universal conversion is written for PP = 1 (DeepSpeed's own tool does not read "
         "expert groups); not built for pipeline stages",
         lambda s: s.experts and s.universal_checkpoint and s.pp > 1,
         lambda s: f"universal checkpoints of MoE models with --pipeline-model-parallel-size {s.pp} are not built: "
                   f"convert and resume at --pipeline-model-parallel-size 1 (any TP, DP and EP), or resume at the "
                   f"saved layout without --universal-checkpoint."),
    Rule("cp-sequence-chunks", "--context-parallel-size N with a --seq-length that 2 x N does not divide",
         "the ring cuts each sequence into 2 x N chunks (Megatron's causal load balancing)",
         lambda s: s.cp > 1 and s.seq_length and s.seq_length % (2 * s.cp) != 0,
         lambda s: f"--context-parallel-size {s.cp} cuts each sequence into 2 x {s.cp} chunks: --seq-length "
                   f"{s.seq_length} must be divisible by {2 * s.cp}."),
    Rule("cp-sp-shards", "--context-parallel-size N and --sequence-parallel where TP does not divide s / N",
         "each CP rank's tokens are split again over TP",
         lambda s: s.cp > 1 and s.sequence_parallel and s.tp > 1 and s.seq_length and (s.seq_length // s.cp) % s.tp,
         lambda s: f"--sequence-parallel with --context-parallel-size {s.cp}: each rank's {s.seq_length // s.cp} "
                   f"tokens must be divisible by --tensor-model-parallel-size {s.tp}."),
    Rule("ulysses-sequence", "--ds-sequence-parallel-size N with a --seq-length that N does not divide",
         "Ulysses gives each rank a contiguous 1/N of the sequence",
         lambda s: s.ulysses > 1 and s.seq_length and s.seq_length % s.ulysses != 0,
         lambda s: f"--ds-sequence-parallel-size {s.ulysses}: --seq-length {s.seq_length} must be divisible by "
                   f"{s.ulysses}."),
    Rule("ulysses-heads", "--ds-sequence-parallel-size N where N does not divide the heads or KV groups per TP rank",
         "Ulysses' all-to-all gives each rank 1/N of the attention heads and of the KV groups",
         lambda s: s.ulysses > 1 and s.heads_per_tp and (s.heads_per_tp % s.ulysses or s.groups_per_tp % s.ulysses),
         lambda s: f"--ds-sequence-parallel-size {s.ulysses}: Ulysses gives each rank 1/{s.ulysses} of the attention "
                   f"heads and of the KV groups, but each TP rank has {s.heads_per_tp} heads and {s.groups_per_tp} KV "
                   f"groups (--num-attention-heads / --num-query-groups over --tensor-model-parallel-size {s.tp}); use "
                   f"a size that divides both, or --context-parallel-size (ring attention has no such rule)."),
    Rule("ulysses-sp-shards", "--ds-sequence-parallel-size N and --sequence-parallel where TP does not divide s / N",
         "each Ulysses rank's tokens are split again over TP",
         lambda s: (s.ulysses > 1 and s.sequence_parallel and s.tp > 1 and s.seq_length
                    and (s.seq_length // s.ulysses) % s.tp),
         lambda s: f"--sequence-parallel with --ds-sequence-parallel-size {s.ulysses}: each rank's "
                   f"{s.seq_length // s.ulysses} tokens must be divisible by --tensor-model-parallel-size {s.tp}."),
    Rule("fp8-mxfp8", "--fp8-recipe mxfp8",
         "not built: MXFP8's GEMMs (torchao's MX formats) run on Blackwell GPUs (compute capability 10.0) only, and "
         "their per-32-element scales would need their own TP / CP rules here",
         lambda s: s.fp8 == "mxfp8",
         lambda s: "--fp8-recipe mxfp8 is not built; use --fp8-recipe tensorwise, rowwise or delayed."),
    Rule("fp8-blockwise", "--fp8-recipe blockwise",
         "not built: DeepSeek-V3's 128 x 128 block scales have no GEMM in torchao's training path",
         lambda s: s.fp8 == "blockwise",
         lambda s: "--fp8-recipe blockwise is not built; use --fp8-recipe tensorwise, rowwise or delayed."),
    Rule("fp8-fp16", "--fp8-format with --fp16",
         "the FP8 gradient casts would see gradients multiplied by DeepSpeed's dynamic loss scale: every change of "
         "the scale shifts what delayed scaling's amax history holds by that factor (after an increase the e5m2 "
         "casts saturate until the history has turned over), and fp16 runs only on GPUs, where the combination "
         "was never measured; Megatron-LM's FP8 recipes train with bf16",
         lambda s: s.fp8 is not None and s.precision == "fp16",
         lambda s: "--fp8-format with --fp16 is refused (the FP8 casts would see loss-scaled gradients); use --bf16 "
                   "with --fp8-format, as Megatron-LM's FP8 recipes do."),
    Rule("fp8-param-gather", "--fp8-param-gather",
         "not built: DeepSpeed's ZeRO keeps and gathers parameters in their own dtype (bf16 / fp32); FP8 weights "
         "are cast from them for each GEMM",
         lambda s: s.fp8_param_gather,
         lambda s: "--fp8-param-gather is not built (DeepSpeed's ZeRO gathers parameters in their own dtype); drop "
                   "it: the FP8 GEMMs cast the weights themselves."),
    Rule("dpo-pipeline-reference", "--dpo with --pipeline-model-parallel-size > 1 without --dpo-reference-logps",
         "a frozen reference model beside the pipeline would need its own pass through every stage; the pipeline "
         "scores the windows itself from the starting weights, once, into the file",
         lambda s: s.dpo and s.pp > 1 and not s.dpo_precomputed,
         lambda s: f"--dpo at --pipeline-model-parallel-size {s.pp} takes the reference log-probabilities from a "
                   f"file: add --dpo-reference-logps FILE (the pipeline scores every window with the starting "
                   f"weights once before the first iteration and writes FILE; later runs read it)."),
    Rule("grpo-kl-pipeline", "--grpo --grpo-beta > 0 with --pipeline-model-parallel-size > 1",
         "the KL's frozen reference model stands beside the engine whole (PP = 1); a pipeline would need it split "
         "into stages and its own pass through them (not built)",
         lambda s: s.grpo_kl and s.pp > 1,
         lambda s: f"--grpo-beta > 0 at --pipeline-model-parallel-size {s.pp}: the reference model runs beside the "
                   f"engine at PP 1 only; use --grpo-beta 0 (TRL's default) or PP 1."),
    Rule("grpo-moe-capacity", "--grpo with --moe-expert-capacity-factor",
         "which tokens an expert drops depends on every token of the call: a decoding step holds one position per "
         "row, a training micro-batch whole rows, so the sampler and the trainer would route differently and their "
         "log-probabilities would disagree (the train-inference mismatch GRPO must not have)",
         lambda s: s.grpo and s.moe_capacity,
         lambda s: "--grpo with --moe-expert-capacity-factor: token dropping differs between decoding and training, "
                   "so the sampler's and the trainer's log-probabilities would disagree; drop the capacity factor "
                   "(dropless routing)."),
    Rule("grpo-rampup", "--grpo with --rampup-batch-size",
         "a generation batch is --global-batch-size completions in whole prompt groups on every data-parallel rank; "
         "a growing batch would change the group split mid-run",
         lambda s: s.grpo and s.rampup,
         lambda s: "--grpo with --rampup-batch-size: a generation batch is a fixed number of completions; drop "
                   "--rampup-batch-size."),
    Rule("cpu-offloading-recompute", "--cpu-offloading without --recompute-granularity full",
         "the offloaded tensors are the checkpointed layer inputs (DeepSpeed's cpu_checkpointing), which only full "
         "recompute keeps",
         lambda s: s.cpu_offloading and s.recompute != "full",
         lambda s: "--cpu-offloading moves the checkpointed layer inputs to host memory: it needs "
                   "--recompute-granularity full."),
    Rule("muon-precision", "--optimizer muon with --bf16 or --fp16 without ZeRO (or --bf16 at ZeRO-1 with fp32 "
                           "gradient accumulation)",
         "there DeepSpeed steps its own bf16/fp16 optimizer's flat master copy (not a ZeRO optimizer's partitions, "
         "which hybrid's Muon knows how to gather into matrices)",
         lambda s: s.optimizer == "muon" and s.precision != "fp32" and (
             s.zero_stage == 0 or (s.zero_stage == 1 and s.fp32_grad_accumulation and s.precision == "bf16")),
         lambda s: f"--optimizer muon with --{s.precision} at ZeRO-{s.zero_stage} ({s.zero_source})"
                   f"{' and fp32 gradient accumulation' if s.zero_stage else ''}: DeepSpeed steps its own "
                   f"{s.precision} optimizer's flat master weights there; use ZeRO-1/2/3 (--zero-stage 1)"
                   f"{' without data_types.grad_accum_dtype fp32' if s.zero_stage else ''}, or train in fp32."),
    Rule("mtp-objective", "--mtp-num-layers with --dpo or --grpo",
         "multi-token prediction's depths train with the language-model loss; a preference or policy loss has no "
         "target for them",
         lambda s: s.mtp and (s.dpo or s.grpo),
         lambda s: f"--mtp-num-layers with --{'dpo' if s.dpo else 'grpo'}: multi-token prediction trains with the "
                   f"language-model loss only; use --mtp-num-layers 0 (also for a checkpoint that stores MTP layers)."),
    Rule("mtp-split-backward", "--mtp-num-layers with a split-backward pipeline schedule (zero-bubble, zbv, "
                               "dualpipev)",
         "their weight step differentiates each stage's own modules; the MTP layers' and the word embeddings' use on "
         "the last stage is not built into it (a ZB-V run failed in its backward)",
         lambda s: s.mtp and s.split_backward,
         lambda s: f"--mtp-num-layers with --pipeline-schedule {s.schedule}: the split backward does not reach the "
                   f"multi-token prediction layers; use --pipeline-schedule 1f1b or interleaved."),
    Rule("mla-fp8", "--multi-latent-attention with --fp8-format",
         "MLA's projections run their GEMMs in the weights' dtype (their FP8 path is not built)",
         lambda s: s.mla and s.fp8 is not None,
         lambda s: "--fp8-format with --multi-latent-attention: MLA's projections have no FP8 GEMMs here; drop "
                   "--fp8-format."),
    Rule("dsa-sequence-split", "--experimental-attention-variant dsa with --context-parallel-size or "
         "--ds-sequence-parallel-size",
         "each query attends the top-k keys of the whole sequence, which the ring's and Ulysses' blocks of keys do not "
         "see at once (the indexer's selection over other ranks' keys is not built)",
         lambda s: s.dsa and (s.cp > 1 or s.ulysses > 1),
         lambda s: f"DeepSeek sparse attention with --context-parallel-size {s.cp} / --ds-sequence-parallel-size "
                   f"{s.ulysses}: each query's top-k keys span the whole sequence, which a sequence split does not "
                   f"hold on one rank; use TP, PP, EP or DP."),
    Rule("dsa-share-recompute", "--recompute-granularity full with DSA's index sharing",
         "a sharing layer reads the choice its source layer made in the same pass; a layer recomputed in backward "
         "apart from its source (another micro-batch's forward between) would read another one",
         lambda s: s.dsa_shared and s.recompute == "full",
         lambda s: "--recompute-granularity full with DSA index sharing (GLM-5): a recomputed sharing layer could "
                   "read another micro-batch's choice; use --recompute-granularity selective (DSA's attention is "
                   "recomputed in blocks anyway) or none."),
    Rule("dsa-share-stages", "DSA's index sharing with a stage split between a sharing layer and its source",
         "a sharing layer reads the choice its source layer made in the same pass of the same virtual stage; passing "
         "it between stages is not built",
         lambda s: s.dsa_shared and s.dsa_sharing_split is True,
         lambda s: "DSA index sharing (GLM-5) with this pipeline split: a layer that reuses an earlier layer's choice "
                   "sits in another (virtual) stage than that layer; choose --pipeline-partition, "
                   "--num-virtual-stages-per-pipeline-rank or --pipeline-schedule so that each sharing layer sits "
                   "with the layer before it that runs an indexer."),
    Rule("per-layer-inputs-pipeline", "--per-layer-input-size with --pipeline-model-parallel-size > 1",
         "the per-layer inputs are computed on the first stage from the tokens and their embeddings and read by every "
         "layer; sending them to the other stages beside the hidden states is not built",
         lambda s: s.per_layer_inputs and s.pp > 1,
         lambda s: f"--pipeline-model-parallel-size {s.pp} with per-layer inputs (Gemma 4 E2B/E4B, "
                   f"--per-layer-input-size): they are computed on the first stage and read by every layer, and a "
                   f"pipeline would send them between stages, which is not built; use --pipeline-model-parallel-size "
                   f"1 with TP, CP or DP/ZeRO."),
    Rule("kv-share-recompute", "--recompute-granularity full with --num-kv-shared-layers",
         "a sharing layer attends with the keys and values its source layer computed in the same pass; recomputed in "
         "backward apart from its source it would read none, and its gradient would not reach the source",
         lambda s: s.kv_shared and s.recompute == "full",
         lambda s: "--recompute-granularity full with KV-sharing layers (Gemma 4 E2B/E4B, --num-kv-shared-layers): a "
                   "recomputed sharing layer would not read its source layer's keys and values of the same pass; use "
                   "--recompute-granularity selective or none."),
    Rule("kv-share-stages", "--num-kv-shared-layers with a stage split between a sharing layer and its source",
         "a sharing layer attends with the keys and values its source layer computed in the same pass of the same "
         "virtual stage; passing them between stages is not built",
         lambda s: s.kv_shared and s.kv_sharing_split is True,
         lambda s: "KV sharing (Gemma 4 E2B/E4B, --num-kv-shared-layers) with this pipeline split: a sharing layer "
                   "sits in another (virtual) stage than the layer whose keys and values it reads; choose "
                   "--pipeline-partition so that they share a stage, or --pipeline-model-parallel-size 1."),
    Rule("dsa-universal", "--universal-checkpoint with --experimental-attention-variant dsa",
         "DSA's indexer is frozen, and DeepSpeed's universal conversion reads the optimizer's partitions, which do not "
         "hold it (trained by its KL loss it is there, but that conversion is not checked yet)",
         lambda s: s.dsa and s.universal_checkpoint,
         lambda s: "--universal-checkpoint with DeepSeek sparse attention: its frozen indexer is not in the "
                   "optimizer's partitions that the universal conversion reads (and with --dsa-indexer-loss-coeff that "
                   "conversion is not checked); resume at the same layout, or convert its weights with "
                   "hybrid.conversion.checkpoint_util and start the new layout from them."),
    Rule("muon-mla-mtp", "--optimizer muon with --multi-latent-attention or --mtp-num-layers",
         "Muon's matrices are named by the layer's fused QKV, output and MLP projections; MLA's and the MTP layers' "
         "projections are not among them yet",
         lambda s: s.optimizer == "muon" and (s.mla or s.mtp),
         lambda s: "--optimizer muon with --multi-latent-attention / --mtp-num-layers: Muon does not step their "
                   "projections yet; use AdamW (the DeepSpeed config's optimizer)."),
    Rule("lora-fp8", "--lora-rank with --fp8-format",
         "the adapters sit beside the base GEMMs in the weights' dtype; beside FP8 GEMMs they are not built",
         lambda s: s.lora and s.fp8 is not None,
         lambda s: "--lora-rank with --fp8-format: LoRA beside FP8 GEMMs is not built; drop --fp8-format."),
    Rule("lora-muon", "--lora-rank with --optimizer muon",
         "Muon steps the layers' whole projection matrices, which LoRA freezes; the adapters' low-rank factors are "
         "AdamW's (as PEFT trains them)",
         lambda s: s.lora and s.optimizer == "muon",
         lambda s: "--optimizer muon with --lora-rank: Muon's matrices are frozen under LoRA; use AdamW (the DeepSpeed "
                   "config's optimizer)."),
    Rule("lora-universal", "--universal-checkpoint with --lora-rank",
         "DeepSpeed's universal conversion of a checkpoint with frozen parameters is not checked yet",
         lambda s: s.lora and s.universal_checkpoint,
         lambda s: "--universal-checkpoint with --lora-rank: a LoRA run moves to another layout through its adapter: "
                   "start the new layout with --load-hf BASE --load-lora <checkpoint>/<tag>/adapter (its Adam state "
                   "starts fresh), or resume at the same layout."),
    Rule("lora-moe-zero", "--lora-rank on an MoE model with ZeRO-1/2, or with --bf16 without ZeRO",
         "LoRA freezes the experts, and DeepSpeed 0.19's ZeRO-1/2 and bf16 optimizers assert that an MoE model's "
         "optimizer has an expert parameter group (with the experts frozen there is none)",
         lambda s: s.lora and s.experts and (s.zero_stage in (1, 2) or (s.zero_stage == 0 and s.precision != "fp32")),
         lambda s: f"--lora-rank on an MoE model at ZeRO-{s.zero_stage} ({s.zero_source}) in {s.precision}: "
                   f"DeepSpeed's "
                   f"optimizer there needs trainable experts, which LoRA freezes; use ZeRO-0 in fp32 (any EP) or "
                   f"ZeRO-3 (EP 1)."),
    Rule("gdn-sequence-split", "Gated DeltaNet layers with a --context-parallel-size / --ds-sequence-parallel-size N "
                               "that does not divide their key heads per TP rank",
         "under a sequence split each rank mixes the whole sequence for 1/N of the key heads (megatron-core's "
         "all-to-all), so N must divide them",
         lambda s: s.gated_delta_net and s.linear_key_heads_per_tp > 0 and
         s.linear_key_heads_per_tp % (s.cp * s.ulysses) != 0,
         lambda s: f"Gated DeltaNet layers (Qwen3.5, Qwen3-Next) with --context-parallel-size {s.cp} / "
                   f"--ds-sequence-parallel-size {s.ulysses}: each rank mixes the whole sequence for "
                   f"1/{s.cp * s.ulysses} of the {s.linear_key_heads_per_tp} key heads a TP rank holds "
                   f"(--linear-num-key-heads / --tensor-model-parallel-size), which must divide; use a sequence split "
                   f"that divides them."),
    Rule("gdn-fp8-muon-lora", "Gated DeltaNet layers or --attention-output-gate with --fp8-format, --optimizer muon "
                              "or --lora-rank",
         "the Gated DeltaNet projections and the attention's output gate have no FP8 GEMMs, no Muon matrix "
         "grouping and no adapter mapping yet",
         lambda s: (s.gated_delta_net or s.output_gate) and (s.fp8 is not None or s.optimizer == "muon" or s.lora),
         lambda s: "Gated DeltaNet layers / --attention-output-gate (Qwen3.5, Qwen3-Next) with --fp8-format, "
                   "--optimizer muon or --lora-rank: their projections are not wired into those yet; train them in "
                   "bf16 or fp32 with AdamW, all weights."),
    Rule("grad-reduce-bf16-precision", "--grad-reduce-in-bf16 without --bf16",
         "gradients are reduced in the training precision's type (DeepSpeed's communication_data_type)",
         lambda s: s.grad_reduce_bf16 and s.precision != "bf16",
         lambda s: "--grad-reduce-in-bf16 needs --bf16."),
]


def refusals(setup: Setup, only: Optional[tuple] = None) -> list[Rule]:
    """Every rule (of `only`, if given) that refuses this setup, in table order."""
    return [rule for rule in RULES if (only is None or rule.name in only) and rule.refuses(setup)]


class RefusedCombination(ConfigError):
    """A combination the table refuses; `rule` names the rule."""

    def __init__(self, rule: str, message: str):
        super().__init__(message)
        self.rule = rule


def check(setup: Setup, only: Optional[tuple] = None) -> None:
    """Raise RefusedCombination (a ConfigError) with the first refusal's message."""
    refused = refusals(setup, only)
    if refused:
        raise RefusedCombination(refused[0].name, refused[0].message(setup))


def allowed(setup: Setup) -> bool:
    return not refusals(setup)


def stage_placement(schedule: str, virtual: int) -> str:
    """Which layers each pipeline rank holds; checkpoints load plainly between runs with the same
    placement (1F1B; interleaved 1F1B and zero-bubble at the same v; ZB-V and DualPipeV)."""
    if schedule == "1f1b" and virtual == 1:
        return "one per rank (--pipeline-schedule 1f1b)"
    placement = "V" if schedule in V_SHAPED else "loop"
    return f"{virtual} virtual per rank, {placement} placement (--pipeline-schedule {schedule})"


def markdown_table() -> str:
    """The README's table of refused combinations."""
    rows = ["| refused combination | why |", "|---|---|"]
    rows += [f"| {rule.combination} | {rule.why} |" for rule in RULES]
    return "\n".join(rows)
