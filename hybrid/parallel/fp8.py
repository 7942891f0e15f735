"""FP8 matrix multiplies for the tensor-parallel layers, on torchao.float8's casts: its scales
(`amax_to_scale`), its saturated e4m3/e5m2 casts and its Float8TrainingTensor matmul (torch._scaled_mm
on GPUs with FP8 units, torchao's emulation elsewhere), in the order torchao's own
`matmul_with_hp_or_float8_args` casts (the input and weight for the forward GEMM, the output gradient
and weight for the input gradient, the output gradient and input for the weight gradient).

Written here, not taken from torchao's Float8Linear, for one reason: torchao takes each tensor's amax
where the tensor lies (or over a DTensor mesh), while a Megatron-style layer holds a TP shard of its weight
and its output gradient, and a CP / Ulysses rank a part of the tokens. Here every amax is taken over the
whole tensor (an all-reduce MAX over the groups that split the dimensions it spans), so TP, SP, CP and
Ulysses compute exactly the one-rank FP8 numbers. A fused weight (QKV; a gated MLP's [gate; up]) gets one
scale per projection in the forward GEMM, as transformers' separate q/k/v and gate/up projections get
from torchao, so the forward equals torchao on a transformers model.

Recipes (`--fp8-recipe`): `tensorwise` and `rowwise` are torchao's (its Float8LinearConfig recipes: the
same granularities, dtypes and power-of-2 rounding); `delayed` is Transformer Engine's delayed scaling
(each scale from an amax history, `--fp8-amax-history-len`, `--fp8-amax-compute-algo`, `--fp8-margin`),
written here because torchao no longer has it: the history moves once per iteration, with the
iteration's amax taken over every micro-batch and data-parallel rank (`end_iteration`), so any layout and
any number of micro-batches scale alike; the history is a buffer, saved and resumed with the model.
`--fp8-format hybrid` casts gradients to e5m2, `e4m3` everything to e4m3.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch
import torch.nn as nn

from hybrid.errors import ConfigError
from hybrid.parallel import collectives as C

RECIPES = ("tensorwise", "rowwise", "delayed")  # built
FORMATS = ("e4m3", "hybrid")
COMPUTE_ALGOS = ("most_recent", "max")
DEFAULT_FP8_RECIPE = "delayed"  # Megatron-LM's, when --fp8-format comes without --fp8-recipe
INPUT, GRAD, WEIGHT = 0, 1, 2  # columns of a delayed-scaling amax history (then one per weight projection)


@dataclasses.dataclass(frozen=True)
class Fp8Settings:
    """What --fp8-* ask for (hybrid.model.config.ModelConfig's fp8 fields)."""

    recipe: str = "tensorwise"  # --fp8-recipe
    format: str = "hybrid"  # --fp8-format: hybrid = e4m3 forward, e5m2 gradients
    history_len: int = 1  # --fp8-amax-history-len (delayed)
    compute_algo: str = "most_recent"  # --fp8-amax-compute-algo (delayed)
    margin: int = 0  # --fp8-margin (delayed): scales divided by 2^margin

    @property
    def grad_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn


def torchao_available() -> bool:
    try:
        _torchao()
    except ImportError:
        return False
    return True


_QUIET = ("torchao", "torch.utils._pytree")  # torchao's import logs its CUDA kernels' absence and an enum notice


def _torchao():
    """torchao.float8's pieces (imported when an FP8 layer runs: an optional dependency, the fp8 extra),
    its import-time log lines kept out of the run's log."""
    levels = {name: logging.getLogger(name).level for name in _QUIET}
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from torchao.float8 import config as cfg  # (see the docstring)
        from torchao.float8 import float8_training_tensor as ftt  # (see above)
        from torchao.float8 import float8_utils as fu  # (see above)
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    return cfg, ftt, fu


def recipe_config(settings: Fp8Settings):
    """torchao's Float8LinearConfig of the recipe (delayed: tensorwise casts with history scales)."""
    cfg, _, _ = _torchao()
    name = "rowwise" if settings.recipe == "rowwise" else "tensorwise"
    return cfg.Float8LinearConfig.from_recipe_name(name)


class Fp8Gemm(nn.Module):
    """One linear layer's FP8: where its operands are split (`kind` column: output features over TP;
    row: input features over TP; tokens over the sequence split either way), the projections of a fused
    weight (`segments`: each local output row's projection), and for delayed scaling its amax history."""

    def __init__(self, settings: Fp8Settings, groups, kind: str, segments: Optional[torch.Tensor] = None,
                 rowwise_only: bool = False):
        super().__init__()
        self.settings, self.kind = settings, kind
        self.tp_group = groups.tp_group if kind in ("column", "row") else C.SINGLE_RANK
        self.token_group = groups.sequence.group if kind in ("column", "row") else C.SINGLE_RANK
        self.rowwise_only = rowwise_only  # experts: per-token scales whatever the recipe (EP-invariant)
        self.num_segments = 1 if segments is None else int(segments.max()) + 1
        self.register_buffer("segments", segments, persistent=False)
        if settings.recipe == "delayed" and not rowwise_only:
            columns = 2 + self.num_segments  # input, output gradient, each projection of the weight
            self.register_buffer("amax_history", torch.zeros(settings.history_len, columns))
            self.register_buffer("amax_current", torch.zeros(columns), persistent=False)
        self._filled = None  # whether the history holds amaxes (None: not looked at since built or loaded)
        self.register_load_state_dict_post_hook(lambda module, _: module.forget_filled())

    @property
    def delayed(self) -> bool:
        return hasattr(self, "amax_history")

    @property
    def filled(self) -> bool:
        """The history holds amaxes (read from the device once after building or loading, then kept)."""
        if self._filled is None:
            self._filled = bool(self.amax_history.amax() > 0)
        return self._filled

    def forget_filled(self) -> None:
        """A loaded history is looked at again (it may hold amaxes or not)."""
        self._filled = None

    def mark_filled(self) -> None:
        """end_iteration rolled an amax into the history."""
        self._filled = True

    def groups_of(self, operand: str) -> tuple:
        """(groups splitting dim 0, groups splitting dim 1) of a 2-D operand: x [tokens, in], w_t [in, out],
        grad [tokens, out]."""
        tp, seq = [self.tp_group], [self.token_group]
        column = self.kind == "column"
        return {"x": (seq, [] if column else tp), "w_t": ([] if column else tp, tp if column else []),
                "grad": (seq, tp if column else [])}[operand]

    def delayed_scale(self, columns) -> torch.Tensor:
        """fp8 max / (amax x 2^margin) from the history; NaN where it holds no amax yet (the first
        iteration), which the cast replaces by the current tensor's scale (Transformer Engine starts from
        1 instead: a scale that does not follow the tensor, so the first iteration's FP8 values would
        depend on how many micro-batches share the batch)."""
        history = self.amax_history[:, columns]
        amax = history.amax(0) if self.settings.compute_algo == "max" else history[0]
        dtype_max = torch.finfo(torch.float8_e5m2 if columns == GRAD and self.settings.format == "hybrid"
                                else torch.float8_e4m3fn).max
        scale = dtype_max / (amax.double() * 2.0 ** self.settings.margin)
        missing = 1.0 if self.filled else float("nan")  # (a tensor that was all zeros so far: scale 1)
        return torch.where(amax > 0, scale, torch.full_like(scale, missing)).float()


def settings_of(config) -> Optional[Fp8Settings]:
    """The model's FP8 settings (hybrid.model.config.ModelConfig's fp8 fields); None without FP8."""
    if config.fp8_recipe is None:
        return None
    return Fp8Settings(config.fp8_recipe, config.fp8_format, config.fp8_amax_history_len,
                       config.fp8_amax_compute_algo, config.fp8_margin)


def gemm_for(config, groups, name: str, kind: str, segments: Optional[list] = None) -> Optional[Fp8Gemm]:
    """The Fp8Gemm of the linear layer `name` (`layers.{i}....`) when its layer runs FP8 (else None).
    `segments`: (projection, rows) runs of one TP rank's output rows, for a fused weight."""
    layer = int(name.split(".")[1])
    if not config.fp8_layer(layer):
        return None
    ids = None
    if segments is not None:
        ids = torch.cat([torch.full((rows,), index, dtype=torch.long) for index, rows in segments])
    return Fp8Gemm(settings_of(config), groups, kind, ids, rowwise_only=kind == "expert")


def has_delayed(model: nn.Module) -> bool:
    return any(isinstance(m, Fp8Gemm) and m.delayed for m in model.modules())


def keep_fp32_histories(model: nn.Module) -> None:
    """Delayed scaling's amaxes back in fp32 after an engine cast the model (DeepSpeed's bf16/fp16 engines
    cast every floating buffer): a scale from a bf16-rounded amax would not be the tensor's."""
    for m in model.modules():
        if isinstance(m, Fp8Gemm) and m.delayed:
            m.amax_history = m.amax_history.float()
            m.amax_current = m.amax_current.float()


def check_device(device: torch.device) -> None:
    """FP8 GEMMs on a GPU need FP8 units (compute capability 8.9: Ada, Hopper, Blackwell): one message
    instead of running torchao's emulation on a GPU without them."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(f"--fp8-format: this GPU (compute capability {major}.{minor}) has no FP8 units (8.9 and "
                          f"newer: L4/L40, H100/H200, B200); train with --bf16.")


def _reduce_max(amax: torch.Tensor, groups) -> torch.Tensor:
    for group in groups:
        if C.group_size(group) > 1:
            C.all_reduce(amax, group, op=torch.distributed.ReduceOp.MAX)
    return amax


def _mm_config(tensor: torch.Tensor):
    """torchao's matmul config: its emulation unless torch._scaled_mm runs here (CUDA, compute 8.9+)."""
    _, ftt, _ = _torchao()
    emulate = not (tensor.is_cuda and torch.cuda.get_device_capability(tensor.device) >= (8, 9))
    # as torchao's Float8Linear: fast accumulation in the forward GEMM only
    return ftt.LinearMMConfig(ftt.ScaledMMConfig(emulate, True, False, False),
                              ftt.ScaledMMConfig(emulate, False, False, False),
                              ftt.ScaledMMConfig(emulate, False, False, False))


def _cast(t: torch.Tensor, dtype, role, axiswise_dim: Optional[int], groups: tuple, round_pow2: bool,
          scale: Optional[torch.Tensor] = None, record=None, complete: bool = True):
    """`t` (2-D) as a Float8TrainingTensor: tensorwise (`axiswise_dim` None) or per row / column, the amax
    over the ranks in `groups` that split the dimensions it spans; or with a given `scale` (NaN where the
    tensor's own is taken, unless `complete` says it has none). `record`: receives the global amax (delayed
    scaling's history)."""
    _, ftt, fu = _torchao()
    if scale is None or record is not None or not complete:
        with torch.no_grad():
            if axiswise_dim is None:
                amax = _reduce_max(t.abs().amax().float(), groups[0] + groups[1])
            else:
                amax = _reduce_max(t.abs().amax(dim=axiswise_dim, keepdim=True).float(), groups[axiswise_dim])
        if record is not None:
            record(amax)
        current = fu.amax_to_scale(amax, dtype, round_scales_to_power_of_2=round_pow2)
        scale = current if scale is None else torch.where(torch.isnan(scale), current, scale)
    return ftt.hp_tensor_and_scale_to_float8(t, scale, dtype, _mm_config(t), role, axiswise_dim)


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T (+ b) with the three GEMMs in FP8 (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, gemm: Fp8Gemm, training: bool):
        ctx.save_for_backward(x, weight)
        ctx.gemm, ctx.has_bias = gemm, bias is not None
        x2 = x.reshape(-1, x.size(-1))
        out = _forward_gemm(x2, weight, gemm, training).reshape(*x.shape[:-1], weight.size(0))
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gemm = ctx.gemm
        x2, g2 = x.reshape(-1, x.size(-1)), grad.reshape(-1, grad.size(-1)).contiguous()
        grad_x, grad_w = _backward_gemms(x2, weight, g2, gemm)
        grad_bias = g2.sum(0) if ctx.has_bias else None
        return grad_x.reshape(x.shape), grad_w, grad_bias, None, None


def _roles():
    _, ftt, _ = _torchao()
    return ftt.GemmInputRole


def _forward_gemm(x2: torch.Tensor, weight: torch.Tensor, gemm: Fp8Gemm, training: bool) -> torch.Tensor:
    s, roles = gemm.settings, _roles()
    rowwise = s.recipe == "rowwise" or gemm.rowwise_only
    pow2 = rowwise  # torchao's rowwise recipe rounds scales down to powers of 2
    w_t = weight.t()
    e4m3 = torch.float8_e4m3fn
    if rowwise:
        x8 = _cast(x2, e4m3, roles.INPUT, -1, gemm.groups_of("x"), pow2)
        w8 = _cast(w_t, e4m3, roles.WEIGHT, 0, gemm.groups_of("w_t"), pow2)
        return torch.mm(x8, w8)
    x_scale = w_scale = None
    x_record = w_record = None
    if gemm.delayed:
        x_scale, w_scale = gemm.delayed_scale(INPUT), gemm.delayed_scale(slice(WEIGHT, None))
        if training:  # this step's amaxes (not an evaluation's, not a recomputed layer's first pass)
            x_record = _recorder(gemm, INPUT)
            w_record = _recorder(gemm, slice(WEIGHT, None))
    if gemm.num_segments == 1 and not gemm.delayed:
        x8 = _cast(x2, e4m3, roles.INPUT, None, gemm.groups_of("x"), False)
        w8 = _cast(w_t, e4m3, roles.WEIGHT, None, gemm.groups_of("w_t"), False)
        return torch.mm(x8, w8)
    # one scale per projection of a fused weight (and delayed scales): a scale per output column, the
    # input's one scale per row (the row-scaled GEMM's form)
    x8 = _cast(x2, e4m3, roles.INPUT, None, gemm.groups_of("x"), False, x_scale, x_record,
               complete=not gemm.delayed or gemm.filled)  # (the first iteration: the input's own scale)
    x8 = _as_rowwise(x8, x2)
    segments = gemm.segments if gemm.segments is not None else torch.zeros(w_t.size(1), dtype=torch.long,
                                                                            device=w_t.device)
    with torch.no_grad():
        column_amax = w_t.abs().amax(dim=0).float()
        amax = torch.zeros(gemm.num_segments, device=w_t.device).scatter_reduce(0, segments, column_amax, "amax")
        amax = _reduce_max(amax, [gemm.tp_group])  # column: the output features, row: the input features
        if w_record is not None:
            w_record(amax)
        _, _, fu = _torchao()
        current = fu.amax_to_scale(amax, e4m3)
        per_segment = current if w_scale is None else torch.where(torch.isnan(w_scale), current, w_scale)
        scale = per_segment[segments].view(1, -1)
    w8 = _torchao()[1].hp_tensor_and_scale_to_float8(w_t, scale, e4m3, _mm_config(w_t), roles.WEIGHT, 0)
    return torch.mm(x8, w8)


def _as_rowwise(x8, x2):
    """A tensorwise-scaled operand re-labelled with its scale per row (the same value on every row)."""
    _, ftt, _ = _torchao()
    scale = x8._scale.reshape(1, 1).expand(x2.size(0), 1).contiguous()
    return ftt.Float8TrainingTensor(x8._data, scale, x8._orig_dtype, x8._linear_mm_config, x8._gemm_input_role,
                                    axiswise_dim=-1)


def _recorder(gemm: Fp8Gemm, columns):
    def record(amax: torch.Tensor) -> None:
        current = gemm.amax_current[columns]
        gemm.amax_current[columns] = torch.maximum(current, amax.reshape(current.shape).float())
    return record


def _backward_gemms(x2, weight, g2, gemm: Fp8Gemm):
    s, roles = gemm.settings, _roles()
    rowwise = s.recipe == "rowwise" or gemm.rowwise_only
    pow2 = rowwise
    e4m3, grad_dtype = torch.float8_e4m3fn, (torch.float8_e4m3fn if rowwise else s.grad_dtype)
    w_t = weight.t()
    if rowwise:  # torchao's rowwise recipe: every cast per row or column, e4m3
        g8 = _cast(g2, grad_dtype, roles.GRAD_OUTPUT, -1, gemm.groups_of("grad"), pow2)
        w8 = _cast(w_t, e4m3, roles.WEIGHT, -1, gemm.groups_of("w_t"), pow2)
        grad_x = torch.mm(g8, w8.t())
        g8w = _cast(g2, grad_dtype, roles.GRAD_OUTPUT, 0, gemm.groups_of("grad"), pow2)
        x8w = _cast(x2, e4m3, roles.INPUT, 0, gemm.groups_of("x"), pow2)
        return grad_x, torch.mm(g8w.t(), x8w)
    g_scale = x_scale = w_scale = None
    g_record = None
    if gemm.delayed:
        g_scale, x_scale = gemm.delayed_scale(GRAD), gemm.delayed_scale(INPUT)
        # the whole fused weight's largest amax; the first iteration's casts take their tensors' own
        w_scale = gemm.delayed_scale(slice(WEIGHT, None)).min() if gemm.filled else None
        if not gemm.filled:
            x_scale = None
        g_record = _recorder(gemm, GRAD)
    g8 = _cast(g2, grad_dtype, roles.GRAD_OUTPUT, None, gemm.groups_of("grad"), False, g_scale, g_record)
    w8 = _cast(w_t, e4m3, roles.WEIGHT, None, gemm.groups_of("w_t"), False, w_scale)
    grad_x = torch.mm(g8, w8.t())
    x8 = _cast(x2, e4m3, roles.INPUT, None, gemm.groups_of("x"), False, x_scale)
    return grad_x, torch.mm(g8.t(), x8)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], gemm: Fp8Gemm) -> torch.Tensor:
    """x [..., in] -> [..., out] through `weight` [out, in] with FP8 GEMMs (the input already gathered for
    a column-parallel layer; a row-parallel layer's output is this rank's partial sum)."""
    training = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return _Fp8Linear.apply(x, weight, bias, gemm, training)


