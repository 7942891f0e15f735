"""Pipeline bubble and activation memory of each schedule, measured against theory; JSON lines and a PNG.

    python benchmarks/pipeline_bubble.py [--pp 2 4] [--micro-batches 4 8 16] [--layer-ms 4]
                                         [--png benchmarks/results/pipeline_bubble.png]

For PP in {2, 4} and micro-batches in {4, 8, 16}, one training step of every schedule runs on PP CPU
ranks (gloo): DeepSpeed's 1F1B engine (`1f1b`, the default) and torch.distributed.pipelining's
1F1B, interleaved 1F1B (v = 2), interleaved zero-bubble (v = 2), ZB-V and DualPipeV. Compute is made
uniform and independent of the machine's cores: each layer's forward, input-gradient and
weight-gradient steps each *sleep* --layer-ms (F = B = W, the zero-bubble papers' assumption), so 4
ranks on a 2-core machine measure the schedule, not CPU contention. Per rank, busy time is the sum of
those steps; idle = 1 - busy / step time. Each layer keeps one activation token from its forward
until its weight gradient is computed (what dW = x^T dy needs); the live tokens' peak is the rank's
peak activation memory, in units of one micro-batch through all of the rank's layers.

Each record carries:
- `idle_fraction` (mean over ranks) beside `theory_idle`: the closed form where there is one,
  (p-1)/(m+p-1) for 1F1B, (p-1)/(v m+p-1) interleaved, 0 for the zero-bubble family, and
  `planned_idle`, the idle fraction of the schedule's own action order run on an ideal machine
  (F = B = W, no communication time): what the schedule can reach when m is too small to fill it;
- `peak_activations` (max over ranks) beside `theory_activations` (1F1B p; interleaved p + (p-1)/v,
  Narayanan et al. 2021; ZB-V p, Qi et al. 2024; DualPipeV (2p + 1) / 2, DeepSeek-V3's "PP + 1"
  chunks of half a rank's layers) and
  `planned_activations`, the peak of the schedule's own action order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SCHEDULES = ("1f1b", "torch-1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
VIRTUAL = {"1f1b": 1, "torch-1f1b": 1, "interleaved-1f1b": 2, "zero-bubble": 2, "zbv": 2, "dualpipev": 2}
LAYERS_PER_RANK = 4
HIDDEN = 8


class Meter:
    """This rank's busy seconds and live activation tokens (module state: one per process)."""

    busy = 0.0
    live = 0
    peak = 0

    @classmethod
    def reset(cls):
        cls.busy, cls.live, cls.peak = 0.0, 0, 0


