"""--optimizer muon: torch.optim.Muon on the transformer blocks' weight matrices, AdamW on the rest.

As Megatron-LM and the Muon papers apply it: every 2-D weight of the transformer layers takes torch's Muon
(momentum, orthogonalized by its Newton-Schulz iteration), each HF projection its own matrix even where the
engine fuses them (the fused QKV's rows are q, k and v, found with `hybrid.model.qkv`'s layout; a gated MLP's
fc1 rows are gate, then up); embeddings, the output layer, norms and biases take AdamW (torch's, with the run's
betas and eps). One learning rate schedule drives both (the LR scheduler sets every group's lr), and the weight
decay is decoupled in both, none on norms and biases (Megatron-LM's rule).

A fused projection's parts are given to torch's Muon as matrices of their own ("parts"): before each step the
parts take their rows of the weight and of its gradient, torch's Muon steps them, and the rows are written
back, so the update is torch's own on each HF matrix (its momentum buffers are the parts' state). With tensor
parallelism every matrix is a part holding the whole matrix: each rank's rows (column-parallel weights: QKV,
fc1) or columns (row-parallel ones: the attention's output, fc2) are gathered over the TP group, every TP
rank steps the whole matrix (Newton-Schulz sees it whole; its momentum is kept whole on each rank) and keeps
its own slice.

Two forms, one update. Without ZeRO (`MuonWithAdamW`) the optimizer is built once the model is on the
accelerator (hybrid.training.engine), so its parts and rows are made there, and DeepSpeed steps it on the model's
own parameters (fp32; DeepSpeed's bf16/fp16 optimizers without ZeRO keep a flat master copy: refused by the
capability table). Under ZeRO-1/2/3 (`ShardedMuonWithAdamW`) DeepSpeed hands it flat fp32 partitions; the
elementwise parts of torch's update run on the partitions, and each matrix is gathered, orthogonalized on one
owner rank and scattered back (its docstring). Every expert's fc1 and fc2 are matrices of their own (an MoE
layer's router takes AdamW); under ZeRO the experts' partitions are over their own data-parallel group, the
groups split as DeepSpeed's MoE convention asks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
# torch's own Newton-Schulz iteration and learning-rate adjustment (what torch.optim.Muon's step calls), used on
# the gathered matrices under ZeRO
from torch.optim._muon import DEFAULT_A as _A, DEFAULT_B as _B, DEFAULT_C as _C, EPS as _EPS
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from hybrid.checkpoint.tp_layout import tp_layout
from hybrid.model.naming import canonical_parameters, is_fused, takes_muon
from hybrid.model.qkv import split_qkv_flat


def muon_rows(name: str, param: torch.Tensor, config) -> list:
    """The HF matrices a weight holds, as row indices of it ([None]: the whole weight is one matrix)."""
    if not is_fused(name, config):
        return [None]
    rows = torch.arange(param.shape[0], device=param.device)
    if name.endswith("attention.qkv.weight"):
        parts = name.split(".")
        if parts[0] == "layers":  # (Gemma 4's full-attention layers: their own head size, KV heads, no values)
            if config.kv_source(int(parts[1])) is not None:  # a layer reading another's keys: its queries only
                return [None]
            config = config.layer_config(int(parts[1]))
        groups = config.num_query_groups or config.num_attention_heads
        return [t for t in split_qkv_flat(rows, config.num_attention_heads // groups, config.head_dim,
                                          not config.attention_k_eq_v) if t is not None]
    return list(rows.chunk(2))  # a gated MLP's fc1: gate, then up


def whole_over_tp(tp, local: torch.Tensor, dim) -> torch.Tensor:
    """The whole matrix of a TP-split one (every TP rank's slice along `dim`, in rank order); `local` itself where
    it is not split (`dim` None)."""
    if dim is None:
        return local
    pieces = [torch.empty_like(local) for _ in range(tp.size)]
    torch.distributed.all_gather(pieces, local.contiguous(), group=tp.group)
    return torch.cat(pieces, dim)


def own_over_tp(tp, whole: torch.Tensor, dim) -> torch.Tensor:
    """This TP rank's slice of a whole matrix (whole_over_tp's inverse)."""
    if dim is None:
        return whole
    size = whole.shape[dim] // tp.size
    return whole.narrow(dim, tp.rank * size, size)


def split_for_muon(model, num_layers: int, groups: list) -> tuple:
    """-> ({id(parameter): canonical name}, the matrices Muon steps, `groups` without them (AdamW's))."""
    names = {id(p): n for n, p in canonical_parameters(model, num_layers).items()}
    matrices = [p for g in groups for p in g["params"] if takes_muon(names.get(id(p), "")) and _ndim(p) == 2]
    chosen = {id(p) for p in matrices}
    groups = [dict(g, params=[p for p in g["params"] if id(p) not in chosen]) for g in groups]
    return names, matrices, [g for g in groups if g["params"]]


def _ndim(param) -> int:
    """A parameter's dimensions, also under ZeRO-3 (its `ds_shape`: the data is a partition)."""
    return len(getattr(param, "ds_shape", param.shape))


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on the layers' matrices (each HF projection its own), torch.optim.AdamW on the rest;
    `param_groups` are AdamW's groups and one group of the Muon weights, whose lr and weight decay the step
    hands to torch's Muon. `tp`: the TP Axis (hybrid.parallel.groups); at TP > 1 each part is the whole matrix,
    its rows (column-parallel weights) or columns (row-parallel ones) gathered from every TP rank, stepped on
    each, and the rank's own slice written back."""

    def __init__(self, model, config, num_layers: int, adamw_groups: list, lr: float, weight_decay: float,
                 betas: tuple, eps: float, momentum: float, nesterov: bool, ns_steps: int, adjust_lr_fn, tp=None):
        names, matrices, adamw_groups = split_for_muon(model, num_layers, adamw_groups)
        self.tp = tp if tp is not None and tp.size > 1 else None
        layout = tp_layout(config) if self.tp else {}
        self.parts = []  # (weight, its rows or None, the TP split dimension or None, the part torch's Muon steps)
        targets = []
        for weight in matrices:
            name = names[id(weight)]
            dim = layout[name].dim if self.tp else None
            for rows in muon_rows(name, weight, config):
                if rows is None and dim is None:
                    targets.append(weight)
                    continue
                part = torch.nn.Parameter(whole_over_tp(self.tp, self._rows(weight.detach(), rows), dim))
                self.parts.append((weight, rows, dim, part))
                targets.append(part)
        self.adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.muon = torch.optim.Muon(targets, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                     nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        self.matrices = matrices
        muon_group = {"params": matrices, "lr": lr, "weight_decay": weight_decay, "muon": True}
        super().__init__([*self.adamw.param_groups, muon_group], {"lr": lr, "weight_decay": weight_decay})
        # AdamW's group dicts are the ones it steps with (the scheduler's lr reaches it); Muon's is handed over
        self.param_groups[:len(self.adamw.param_groups)] = self.adamw.param_groups

    @staticmethod
    def _rows(tensor: torch.Tensor, rows) -> torch.Tensor:
        return tensor if rows is None else tensor.index_select(0, rows)

    def describe(self) -> str:
        """For the log: what takes which optimizer."""
        matrices = len(self.muon.param_groups[0]["params"])
        return (f"torch.optim.Muon on {matrices} matrices ({len(self.matrices)} weights, fused ones split into their "
                f"HF projections) + torch.optim.AdamW on the other "
                f"{sum(len(g['params']) for g in self.adamw.param_groups)} parameters")

    @property
    def muon_group(self) -> dict:
        return self.param_groups[-1]

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.muon.param_groups:
            group["lr"], group["weight_decay"] = self.muon_group["lr"], self.muon_group["weight_decay"]
        for weight, rows, dim, part in self.parts:
            part.copy_(whole_over_tp(self.tp, self._rows(weight, rows), dim))
            part.grad = None if weight.grad is None else whole_over_tp(self.tp, self._rows(weight.grad, rows), dim)
        self.muon.step()
        for weight, rows, dim, part in self.parts:
            own = own_over_tp(self.tp, part, dim)
            if rows is None:
                weight.copy_(own)
            else:
                weight.index_copy_(0, rows, own)
            part.grad = None
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        self.adamw.zero_grad(set_to_none)
        for weight in self.matrices:
            if set_to_none:
                weight.grad = None
            elif weight.grad is not None:
                weight.grad.zero_()

    def state_dict(self) -> dict:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict(),
                "muon_group": {k: v for k, v in self.muon_group.items() if k != "params"}}

    def load_state_dict(self, state_dict: dict) -> None:
        self.adamw.load_state_dict(state_dict["adamw"])
        self.muon.load_state_dict(state_dict["muon"])
        self.muon_group.update(state_dict["muon_group"])


@dataclasses.dataclass(frozen=True)
class Partitioned:
    """Where one parameter lies in the flat fp32 partition a ZeRO optimizer hands its client optimizer (made by
    hybrid.training.deepspeed_fixes.zero_partitions from DeepSpeed's bookkeeping). `contiguous` (ZeRO-1/2): the
    group's parameters are concatenated into one flat buffer cut into equal rank partitions, the parameter at
    `offset` of the whole buffer; otherwise (ZeRO-3) each parameter is cut into `part` elements per rank, this
    rank's piece at `offset` of its flat partition, rank r's piece elements [r * part, (r + 1) * part)."""

    param: torch.nn.Parameter
    shape: tuple
    offset: int
    part: int = 0
    contiguous: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def read(self, gathered: torch.Tensor) -> torch.Tensor:
        """The whole parameter (its shape) from every rank's flat partition gathered ([ranks, partition])."""
        if self.contiguous:
            return gathered.view(-1)[self.offset:self.offset + self.numel].view(self.shape)
        return gathered[:, self.offset:self.offset + self.part].reshape(-1)[:self.numel].view(self.shape)

    def local(self, partition: "FlatPartition", first: int, last: int) -> list:
        """Elements [first, last) of the parameter (flattened) that lie in this rank's partition, as [(start,
        end)] of the partition (none or one)."""
        if self.contiguous:  # this rank's partition: elements [rank * n, (rank + 1) * n) of the whole buffer
            low = partition.rank * partition.flat.numel()
            start, end = max(first + self.offset, low), min(last + self.offset, low + partition.flat.numel())
            return [(start - low, end - low)] if start < end else []
        low = partition.rank * self.part  # this rank's piece: elements [rank * part, (rank + 1) * part)
        start, end = max(first, low), min(last, low + self.part)
        return [(self.offset + start - low, self.offset + end - low)] if start < end else []

    def write(self, buffer: torch.Tensor, whole: torch.Tensor) -> None:
        """Put a whole parameter-shaped tensor where `read` takes it from."""
        if self.contiguous:
            buffer.view(-1)[self.offset:self.offset + self.numel].copy_(whole.reshape(-1))
        else:
            ranks = buffer.shape[0]
            padded = torch.nn.functional.pad(whole.reshape(-1), (0, ranks * self.part - self.numel))
            buffer[:, self.offset:self.offset + self.part].copy_(padded.view(ranks, self.part))


@dataclasses.dataclass
class FlatPartition:
    """One flat fp32 partition a ZeRO optimizer steps (a parameter group, or a ZeRO-3 sub-group; on the host with
    optimizer offload): its ranks' group and this rank's place in it, the parameters in it, the device its
    collectives run on."""

    flat: torch.Tensor
    group: object
    ranks: int
    rank: int
    params: list  # [Partitioned]
    device: torch.device  # where the gathers run: the accelerator (the partition itself may be on the host)
    runs: Optional[list] = None  # ShardedMuonWithAdamW._runs, made at its first step


class ShardedMuonWithAdamW(torch.optim.Optimizer):
    """--optimizer muon under ZeRO-1/2/3: the client optimizer DeepSpeed's ZeRO hands flat fp32 partitions
    (`attach` tells it which parameters lie where in them). AdamW's groups step with torch.optim.AdamW on the
    partitions (elementwise: a partition is as good as the whole). The Muon group's update is torch.optim.Muon's,
    computed as distributed Muon implementations do: the momentum (`buf.lerp_(grad, 1 - momentum)`) and the
    Nesterov blend are elementwise, so they run on this rank's partition and the momentum buffer is partitioned
    as AdamW's moments are; the blended matrices are all-gathered over the partition's ranks, each matrix (each
    HF projection of a fused weight, whole over TP as in MuonWithAdamW) is orthogonalized by torch's own
    Newton-Schulz on one owner rank (matrices dealt to the ranks by their Newton-Schulz cost: the work is spread,
    not repeated), scaled by torch's learning-rate adjustment, and a reduce-scatter (each element has one owner;
    the others add zeros) brings every rank its partition of the update; the decoupled weight decay is applied to
    the partition as torch's Muon does to the parameter."""

    def __init__(self, model, config, num_layers: int, adamw_groups: list, lr: float, weight_decay: float,
                 betas: tuple, eps: float, momentum: float, nesterov: bool, ns_steps: int, adjust_lr_fn, tp=None):
        names, matrices, adamw_groups = split_for_muon(model, num_layers, adamw_groups)
        adamw_groups = [dict(g, name=g.get("name", f"adamw_{i}")) for i, g in enumerate(adamw_groups)]
        self.config, self.names = config, {id(p): names[id(p)] for p in matrices}
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.layout = tp_layout(config) if self.tp else {}
        self.matrices = matrices
        muon_group = {"params": matrices, "weight_decay": weight_decay, "muon": True, "name": "muon"}
        groups = [*adamw_groups, muon_group]
        if any(is_moe_param(p) for g in groups for p in g["params"]):
            # DeepSpeed's ZeRO partitions experts over their own data-parallel group: its groups marked as its
            # MoE convention asks (each of ours split into the dense part and one group per expert group)
            groups = [g for g in split_params_into_different_moe_groups_for_optimizer(groups) if g["params"]]
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})
        self.muon_defaults = {"momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps,
                              "adjust_lr_fn": adjust_lr_fn}
        self.adamw = torch.optim.AdamW([g for g in self.param_groups if not g.get("muon")], lr=lr, betas=betas,
                                       eps=eps, weight_decay=weight_decay)
        self._share()
        self.partitions = {}  # id(flat) -> FlatPartition
        self.adamw_count = sum(len(g["params"]) for g in adamw_groups)  # for the log (DeepSpeed flattens them)

    def _share(self) -> None:
        """AdamW steps this optimizer's own group dicts (DeepSpeed puts its partitions in them) and keeps its
        moments in this optimizer's state (which DeepSpeed saves and loads)."""
        adamw = [g for g in self.param_groups if not g.get("muon")]
        for group in adamw:
            for key, value in self.adamw.defaults.items():
                group.setdefault(key, value)
        self.adamw.param_groups = adamw
        self.adamw.state = self.state

    def attach(self, partitions: list) -> None:
        """The flat partitions DeepSpeed made (hybrid.training.deepspeed_fixes.zero_partitions)."""
        muon = {id(p) for p in self.matrices}
        for partition in partitions:
            if any(id(p.param) in muon for p in partition.params):
                if not all(id(p.param) in muon for p in partition.params):
                    raise RuntimeError("a ZeRO partition mixes Muon matrices and AdamW parameters")
                self.partitions[id(partition.flat)] = partition

    def describe(self) -> str:
        count = sum(len(muon_rows(self.names[id(p)], torch.empty(getattr(p, "ds_shape", p.shape)[0], device="cpu"),
                                  self.config))
                    for p in self.matrices)
        return (f"torch.optim.Muon's update on {count} matrices ({len(self.matrices)} weights, fused ones split into "
                f"their HF projections; Newton-Schulz on one owner rank per matrix, momentum partitioned by ZeRO) "
                f"+ torch.optim.AdamW on the other {self.adamw_count} parameters")

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for partition in self.partitions.values():
            # a universal load's zero second moments are not Muon's: dropped before DeepSpeed links its fragments
            # to the state (after its first group's step)
            if partition.flat in self.state:
                self.state[partition.flat].pop("exp_avg_sq", None)
        for group in self.param_groups:
            if group.get("muon"):
                for flat in group["params"]:
                    if flat.grad is not None:
                        self._muon_step(flat, group)
        # only the groups handed over now: DeepSpeed's ZeRO-1/2 steps one group at a time (its _optimizer_step
        # narrows param_groups to it), and with optimizer offload every group's partition keeps its gradient
        everything = self.adamw.param_groups
        self.adamw.param_groups = [g for g in self.param_groups if not g.get("muon")]
        try:
            self.adamw.step()
        finally:
            self.adamw.param_groups = everything
        return loss

    def _owners(self, partition: FlatPartition) -> list:
        """Each parameter's owner rank: the Newton-Schulz work dealt greedily by cost (rows x columns x the
        smaller side), the same on every rank."""
        load, owners = [0] * partition.ranks, []
        for p in partition.params:
            rows, cols = p.shape
            rank = min(range(partition.ranks), key=lambda r: (load[r], r))
            load[rank] += rows * cols * min(rows, cols)
            owners.append(rank)
        return owners

    def _muon_step(self, flat: torch.Tensor, group: dict) -> None:
        partition = self.partitions[id(flat)]
        options = {**self.muon_defaults, **{k: group[k] for k in self.muon_defaults if k in group}}
        lr, weight_decay, momentum = group["lr"], group["weight_decay"], options["momentum"]
        state = self.state[flat]
        # torch's momentum buffer (buf.lerp_(grad, 1 - momentum)) is an exponential average of the gradients, as
        # Adam's first moment is: kept under Adam's name, DeepSpeed's universal checkpoints carry it
        # (hybrid.conversion.ds_universal)
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(flat.grad)
        buf = state["exp_avg"]
        buf.lerp_(flat.grad, 1 - momentum)
        blended = flat.grad.lerp(buf, momentum) if options["nesterov"] else buf
        # in bf16 (torch's Newton-Schulz starts by rounding to bf16 and returns bf16: the same bits, half the bytes
        # gathered); with optimizer offload the partition is on the host: the gathers and Newton-Schulz run on the
        # accelerator
        blended = blended.to(partition.device, torch.bfloat16)
        gathered = blended.new_empty(partition.ranks * blended.numel())
        torch.distributed.all_gather_into_tensor(gathered, blended.contiguous(), group=partition.group)
        gathered = gathered.view(partition.ranks, blended.numel())
        update = torch.zeros_like(gathered)
        for p, owner in zip(partition.params, self._owners(partition)):
            if owner != partition.rank:
                continue
            whole = p.read(gathered)
            name = self.names[id(p.param)]
            dim = self.layout[name].dim if self.tp else None
            ortho = torch.zeros_like(whole)
            for rows in muon_rows(name, whole, self.config):
                matrix = whole_over_tp(self.tp, whole if rows is None else whole.index_select(0, rows), dim)
                ortho_matrix = _zeropower_via_newtonschulz(matrix, (_A, _B, _C), options["ns_steps"], _EPS)
                own = own_over_tp(self.tp, ortho_matrix, dim)
                if rows is None:
                    ortho.copy_(own)
                else:
                    ortho.index_copy_(0, rows, own)
            p.write(update, ortho)
        mine = torch.empty_like(blended)
        torch.distributed.reduce_scatter_tensor(mine, update.view(-1), group=partition.group)
        mine = mine.to(flat.device)
        flat.mul_(1 - lr * weight_decay)
        for start, end, shape in self._runs(partition, options["adjust_lr_fn"]):
            # torch's param.add_(update, alpha=-adjusted_lr), the bf16 update as it adds it
            flat[start:end].add_(mine[start:end], alpha=-_adjust_lr(lr, options["adjust_lr_fn"], shape))

    def _runs(self, partition: FlatPartition, adjust_lr_fn) -> list:
        """(start, end, an HF matrix shape) of the runs of this rank's partition whose matrices' learning rate
        adjustment is the same (it depends on the matrix: a fused QKV's q, k and v rows alternate, usually with
        one adjustment), made once per partition."""
        if partition.runs is not None:
            return partition.runs
        runs, tp = [], self.tp.size if self.tp else 1
        for p in partition.params:
            name, (rows, cols) = self.names[id(p.param)], p.shape
            dim = self.layout[name].dim if self.tp else None
            shapes, matrix_of = [], torch.empty(rows, dtype=torch.long, device="cpu")  # bookkeeping, on the host
            for i, part in enumerate(muon_rows(name, torch.empty(rows, device="cpu"), self.config)):
                count = rows if part is None else len(part)
                shapes.append((count * tp, cols) if dim == 0 else (count, cols * tp) if dim == 1 else (count, cols))
                matrix_of[slice(None) if part is None else part.cpu()] = i
            edges = [0, *(torch.nonzero(matrix_of[1:] != matrix_of[:-1]).flatten() + 1).tolist(), rows]
            for a, b in zip(edges[:-1], edges[1:]):
                for start, end in p.local(partition, a * cols, b * cols):
                    runs.append((start, end, shapes[matrix_of[a]]))
        merged = []
        for start, end, shape in runs:  # neighbours with the same adjustment: one kernel
            if merged and merged[-1][1] == start and (
                    _adjust_lr(1.0, adjust_lr_fn, merged[-1][2]) == _adjust_lr(1.0, adjust_lr_fn, shape)):
                merged[-1] = (merged[-1][0], end, merged[-1][2])
            else:
                merged.append((start, end, shape))
        partition.runs = merged
        return merged

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share()  # torch's load made new group dicts and a new state