def end_iteration(model: nn.Module, data_group, stepped: bool = True) -> None:
    """Delayed scaling: the iteration's amaxes (every micro-batch's, every data-parallel rank's: one
    all-reduce MAX over `data_group`) enter each layer's history; the next iteration's scales follow.

    As Transformer Engine does, a spike does not poison the scales: a tensor whose amax is not finite keeps its
    history as it was (so its scale stays the previous one; entered, it would make every later scale 0 and
    every gradient NaN), decided on the device, no host sync. An iteration whose optimizer step was skipped
    (`stepped` False: fp16 overflow, a non-finite gradient norm) leaves every history as it was: the weights
    did not move, and the amaxes were those of a step that did not count."""
    gemms = [m for m in model.modules() if isinstance(m, Fp8Gemm) and m.delayed]
    if not gemms:
        return
    if not stepped:
        for m in gemms:
            m.amax_current.zero_()
        return
    current = torch.cat([m.amax_current for m in gemms])
    _reduce_max(current, [data_group])
    for m, amax in zip(gemms, current.split([m.amax_current.numel() for m in gemms])):
        rolled = torch.cat([amax.view(1, -1), m.amax_history[:-1]])
        m.amax_history.copy_(torch.where(torch.isfinite(amax).view(1, -1), rolled, m.amax_history))
        m.amax_current.zero_()
        m.mark_filled()


def check_settings(recipe: Optional[str], fmt: Optional[str], history_len: int, compute_algo: str) -> None:
    """Flag values (one message each); the recipes not built are the capability table's."""
    if recipe is not None and fmt is None:
        raise ConfigError(f"--fp8-recipe {recipe} without --fp8-format: FP8 is turned on by --fp8-format (e4m3, or "
                          f"hybrid: e5m2 gradients); add it, or drop --fp8-recipe to train in the high precision.")
    if fmt is not None and fmt not in FORMATS:
        raise ConfigError(f"--fp8-format must be one of {', '.join(FORMATS)}, got {fmt!r}.")
    if compute_algo not in COMPUTE_ALGOS:
        raise ConfigError(f"--fp8-amax-compute-algo must be one of {', '.join(COMPUTE_ALGOS)}, got {compute_algo!r}.")
    if history_len < 1:
        raise ConfigError(f"--fp8-amax-history-len must be at least 1, got {history_len}.")
    if fmt is not None and not torchao_available():
        raise ConfigError("--fp8-format: FP8 training uses torchao's float8 casts; install it (pip install "
                          "'hybrid-engine[fp8]', or pip install torchao).")