def _work(seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    Meter.busy += time.perf_counter() - start


def _released() -> None:
    Meter.live -= 1


def _activation() -> torch.Tensor:
    token = torch.empty(1)
    Meter.live += 1
    Meter.peak = max(Meter.peak, Meter.live)
    weakref.finalize(token, _released)
    return token


class _InputGradWork(torch.autograd.Function):
    """Identity whose backward (the input gradient) takes B seconds."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _work(ctx.seconds)
        return grad, None


class _WeightGradWork(torch.autograd.Function):
    """Zeros that depend on the weight only; its backward (the weight gradient) takes W seconds and
    holds the layer's activation token until then."""

    @staticmethod
    def forward(ctx, weight, like, seconds):
        ctx.seconds = seconds
        ctx.save_for_backward(_activation())
        return torch.zeros_like(like)

    @staticmethod
    def backward(ctx, grad):
        _work(ctx.seconds)
        return torch.zeros(1), None, None


class EqualWorkLayer(nn.Module):
    """F, B and W of `seconds` each; its input-gradient and weight-gradient paths are separate autograd
    nodes, so zero-bubble schedules can run them at different times."""

    def __init__(self, seconds: float, leaf: bool = False):
        super().__init__()
        self.seconds, self.leaf = seconds, leaf
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        if self.leaf and not x.requires_grad:  # the first layer's input gradient is computed too
            x = x.detach().requires_grad_()
        _work(self.seconds)
        return _InputGradWork.apply(x, self.seconds) + _WeightGradWork.apply(self.weight, x.detach(), self.seconds)


# --- theory ----------------------------------------------------------------------------------

def theory_idle(schedule: str, p: int, m: int, v: int):
    if schedule in ("1f1b", "torch-1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    return 0.0


def theory_activations(schedule: str, p: int, m: int, v: int):
    """Peak over ranks, in micro-batches of a whole rank's layers."""
    if schedule in ("1f1b", "torch-1f1b"):
        return float(min(p, m))
    if schedule == "interleaved-1f1b":
        return min(p + (p - 1) / v, float(m))
    if schedule == "zbv":
        return float(min(p, m))
    if schedule == "dualpipev":
        # DeepSeek-V3's table: PP + 1 chunks in flight; a DualPipeV chunk is half a rank's layers
        return min((2 * p + 1) / 2, float(m))
    return None  # torch's interleaved zero-bubble: no closed form published for its memory


def one_f_one_b_order(p: int, m: int) -> dict:
    """Plain 1F1B per rank: p - 1 - r warm-up forwards, then one forward one backward, then drain."""
    order = {}
    for r in range(p):
        warmup = min(p - 1 - r, m)
        actions = [(r, "F", i) for i in range(warmup)]
        f, b = warmup, 0
        while b < m:
            if f < m:
                actions.append((r, "F", f))
                f += 1
            actions.append((r, "B", b))
            b += 1
        order[r] = actions
    return order


def torch_order(schedule) -> dict:
    """A torch schedule's compute actions per rank as (stage, kind, micro-batch), overlaps unrolled."""
    order = {}
    for rank, actions in schedule.pipeline_order.items():
        flat = []
        for action in actions:
            if action is None:
                continue
            for sub in (action.sub_actions or (action,)):
                kind = sub.computation_type.value
                if kind in ("F", "B", "I", "W"):
                    flat.append((sub.stage_index, kind, sub.microbatch_index))
        order[rank] = flat
    return order


def simulate(order: dict, num_stages: int, chunk_cost: float, layers_per_chunk: int) -> tuple[float, float]:
    """(idle fraction averaged over ranks, peak activations over ranks in micro-batches of a rank's
    layers) of an action order on an ideal machine: F, I, W cost chunk_cost each, B costs 2 x,
    communication is free, each rank runs its actions in order once their inputs exist."""
    cost = {"F": chunk_cost, "I": chunk_cost, "W": chunk_cost, "B": 2 * chunk_cost}
    done: dict = {}
    position = {r: 0 for r in order}
    free = {r: 0.0 for r in order}
    live = {r: 0 for r in order}
    peak = 0
    while any(position[r] < len(order[r]) for r in order):
        progressed = False
        for r in order:
            while position[r] < len(order[r]):
                stage, kind, mb = order[r][position[r]]
                needs = []
                if kind == "F" and stage > 0:
                    needs.append((stage - 1, "F", mb))
                if kind in ("B", "I"):
                    needs.append((stage, "F", mb))
                    if stage < num_stages - 1:
                        needs.append((stage + 1, "BI", mb))
                if kind == "W":
                    needs.append((stage, "BI", mb))
                if any(n not in done for n in needs):
                    break
                start = max([free[r]] + [done[n] for n in needs])
                free[r] = start + cost[kind]
                done[(stage, "BI" if kind in ("B", "I") else kind, mb)] = free[r]
                live[r] += layers_per_chunk if kind == "F" else -layers_per_chunk if kind in ("B", "W") else 0
                peak = max(peak, live[r])
                position[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the action order deadlocks")
    total = max(free.values())
    busy = {r: sum(cost[k] for _, k, _ in order[r]) for r in order}
    idle = sum(1 - busy[r] / total for r in order) / len(order)
    return idle, peak / LAYERS_PER_RANK


# --- one rank ----------------------------------------------------------------------------------

def _torch_schedule(name: str, p: int, m: int, seconds: float, micro: int):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as S
    from hybrid.pipeline_plan import plan_stages
    rank = dist.get_rank()
    v = VIRTUAL[name]
    layers_per_chunk = LAYERS_PER_RANK // v
    kind = {"torch-1f1b": "interleaved-1f1b", "zbv": "zbv", "dualpipev": "dualpipev"}.get(name, name)
    plans = [plan for plan in plan_stages(p * LAYERS_PER_RANK, p, v, kind) if plan.rank == rank]
    stages = []
    for plan in plans:
        module = nn.Sequential(*[EqualWorkLayer(seconds, leaf=(plan.first and i == 0))
                                 for i in range(layers_per_chunk)])
        meta = torch.empty(micro, HIDDEN, device="meta", requires_grad=True)
        stages.append(PipelineStage(module, plan.index, p * v, torch.device("cpu"), input_args=meta,
                                    output_args=meta))
    cls = {"torch-1f1b": S.Schedule1F1B, "interleaved-1f1b": S.ScheduleInterleaved1F1B,
           "zero-bubble": S.ScheduleInterleavedZeroBubble, "zbv": S.ScheduleZBVZeroBubble,
           "dualpipev": S.ScheduleDualPipeV}[name]
    loss = lambda out, target: out.mean()  # noqa: E731
    schedule = cls(stages[0] if name == "torch-1f1b" else stages, n_microbatches=m, loss_fn=loss)
    has_first = any(plan.first for plan in plans)
    has_last = any(plan.last for plan in plans)

    def step():
        x = torch.zeros(m * micro, HIDDEN)
        args = (x,) if has_first else ()
        kwargs = {"target": torch.zeros(m * micro, HIDDEN), "losses": []} if has_last else {}
        schedule.step(*args, **kwargs)

    order = one_f_one_b_order(p, m) if name == "torch-1f1b" else torch_order(schedule)
    return step, order


def _deepspeed_schedule(p: int, m: int, seconds: float, micro: int):
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    layers = [LayerSpec(EqualWorkLayer, seconds, i == 0) for i in range(p * LAYERS_PER_RANK)]
    module = PipelineModule(layers=layers, loss_fn=lambda out, target: out.mean(), num_stages=p,
                            partition_method="uniform")
    engine, *_ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.0),
                                      config={"train_micro_batch_size_per_gpu": micro,
                                              "gradient_accumulation_steps": m, "steps_per_print": 10**9,
                                              "zero_optimization": {"stage": 0}})

    def step():
        batches = iter([(torch.zeros(micro, HIDDEN), torch.zeros(micro, HIDDEN))] * m)
        engine.train_batch(data_iter=batches)

    return step, one_f_one_b_order(p, m)


def _measure(name: str, p: int, m: int, args) -> dict:
    seconds = args.layer_ms / 1000.0
    v = VIRTUAL[name]
    if name == "1f1b":
        step, order = _deepspeed_schedule(p, m, seconds, args.micro_batch)
    else:
        try:
            step, order = _torch_schedule(name, p, m, seconds, args.micro_batch)
        except ValueError as refused:  # e.g. DualPipeV needs at least as many micro-batches as stages
            return {"benchmark": "pipeline_bubble", "schedule": name, "pp": p, "micro_batches": m,
                    "virtual_stages": v, "skipped": str(refused)}
    step()  # warm-up (first-step set-up)
    idle, peaks = [], []
    for _ in range(args.steps):
        dist.barrier()
        Meter.reset()
        start = time.perf_counter()
        step()
        dist.barrier()
        wall = time.perf_counter() - start
        idle.append(1.0 - Meter.busy / wall)
        peaks.append(Meter.peak / LAYERS_PER_RANK)
    mine = {"idle": sum(idle) / len(idle), "peak": max(peaks), "busy_s": Meter.busy}
    everyone = [None] * p
    dist.all_gather_object(everyone, mine)
    chunk_cost = seconds * LAYERS_PER_RANK / v
    planned_idle, planned_peak = simulate(order, p * v, chunk_cost, LAYERS_PER_RANK // v)
    expected_busy = m * LAYERS_PER_RANK * 3 * seconds
    return {"benchmark": "pipeline_bubble", "schedule": name, "pp": p, "micro_batches": m, "virtual_stages": v,
            "idle_fraction": round(sum(e["idle"] for e in everyone) / p, 4),
            "idle_fraction_per_rank": [round(e["idle"], 4) for e in everyone],
            "theory_idle": round(theory_idle(name, p, m, v), 4), "planned_idle": round(planned_idle, 4),
            "peak_activations": max(e["peak"] for e in everyone),
            "peak_activations_per_rank": [e["peak"] for e in everyone],
            "theory_activations": theory_activations(name, p, m, v), "planned_activations": planned_peak,
            "busy_over_expected": round(max(e["busy_s"] for e in everyone) / expected_busy, 3),
            "layer_ms": args.layer_ms}


def _rank(rank: int, p: int, port: int, args, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(p),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=p)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's comm over the group just made
    import logging
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    records = []
    for name in args.schedules:
        for m in args.micro_batches:
            if m < p and name != "1f1b":
                continue  # torch's multi-stage schedules need at least PP micro-batches
            records.append(_measure(name, p, m, args))
            if rank == 0:
                print(json.dumps(records[-1]), flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            f.write("\n".join(json.dumps(r) for r in records))
    dist.barrier()
    dist.destroy_process_group()


def chart(records: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pps = sorted({r["pp"] for r in records})
    fig, axes = plt.subplots(1, len(pps), figsize=(6 * len(pps), 4.5), squeeze=False)
    for ax, p in zip(axes[0], pps):
        for name in SCHEDULES:
            rows = sorted((r for r in records if r["pp"] == p and r["schedule"] == name and "skipped" not in r),
                          key=lambda r: r["micro_batches"])
            if not rows:
                continue
            xs = [r["micro_batches"] for r in rows]
            line, = ax.plot(xs, [r["idle_fraction"] for r in rows], marker="o", label=f"{name} measured")
            ax.plot(xs, [r["theory_idle"] for r in rows], linestyle="--", color=line.get_color(), alpha=0.6)
            if any(r["planned_idle"] != r["theory_idle"] for r in rows):
                ax.plot(xs, [r["planned_idle"] for r in rows], linestyle=":", color=line.get_color(), alpha=0.8)
        ax.set_title(f"PP = {p} (dashed: closed form; dotted: the schedule's own plan)")
        ax.set_xlabel("micro-batches per step")
        ax.set_ylabel("idle (bubble) fraction")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--layer-ms", type=float, default=10.0, help="F = B = W time of one layer")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per configuration (after one warm-up)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--png", default=None, help="write the bubble-vs-micro-batches chart here")
    parser.add_argument("--json-out", default=None, help="also write every record here (JSON lines)")
    parser.add_argument("--from-json", default=None, help="draw --png from records written by --json-out")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            chart([json.loads(line) for line in f if line.strip()], args.png)
        return 0
    from hybrid.distributed import free_port
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in args.pp:
            out = os.path.join(tmp, f"pp{p}.jsonl")
            mp.start_processes(_rank, args=(p, free_port(), args, out), nprocs=p, start_method="spawn")
            with open(out) as f:
                records += [json.loads(line) for line in f if line.strip()]
    measured = [r for r in records if "skipped" not in r]
    worst = max(abs(r["idle_fraction"] - r["theory_idle"]) for r in measured)
    print(json.dumps({"benchmark": "pipeline_bubble_summary", "configurations": len(records),
                      "max_abs_idle_minus_theory": round(worst, 4),
                      "max_abs_idle_minus_planned": round(max(abs(r["idle_fraction"] - r["planned_idle"])
                                                              for r in measured), 4)}))
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write("\n".join(json.dumps(r) for r in records) + "\n")
    if args.png:
        chart(records, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
