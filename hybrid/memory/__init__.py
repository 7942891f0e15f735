"""The dry-run memory estimator: bytes per rank of parameters, gradients, optimizer states and
activations, for a layout (TP, PP, DP), a ZeRO stage, a precision and a recompute setting.

Nothing is built: the parameter inventory is derived from the ModelConfig (a test checks it
against the real model's parameters), the ZeRO byte counts follow DeepSpeed 0.19's own buffers
(flat groups padded to 2 x DP elements for ZeRO-1/2, one partition of ceil(numel / DP) per
parameter for ZeRO-3, fp32 master partitions, Adam moments on them; checked exactly on CPU),
and the activation model lists the tensors each layer keeps for backward (checked within 10%
against torch's saved-tensor hooks).

Modules:
  activations      what a micro-batch through a layer keeps for backward; micro-batches a stage holds
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

from deepspeed.runtime import utils as ds_utils

from hybrid.checkpoint.tp_layout import full_numels, tp_layout
from hybrid.errors import ConfigError
from hybrid.model import lora
from hybrid.model.config import ModelConfig
from hybrid.model.naming import EXPERTS, is_fused, takes_muon, vocab_block_name, weight_decayed
from hybrid.parallel.layers import row_blocks
from hybrid.memory.activations import BYTES as _BYTES
from hybrid.memory.activations import (ActivationSettings, attention_kernel_for, embedding_and_head_bytes, fp8_bytes,
                                      in_flight_micro_batches, layer_activation_bytes, sequence_split_buffer_bytes)
from hybrid.pipeline_plan import list_partition_bounds, plan_stages, resolve_partition

GiB = 1024**3


# --- parameters --------------------------------------------------------------------------------

def parameter_inventory(config: ModelConfig, tp: int) -> dict[str, tuple[int, bool]]:
    """Canonical name -> (elements on one TP rank, weight-decayed?), for the whole model.

    Full sizes follow from the config (hybrid.checkpoint.tp_layout.full_numels, which the checkpoint readers
    check shapes with too); how each is split over TP comes from the one TP layout; biases and norm weights
    take no weight decay (hybrid.model.naming.weight_decayed, the optimizer's rule)."""
    h = config.hidden_size
    out = {}
    for name, numel in full_numels(config).items():
        rule = tp_layout(config)[name]
        if rule.vocab_padded:  # vocabulary rows padded for this TP degree, then split
            out[name] = (config.padded_vocab_size(tp) // tp * h, True)
            continue
        decayed = weight_decayed(name)
        out[name] = (numel // tp if rule.dim is not None else numel, decayed)
    return out


def is_expert(name: str) -> bool:
    """A routed expert's parameter (split over EP, its optimizer state over the expert-data-parallel group)."""
    return EXPERTS in name


def _pipeline_units(config: ModelConfig, inventory: dict) -> list[list[str]]:
    """Parameter names per pipeline layer, in the order of DeepSpeed's PipelineModule layer list: embedding,
    transformer layers, final norm, output head (tied: a second copy of the word embeddings)."""
    def names(prefix):
        return [n for n in inventory if n.startswith(prefix)]
    units = [names("embedding.")] + [names(f"layers.{i}.") for i in range(config.num_layers)]
    units.append(names("final_norm.") + names("mtp."))  # (multi-token prediction's layers: the last stage's)
    units.append(["output_layer.weight"] if config.untie_embeddings_and_output_weights
                 else ["embedding.word_embeddings.weight"])
    return units


def partition_layers(config: ModelConfig, tp: int, pp: int, partition: str = "parameters") -> tuple:
    """Transformer layers per pipeline stage with one stage per rank (--pipeline-schedule 1f1b), divided as
    DeepSpeed's PipelineModule divides its layer list (embedding, transformer layers, final norm, head):
    its own `partition_balanced` on parameter counts (`parameters`, the default), on transformer layers
    (`uniform`), or an explicit list; so checkpoints DeepSpeed's pipeline engine wrote keep their stages. The
    embedding stays with the first stage, the final norm and head with the last."""
    if config.num_layers < pp:
        raise ConfigError(f"--pipeline-model-parallel-size {pp} is larger than --num-layers {config.num_layers}: "
                          f"every stage needs at least one layer.")
    inventory = parameter_inventory(config, tp)
    units = _pipeline_units(config, inventory)
    method = resolve_partition(partition, config.num_layers, pp)
    if method == "parameters":
        bounds = ds_utils.partition_balanced([sum(inventory[n][0] for n in u) for u in units], pp)
    elif method.startswith("type:"):
        bounds = ds_utils.partition_balanced([0] + [1] * config.num_layers + [0, 0], pp)
    else:
        bounds = list_partition_bounds(method, len(units))
    counts = tuple(sum(1 for i in range(config.num_layers) if bounds[s] <= i + 1 < bounds[s + 1]) for s in range(pp))
    if min(counts) < 1:
        raise ConfigError(f"--pipeline-partition {partition} gives the {pp} stages {list(counts)} transformer layers "
                          f"(the embedding and head weigh as much as the layers between them); every stage needs "
                          f"one: use --pipeline-partition uniform, or a list such as "
                          f"{','.join([str(config.num_layers // pp)] * pp)}.")
    return counts


def vocab_blocks(params: dict, config: ModelConfig, tp: int) -> dict:
    """`params` ({name: (elements, decayed)}) with each untied vocabulary table as its row blocks where the model
    holds it so (ZeRO-3: ModelConfig.vocab_block_rows), each a parameter of its own."""
    if not config.vocab_blocked(tp):
        return params
    rows = config.padded_vocab_size(tp) // tp
    out = {}
    for name, (numel, decayed) in params.items():
        if tp_layout(config)[name].vocab_padded:
            for i, (start, stop) in enumerate(row_blocks(rows, config.vocab_block_rows)):
                out[vocab_block_name(name, i)] = ((stop - start) * config.hidden_size, decayed)
        else:
            out[name] = (numel, decayed)
    return out


def stage_parameters(config: ModelConfig, tp: int, pp: int, partition: str = "parameters",
                     schedule: str = "1f1b", virtual: int = 1, stage_layers: Optional[tuple] = None) -> list[dict]:
    """Per pipeline rank: {name: (elements, decayed)} of the parameters it holds (the optimizer's), the
    transformer layers it runs, whether it holds the embedding (`first`) and the final norm and head
    (`last`), and `replica`: the elements of a tied table's copy it reads without owning (loop placement:
    the last stage's, a plain tensor with a gradient but no optimizer state). The stages are
    hybrid.pipeline_plan's (with one stage per rank, `stage_layers` or partition_layers')."""
    inventory = parameter_inventory(config, tp)
    if pp == 1:
        return [{"params": inventory, "layers": list(range(config.num_layers)), "first": True, "last": True,
                 "replica": 0}]
    if virtual == 1 and stage_layers is None:
        stage_layers = partition_layers(config, tp, pp, partition)
    units = _pipeline_units(config, inventory)
    plans = plan_stages(config.num_layers, pp, virtual, schedule, stage_layers)
    ranks = []
    for rank in range(pp):
        mine = [p for p in plans if p.rank == rank]
        first, last = any(p.first for p in mine), any(p.last for p in mine)
        chosen = (units[0] if first else []) + [n for p in mine for i in p.layers for n in units[i + 1]]
        replica = 0
        if last:
            chosen += units[-2]
            if config.tied_embeddings and not first:
                replica = inventory["embedding.word_embeddings.weight"][0]
            else:
                chosen += units[-1]
                if config.mtp_num_layers and not first:  # multi-token prediction reads a copy of the embeddings
                    replica = inventory["embedding.word_embeddings.weight"][0]
        ranks.append({"params": {n: inventory[n] for n in dict.fromkeys(chosen)}, "replica": replica,
                      "layers": sorted(i for p in mine for i in p.layers), "first": first, "last": last})
    return ranks


# --- ZeRO: parameters, gradients, optimizer states -----------------------------------------------

@dataclass
class ZeroSettings:
    """What DeepSpeed's ZeRO does with one rank's parameters."""

    stage: int = 0  # zero_optimization.stage
    dp: int = 1  # data-parallel size (ZeRO partitions over it)
    precision: str = "fp32"  # fp32 | bf16 | fp16
    offload_optimizer: bool = False  # zero_optimization.offload_optimizer.device cpu/nvme
    offload_param: bool = False  # zero_optimization.offload_param (ZeRO-3)
    persistence_threshold: int = 100_000  # stage3_param_persistence_threshold (ZeRO-3)
    fp32_grad_accumulation: bool = False  # data_types.grad_accum_dtype fp32 with bf16
    reduce_bucket_size: int = 500_000_000  # zero_optimization.reduce_bucket_size (elements; DeepSpeed's default)
    prefetch_bucket_size: int = 50_000_000  # stage3_prefetch_bucket_size (elements)
    overlap_comm: bool = False  # zero_optimization.overlap_comm (ZeRO-1/2: two reduce buckets)
    contiguous_gradients: bool = True  # zero_optimization.contiguous_gradients (ZeRO-1/2: a reduce bucket)
    sub_group_size: int = 1_000_000_000  # zero_optimization.sub_group_size (ZeRO-3: the step's unit, elements)
    reduce_scatter: bool = True  # zero_optimization.reduce_scatter (ZeRO-3: a full bucket reduced from a flat copy)


def model_state_bytes(groups: list[list[int]], zero: ZeroSettings) -> dict:
    """Bytes of parameters, gradients and optimizer states (Adam) on one rank.

    `groups`: the element counts of the trainable parameters in each optimizer parameter group
    (decayed, not decayed), this rank's TP/PP share. Follows DeepSpeed 0.19: ZeRO-1/2 flatten
    each group padded to a multiple of 2 x DP elements and keep a partition of 1/DP of it as
    fp32 master weights with its Adam moments and gradients; ZeRO-3 partitions each parameter
    on its own (ceil(numel / DP)) and keeps parameters below the persistence threshold whole;
    the fused torch Adam keeps a 4-byte step per parameter it updates."""
    e = _BYTES[zero.precision]
    dp = zero.dp
    sizes = [n for g in groups for n in g]
    if zero.stage == 0:
        numel = sum(sizes)
        if zero.precision == "fp32":  # the torch optimizer itself: moments and a step per parameter
            return dict(params=4 * numel, grads=4 * numel, optimizer=8 * numel + 4 * len(sizes), host_optimizer=0)
        # bf16/fp16 without ZeRO: DeepSpeed's BF16_Optimizer / FP16_Optimizer keep fp32 master
        # weights and fp32 gradients beside the low-precision model (one flat group each)
        return dict(params=e * numel, grads=4 * numel, optimizer=12 * numel + 4 * len(groups), host_optimizer=0)
    if zero.stage in (1, 2):
        align = 2 * dp
        padded = [math.ceil(sum(g) / align) * align for g in groups if g]
        partitions = [p // dp for p in padded]
        params = e * sum(padded)
        grads = (4 if zero.fp32_grad_accumulation else e) * sum(partitions)
    else:
        partitions_per_param = [math.ceil(n / dp) for n in sizes]
        partitions = [sum(math.ceil(n / dp) for n in g) for g in groups if g]
        persistent = sum(n for n in sizes if n < zero.persistence_threshold)
        params = 0 if zero.offload_param else e * (sum(partitions_per_param) + persistent)
        grads = (4 if zero.fp32_grad_accumulation else e) * sum(partitions_per_param)
    optimizer = 12 * sum(partitions) + 4 * len(partitions)  # fp32 master + exp_avg + exp_avg_sq, steps
    if zero.offload_optimizer:
        return dict(params=params, grads=grads, optimizer=0, host_optimizer=optimizer)
    return dict(params=params, grads=grads, optimizer=optimizer, host_optimizer=0)


def _zero_shares(params: dict, zero: ZeroSettings, ep: int) -> list:
    """[(parameters, the DP they partition over)]: the dense ones over DP, this rank's 1/EP of the experts over
    the expert-data-parallel group (DeepSpeed's MoE groups), each a group of its own."""
    dense, experts = _expert_share(params, ep)
    return [(share, dp) for share, dp in ((dense, zero.dp), (experts, _expert_zero(zero, ep).dp)) if share]


def zero_buffer_bytes(params: dict, zero: ZeroSettings, pp: int, collective_copies: bool = False, ep: int = 1,
                      frozen: Optional[dict] = None) -> int:
    """ZeRO's working memory on one rank during backward, beside the partitioned states (DeepSpeed 0.19 allocates
    its buckets whole), for this rank's parameters (1/EP of the experts): ZeRO-1's whole gradients, which wait in
    `.grad` until the step reduces them (less their partitions, made from them), and its reduce bucket; ZeRO-2's
    reduce bucket (two with overlap_comm; none without contiguous gradients) and the largest parameter's whole
    gradient until its reduction; ZeRO-3's
    reduce bucket (allocated whole at start, alive throughout) and, at the largest parameter's backward, that
    parameter gathered (an MoE layer's experts all together; on the accelerator, offloaded parameters too) and its
    whole gradient, then that gradient
    and the reduce-scatter's output partition, or a full bucket's reduction (its flat copy and partitions), plus at
    PP = 1 the parameters its trace prefetches (a pipeline's stages run without a trace:
    hybrid.training.deepspeed_fixes.prepare_pipeline_engine). `collective_copies`:
    gloo's (CPU's) reduce-scatter copies its whole input first (NCCL does not), one more gradient. `frozen`:
    parameters without gradients (LoRA's base), which ZeRO-3 gathers and prefetches too; `params` then the
    trainable ones."""
    e = _BYTES[zero.precision]
    if zero.stage == 0:
        return 0
    shares = _zero_shares(params, zero, ep)
    sizes = [n for share, _ in shares for n, _ in share.values()]
    total, largest = sum(sizes), max(sizes, default=0)
    if zero.stage in (1, 2):
        waiting = total if zero.stage == 1 else largest
        partitions = 0
        if zero.stage == 1 and not zero.fp32_grad_accumulation:  # its gradient partitions (counted with the model
            # states) are made from the whole gradients at the end of backward, which are then freed: the whole
            # ones beyond the partitions (with fp32 accumulation in bf16 DeepSpeed runs its BF16_Optimizer instead)
            partitions = sum(math.ceil(sum(n for n, d in share.values() if d == decayed) / (2 * dp)) * 2
                             for share, dp in shares for decayed in (True, False)) * e
        return (_zero12_buckets(zero) * min(zero.reduce_bucket_size, total) + waiting) * e - partitions
    frozen_sizes = [n for n, _ in (frozen or {}).values()]
    prefetched = min(zero.prefetch_bucket_size, total + sum(frozen_sizes)) if pp == 1 else 0
    # the module is released before its gradient is reduced (the input embedding too:
    # hybrid.training.deepspeed_fixes.release_input_embedding_after_its_gradient)
    working = max(frozen_sizes, default=0)  # a frozen parameter gathered, no gradient
    for share, dp in shares:
        big = max(n for n, _ in share.values())
        reduced = math.ceil(big / dp) + (big if collective_copies else 0)
        # an MoE layer gathers all its experts at once (they are external parameters of the layer:
        # hybrid.training.deepspeed_fixes.register_moe_layers) and holds them through their gradients' reductions
        layers = {}
        for name, (n, _) in share.items():
            if is_expert(name):
                layers[name.split(EXPERTS)[0]] = layers.get(name.split(EXPERTS)[0], 0) + n
        held = max(big, max(layers.values(), default=0))
        # a full bucket's reduction: reduce_scatter_coalesced (zero_optimization.reduce_scatter, the default) joins
        # its gradients into one flat copy, which gloo copies again (its partitions are views of that copy); without
        # reduce_scatter the bucket is all-reduced where it lies
        flush = min(zero.reduce_bucket_size, sum(n for n, _ in share.values())) if zero.reduce_scatter else 0
        working = max(working, held + big, held + reduced, flush * (2 if collective_copies else 1))
    return (_zero3_bucket(zero) + prefetched + working) * e


def _zero12_buckets(zero: ZeroSettings) -> int:
    """ZeRO-1/2's reduce buckets: two with overlap_comm, none without contiguous gradients."""
    return (2 if zero.overlap_comm else 1) if zero.contiguous_gradients else 0


def _zero3_bucket(zero: ZeroSettings) -> int:
    """ZeRO-3's reduce bucket (elements): DeepSpeed 0.19.8 allocates `reduce_bucket_size` whole at start."""
    return zero.reduce_bucket_size if zero.contiguous_gradients else 0


def zero_step_bytes(params: dict, zero: ZeroSettings, ep: int = 1) -> int:
    """The optimizer step's transient on one rank (DeepSpeed 0.19), beside the partitioned states, when the
    activations are gone, the larger of two moments: the gradient norm, which takes each gradient partition in
    fp64 one at a time (`get_grad_norm_direct`: 8 bytes per element of the largest piece this rank holds; under
    ZeRO-1 beside its reduce bucket, which DeepSpeed 0.19.8 frees after the norm), and
    the update: ZeRO-1/2 step each parameter group (decayed, not; the experts' apart) with its gradient partition
    flattened and then copied to fp32 (`single_grad_partition`; one fp32 copy where the gradients are fp32), both
    alive at once; ZeRO-3 steps each sub-group (`sub_group_size`) on the fp32 copy of its gradient partitions,
    none where they already are fp32 (hybrid.training.deepspeed_fixes.step_on_gradient_partitions), beside its
    reduce bucket. Offloaded optimizers step on the host."""
    if zero.stage == 0 or zero.offload_optimizer:
        return 0
    e = _BYTES[zero.precision]
    fp32_grads = e == 4 or zero.fp32_grad_accumulation
    peak = 0
    for share, dp in _zero_shares(params, zero, ep):
        largest = max(n for n, _ in share.values())
        if zero.stage in (1, 2):
            groups = [math.ceil(sum(n for n, d in share.values() if d == decayed) / dp) for decayed in (True, False)]
            # ZeRO-1's reduce bucket is freed only after the norm (measured: benchmarks/bench_memory.py)
            bucket = _zero12_buckets(zero) * min(zero.reduce_bucket_size, sum(n for n, _ in share.values())) * e
            peak = max(peak, 8 * min(largest, max(groups)) + (bucket if zero.stage == 1 else 0),
                       max((4 if fp32_grads else e + 4) * g for g in groups))
        else:
            partition = sum(math.ceil(n / dp) for n, _ in share.values())
            update = 0 if fp32_grads else 4 * min(zero.sub_group_size, partition)
            peak = max(peak, 8 * math.ceil(largest / dp), update)
    return peak + (_zero3_bucket(zero) * e if zero.stage == 3 else 0)


# --- the whole plan ------------------------------------------------------------------------------

@dataclass
class MemoryPlan:
    """Inputs of an estimate: the model, the layout and the training settings."""

    model: ModelConfig
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    seq_length: int = 2048
    num_micro_batches: int = 1  # gradient accumulation steps (pipeline micro-batches)
    zero: ZeroSettings = field(default_factory=ZeroSettings)
    recompute: Optional[str] = None
    device_type: str = "cuda"
    partition: str = "parameters"
    schedule: str = "1f1b"  # --pipeline-schedule
    virtual: int = 1  # virtual pipeline stages per rank
    cp: int = 1  # --context-parallel-size
    ulysses: int = 1  # --ds-sequence-parallel-size
    ep: int = 1  # --expert-model-parallel-size: this rank holds 1/EP of each layer's experts
    torch_compile: bool = False  # --torch-compile (no memory of its own; the advisor's proposals must allow it)
    cpu_offloading: bool = False  # --cpu-offloading: full recompute's checkpointed layer inputs in host memory
    reference_model: bool = False  # --dpo without --dpo-reference-logps, --grpo-beta: frozen weights on every rank
    muon: bool = False  # --optimizer muon (hybrid.training.muon: ZeRO-0's whole matrices, or ZeRO's partitions)
    decode_rows: int = 0  # --grpo: the rows a rank's rollout decodes at once (0: no decoding)
    decode_slots: int = 0  # and their slots: prompt and completion tokens


def decoding_cache_bytes(config: ModelConfig, tp: int, rows: int, slots: int, layers, dtype_bytes: int) -> int:
    """The decoding cache (hybrid.model.kv_cache.KVCache) of `rows` rows of `slots` slots on a rank holding layers
    `layers` (0-based) at TP `tp`, preallocated whole: an attention layer's keys and values [rows, KV heads / tp,
    slots, head size] (MLA: its latent and rope key, one head each; a layer reading another's: none) and DSA's
    indexer keys [slots, rows, head size] where a layer chooses its own, in the model's dtype; a Gated DeltaNet
    layer's state [rows, value heads / tp, dk, dv] in fp32 and its conv's last K - 1 inputs [K - 1, rows, (2 x key
    + value) channels / tp]."""
    total = 0
    for i in layers:
        c = config.layer_config(i)
        if config.linear_attention(i):
            nk, nv = c.linear_num_key_heads // tp, c.linear_num_value_heads // tp
            dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
            total += rows * (4 * nv * dk * dv + dtype_bytes * (c.linear_conv_kernel_dim - 1) * (2 * nk * dk + nv * dv))
            continue
        if config.kv_source(i) is not None:
            continue
        if c.multi_latent_attention:
            per_slot = c.kv_lora_rank + c.qk_pos_emb_head_dim
        else:
            per_slot = (c.num_query_groups or c.num_attention_heads) // tp * (c.head_dim + c.value_head_dim)
        if c.dsa_indexer_topk and config.dsa_source(i) is None:
            per_slot += c.dsa_indexer_head_dim
        total += dtype_bytes * rows * slots * per_slot
    return total


def _zero3_gathered_stage(params: dict, plan: MemoryPlan) -> int:
    """ZeRO-3 while a --grpo rollout decodes: the stage's parameters gathered whole beside their partitions (the
    persistent ones are whole already), and the reduce bucket, allocated whole at start."""
    e = _BYTES[plan.zero.precision]
    whole = sum(n // (plan.ep if is_expert(name) else 1) for name, (n, _) in params.items()
                if n >= plan.zero.persistence_threshold)
    return (whole + _zero3_bucket(plan.zero)) * e


def frozen_indexer(name: str, config: ModelConfig) -> bool:
    """A parameter of DSA's lightning indexer (hybrid.model.dsa) where it is frozen (no --dsa-indexer-loss-coeff)."""
    return ".attention.indexer." in name and not config.dsa_indexer_loss_coeff


def frozen_bytes(params: dict, zero: ZeroSettings) -> int:
    """Bytes of parameters without gradients (LoRA's frozen base): in the working precision (fp32 without ZeRO in
    fp32), whole on every rank under ZeRO-0/1/2, partitioned under ZeRO-3 as its other parameters (those below the
    persistence threshold whole too; none on the device with parameter offload)."""
    e = _BYTES[zero.precision]
    sizes = [n for n, _ in params.values()]
    if zero.stage < 3:
        return e * sum(sizes)
    if zero.offload_param:
        return 0
    return e * sum(math.ceil(n / zero.dp) + (n if n < zero.persistence_threshold else 0) for n in sizes)


def _stage_model_states(params: dict, plan: MemoryPlan) -> dict:
    """ZeRO bytes of one rank's parameters: dense ones partitioned over DP; its 1/EP of the experts in
    their own groups (DeepSpeed's MoE groups), partitioned over the expert-data-parallel group, DP / EP. With LoRA
    only the adapters train (hybrid.model.lora): the base's weights alone (frozen_bytes)."""
    if plan.model.lora_rank:
        trainable = {name: v for name, v in params.items() if lora.trains(name, plan.model)}
        states = model_state_bytes([[n for n, d in trainable.values() if d == decayed] for decayed in (True, False)],
                                   plan.zero)
        states["params"] += frozen_bytes({n: v for n, v in params.items() if n not in trainable}, plan.zero)
        return states
    indexers = {name: v for name, v in params.items() if frozen_indexer(name, plan.model)}
    if indexers:  # DSA's frozen indexer (hybrid.model.dsa): its weights alone
        states = _stage_model_states({n: v for n, v in params.items() if n not in indexers}, plan)
        states["params"] += frozen_bytes(indexers, plan.zero)
        return states
    dense = [[n for name, (n, d) in params.items() if d == decayed and not is_expert(name)]
             for decayed in (True, False)]
    if plan.muon:
        return _muon_rank_bytes(params, plan)
    states = model_state_bytes(dense, plan.zero)
    experts = [[n for name, (n, d) in params.items() if d == decayed and is_expert(name)] for decayed in (True, False)]
    if any(experts):
        ep = plan.ep
        mine = [g[: len(g) // ep] for g in experts]  # the experts are alike: 1/EP of them
        zero = _expert_zero(plan.zero, ep)
        for key, value in model_state_bytes(mine, zero).items():
            states[key] += value
    return states


def _muon_state_bytes(params: dict, config: ModelConfig, tp: int = 1) -> dict:
    """--optimizer muon at ZeRO-0 in fp32 (hybrid.training.muon): fp32 weights and gradients; torch's Muon keeps a
    momentum buffer per matrix element, and for a fused matrix its parts' copies of the rows and of their
    gradients; torch's AdamW two moments and a step per parameter of the rest. At TP > 1 every matrix is a part
    and each is whole on every rank (its momentum, rows and gradients: TP times this rank's share)."""
    muon = sum(n for name, (n, _) in params.items() if takes_muon(name))
    parts = sum(n for name, (n, _) in params.items() if takes_muon(name) and (tp > 1 or is_fused(name, config)))
    adam = [n for name, (n, _) in params.items() if not takes_muon(name)]
    numel = muon + sum(adam)
    return dict(params=4 * numel, grads=4 * numel,
                optimizer=4 * tp * muon + 8 * tp * parts + 8 * sum(adam) + 4 * len(adam), host_optimizer=0)


def _expert_zero(zero: ZeroSettings, ep: int) -> ZeroSettings:
    """ZeRO over the expert-data-parallel group (DeepSpeed's MoE groups): DP / EP ranks."""
    return ZeroSettings(**dict(asdict(zero), dp=max(1, zero.dp // ep)))


def _expert_share(params: dict, ep: int) -> tuple[dict, dict]:
    """(the dense parameters, this rank's 1/EP of the experts' parameters: the experts are alike)."""
    dense = {name: v for name, v in params.items() if not is_expert(name)}
    experts = [(name, v) for name, v in params.items() if is_expert(name)]
    return dense, dict(experts[: len(experts) // ep])


def _muon_rank_bytes(params: dict, plan) -> dict:
    """--optimizer muon's bytes on a rank: ZeRO-0's whole matrices, or ZeRO's partitions (the experts' over their
    own data-parallel group, DP / EP)."""
    dense, experts = _expert_share(params, plan.ep)
    if plan.zero.stage == 0:
        return _muon_state_bytes({**dense, **experts}, plan.model, plan.tp)
    states = _sharded_muon_state_bytes(dense, plan.zero)
    if experts:
        zero = _expert_zero(plan.zero, plan.ep)
        for key, value in _sharded_muon_state_bytes(experts, zero).items():
            states[key] += value
    return states


def _sharded_muon_state_bytes(params: dict, zero: ZeroSettings) -> dict:
    """--optimizer muon under ZeRO-1/2/3 (hybrid.training.muon.ShardedMuonWithAdamW): ZeRO's bytes for the
    groups AdamW's decayed and undecayed parameters and the Muon matrices, the Muon group's partition keeping
    one momentum buffer instead of Adam's two moments and no step."""
    groups = [[n for name, (n, d) in params.items() if d == decayed and not takes_muon(name)]
              for decayed in (True, False)]
    muon = [n for name, (n, _) in params.items() if takes_muon(name)]
    states = model_state_bytes([*groups, muon], zero)
    if muon:
        partition = math.ceil(sum(muon) / (2 * zero.dp)) * 2 if zero.stage in (1, 2) else sum(
            math.ceil(n / zero.dp) for n in muon)
        key = "host_optimizer" if zero.offload_optimizer else "optimizer"
        states[key] -= 4 * partition + 4
    return states


def muon_step_bytes(params: dict, zero: ZeroSettings, ep: int = 1) -> int:
    """What the sharded Muon step holds while it runs (ZeRO-1/2/3), for its largest group (the dense matrices over
    DP, the experts' over DP / EP, stepped one after the other): every rank's blended momentum gathered and the
    orthogonalized update before its reduce-scatter (bf16, the whole group), this rank's blend (fp32, and its bf16
    copy) and its partition of the update (bf16)."""
    if zero.stage == 0:
        return 0
    peak = 0
    for share, dp in _zero_shares(params, zero, ep):
        total = sum(n for name, (n, _) in share.items() if takes_muon(name))
        peak = max(peak, 2 * 2 * total + (4 + 2 + 2) * math.ceil(total / dp))
    return peak


def estimate(plan: MemoryPlan) -> list[dict]:
    """Per pipeline stage, the bytes one of its ranks holds (every TP and DP rank of a stage holds
    the same amounts)."""
    config = plan.model
    precision = plan.zero.precision
    kernel = attention_kernel_for(plan.device_type, precision, config.attention_dropout, config)
    mask_bytes = 1 if plan.device_type == "cuda" else _BYTES[precision]
    if plan.cp > 1:
        kernel = "flash"  # the ring's block kernels keep their log-sum-exp, never the scores
    act = ActivationSettings(plan.micro_batch, plan.seq_length, plan.tp, config.sequence_parallel, precision,
                             plan.recompute, kernel, mask_bytes, plan.cp, plan.ulysses)
    rows = []
    for stage, info in enumerate(stage_parameters(config, plan.tp, plan.pp, plan.partition, plan.schedule,
                                                  plan.virtual)):
        info["params"] = vocab_blocks(info["params"], config, plan.tp)
        states = _stage_model_states(info["params"], plan)
        if info["replica"]:  # a tied table's copy: its weights and gradient in the working precision, whole
            states["params"] += info["replica"] * _BYTES[precision]
            states["grads"] += info["replica"] * _BYTES[precision]
        trainable, frozen = info["params"], None
        if config.lora_rank or config.dsa_indexer_topk:  # ZeRO's buckets and step hold the trainable parameters only
            trainable = {n: v for n, v in info["params"].items()
                         if (lora.trains(n, config) if config.lora_rank else True) and not frozen_indexer(n, config)}
            frozen = {n: v for n, v in info["params"].items() if n not in trainable}
        buffers = zero_buffer_bytes(trainable, plan.zero, plan.pp, plan.device_type == "cpu", plan.ep, frozen)
        step = zero_step_bytes(trainable, plan.zero, plan.ep)
        if plan.muon:  # the sharded Muon's gathers, beside the fp32 gradient partitions DeepSpeed hands it
            step += muon_step_bytes(info["params"], plan.zero, plan.ep)
        each = [layer_activation_bytes(config, act, layer=i) for i in info["layers"]]
        if info["last"]:  # multi-token prediction's layers (hybrid.model.mtp)
            each += [layer_activation_bytes(config, act, layer=i) for i in config.mtp_layers]
        per_layer = max(each, default=layer_activation_bytes(config, act))
        layers = len(info["layers"])
        in_flight = in_flight_micro_batches(stage, plan.pp, plan.num_micro_batches, plan.schedule, plan.virtual)
        activations = int(sum(each) * in_flight)
        host_activations = 0
        if plan.cpu_offloading and plan.recompute == "full":  # the layer inputs wait in host memory (DeepSpeed
            host_activations, activations = activations, 0  # copies each back before its layer's backward)
        if plan.recompute == "full" and layers:  # backward rebuilds one chunk of layers at a time
            chunk = min(layers, max(1, config.recompute_num_layers))
            kept = ActivationSettings(**dict(asdict(act), recompute=None))
            activations += chunk * max(layer_activation_bytes(config, kept, layer=i) for i in info["layers"])
        activations += int(embedding_and_head_bytes(config, act, info["first"], info["last"]) * in_flight)
        if layers:
            activations += sequence_split_buffer_bytes(config, act, plan.device_type)
        parameters = sum(n // (plan.ep if is_expert(name) else 1) for name, (n, _) in info["params"].items())
        # --dpo's reference model: its weights in the training precision, sharded as the model's (never by ZeRO)
        reference = parameters * _BYTES[precision] if plan.reference_model else 0
        row = dict(stage=stage, layers=layers, parameters=parameters, in_flight_micro_batches=in_flight,
                   activation_bytes_per_layer=per_layer, activations=activations,
                   fp8=fp8_bytes(config, info["layers"], act), host_activations=host_activations,
                   reference=reference, **states)
        row["buffers"], row["step"] = buffers, step
        # --grpo's rollouts: the decoding cache, beside the stage's parameters gathered whole under ZeRO-3
        # (hybrid.training.deepspeed_fixes.zero3_gathered_while_generating)
        row["decoding"] = 0 if not plan.decode_rows else (
            decoding_cache_bytes(config, plan.tp, plan.decode_rows, plan.decode_slots, info["layers"],
                                 _BYTES[precision])
            + (_zero3_gathered_stage(info["params"], plan) if plan.zero.stage == 3 else 0))
        # the largest of three moments: the backward (ZeRO's buffers beside the activations), the step, decoding
        row["total"] = (row["params"] + row["grads"] + row["optimizer"] + row["reference"]
                        + max(row["buffers"] + row["activations"] + row["fp8"], row["step"], row["decoding"]))
        rows.append(row)
    return rows


def format_table(rows: list[dict], plan: MemoryPlan) -> str:
    """The estimate as a table in GiB, one line per pipeline stage."""
    z = plan.zero
    split = f" x CP {plan.cp}" if plan.cp > 1 else f" x Ulysses {plan.ulysses}" if plan.ulysses > 1 else ""
    virtual = f", {plan.schedule} x {plan.virtual} virtual stages" if plan.pp > 1 and plan.schedule != "1f1b" else ""
    head = (f"memory per rank (GiB): TP {plan.tp}{split} x PP {plan.pp} x DP {plan.dp}, ZeRO-{z.stage}"
            f"{' + optimizer offload' if z.offload_optimizer else ''}, {z.precision}, micro batch {plan.micro_batch}, "
            f"seq {plan.seq_length}, recompute {plan.recompute or 'none'}"
            f"{', SP' if plan.model.sequence_parallel else ''}"
            f"{virtual}")
    cols = ("stage", "layers", "params", "grads", "optimizer", "buffers", "activations", "step", "total")
    lines = [head, "  ".join(f"{c:>11}" for c in cols)]
    for r in rows:
        lines.append("  ".join([f"{r['stage']:>11}", f"{r['layers']:>11}"]
                               + [f"{r[c] / GiB:>11.3f}" for c in cols[2:]]))
    if any(r["fp8"] for r in rows):
        c = plan.model
        lines.append(f"FP8 ({c.fp8_recipe}, {c.fp8_format}): {max(r['fp8'] for r in rows) / GiB:.3f} GiB per rank in "
                     f"the totals: the FP8 copies of the largest GEMM's operands while it runs"
                     f"{' and the amax histories' if c.fp8_recipe == 'delayed' else ''}")
    if any(r["decoding"] for r in rows):
        lines.append(f"--grpo rollouts: {max(r['decoding'] for r in rows) / GiB:.3f} GiB per rank while decoding, "
                     f"in the totals: the cache of {plan.decode_rows} rows x {plan.decode_slots} slots"
                     f"{' and the stage gathered whole (ZeRO-3)' if plan.zero.stage == 3 else ''}")
    if any(r["reference"] for r in rows):
        grpo = plan.decode_rows > 0  # (--grpo-beta's reference; else --dpo's)
        size = max(r["reference"] for r in rows) / GiB
        why = "" if grpo else "; --dpo-reference-logps scores the windows once and frees it"
        lines.append(f"{'--grpo-beta' if grpo else '--dpo'} reference model: {size:.3f} GiB per rank in the totals "
                     f"(its frozen weights{why})")
    if any(r["host_activations"] for r in rows):
        lines.append(f"host memory for the offloaded activations (--cpu-offloading: the checkpointed layer inputs): "
                     f"{max(r['host_activations'] for r in rows) / GiB:.3f} GiB per rank")
    if any(r["host_optimizer"] for r in rows):
        lines.append(f"host memory for the offloaded optimizer: {max(r['host_optimizer'] for r in rows) / GiB:.3f} GiB "
                     f"per rank")
    return "\n".join(lines)
