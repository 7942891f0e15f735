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

The optimizer is built once the model is on the accelerator (hybrid.training.engine), so its parts and rows are
made there. It is handed to DeepSpeed as its client optimizer: at ZeRO-0 in fp32 DeepSpeed steps it on the
model's own parameters (the other settings are refused by the capability table: ZeRO and DeepSpeed's bf16/fp16
optimizers flatten parameters into partitions, which are not matrices; pipelines and experts are not built yet).
"""

from __future__ import annotations

import torch

from hybrid.checkpoint.tp_layout import tp_layout
from hybrid.model.naming import canonical_parameters, is_fused, takes_muon
from hybrid.model.qkv import split_qkv_flat


def muon_rows(name: str, param: torch.Tensor, config) -> list:
    """The HF matrices a weight holds, as row indices of it ([None]: the whole weight is one matrix)."""
    if not is_fused(name, config):
        return [None]
    rows = torch.arange(param.shape[0], device=param.device)
    if name.endswith("attention.qkv.weight"):
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        groups = config.num_query_groups or config.num_attention_heads
        return list(split_qkv_flat(rows, config.num_attention_heads // groups, head_dim))
    return list(rows.chunk(2))  # a gated MLP's fc1: gate, then up


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on the layers' matrices (each HF projection its own), torch.optim.AdamW on the rest;
    `param_groups` are AdamW's groups and one group of the Muon weights, whose lr and weight decay the step
    hands to torch's Muon. `tp`: the TP Axis (hybrid.parallel.groups); at TP > 1 each part is the whole matrix,
    its rows (column-parallel weights) or columns (row-parallel ones) gathered from every TP rank, stepped on
    each, and the rank's own slice written back."""

    def __init__(self, model, config, num_layers: int, adamw_groups: list, lr: float, weight_decay: float,
                 betas: tuple, eps: float, momentum: float, nesterov: bool, ns_steps: int, adjust_lr_fn, tp=None):
        names = {id(p): n for n, p in canonical_parameters(model, num_layers).items()}
        matrices = [p for g in adamw_groups for p in g["params"] if takes_muon(names.get(id(p), "")) and p.dim() == 2]
        chosen = {id(p) for p in matrices}
        adamw_groups = [dict(g, params=[p for p in g["params"] if id(p) not in chosen]) for g in adamw_groups]
        adamw_groups = [g for g in adamw_groups if g["params"]]
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
                part = torch.nn.Parameter(self._whole(self._rows(weight.detach(), rows), dim))
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

    def _whole(self, local: torch.Tensor, dim) -> torch.Tensor:
        """The whole matrix of a TP-split part (every rank's slice, in rank order); the part itself at TP 1."""
        if dim is None:
            return local.clone()
        pieces = [torch.empty_like(local) for _ in range(self.tp.size)]
        torch.distributed.all_gather(pieces, local.contiguous(), group=self.tp.group)
        return torch.cat(pieces, dim)

    def _own(self, whole: torch.Tensor, dim) -> torch.Tensor:
        """This TP rank's slice of a whole part."""
        if dim is None:
            return whole
        size = whole.shape[dim] // self.tp.size
        return whole.narrow(dim, self.tp.rank * size, size)

    def describe(self) -> str:
        """For the log: what takes which optimizer."""
        matrices = len(self.muon.param_groups[0]["params"])
        return (f"torch.optim.Muon on {matrices} matrices ({len(self.matrices)} weights, fused ones split into their "
                f"HF projections) + torch.optim.AdamW on the other {sum(len(g['params']) for g in self.adamw.param_groups)} "
                f"parameters")

    @property
    def muon_group(self) -> dict:
        return self.param_groups[-1]

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.muon.param_groups:
            group["lr"], group["weight_decay"] = self.muon_group["lr"], self.muon_group["weight_decay"]
        for weight, rows, dim, part in self.parts:
            part.copy_(self._whole(self._rows(weight, rows), dim))
            part.grad = None if weight.grad is None else self._whole(self._rows(weight.grad, rows), dim)
        self.muon.step()
        for weight, rows, dim, part in self.parts:
            own = self._own(part, dim)
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
