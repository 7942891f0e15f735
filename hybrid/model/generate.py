"""Generation with the model's own layers, at the layout it trains at (TP, SP, PP, EP), from the weights it holds:
a prefill of the left-padded prompts, then one token per step through a key/value cache (hybrid.model.kv_cache).

Every rank of the job calls `generate` with the same prompts of its data-parallel group. Each step runs the
virtual stages in order (stage to stage by point-to-point sends over the pipeline group); the last stage's
logits of the newest position are gathered over TP (fp32, the vocabulary's padding dropped) and the token is
chosen as transformers' `generate` chooses it: greedy at temperature 0, else its temperature, top-k and top-p
warpers (transformers' own) and a draw from the softmax. The chosen tokens reach every pipeline rank by a
broadcast from the last stage. Sequence parallelism is off while decoding (a step's one new position cannot be
split over TP ranks; the all-reduces it replaces compute the same sums).

Sampling is reproducible at any layout and batch composition: row r draws from its own generator, seeded from
(`seed`, `keys[r]`), the caller's global index of the row (prompt and completion number).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hybrid.model.kv_cache import DecodeLayout, KVCache
from hybrid.parallel import collectives as C


@dataclass(frozen=True)
class SamplingOptions:
    """transformers' generation settings: temperature 0 is greedy; top_k 0 and top_p 1.0 keep every token."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    eos: tuple = ()  # token ids that end a row (kept as its last token); none: rows run to max_new_tokens
    pad: int = 0  # the id left padding carries (never attended)
    top_logprobs: int = 0  # also keep each step's n most likely tokens and their log-probabilities (Generated.top)


@dataclass
class Generated:
    """Per row: the completion's token ids (an EOS included) and each token's log-probability under the
    distribution it was drawn from before top-k/top-p (log_softmax(logits / temperature); greedy: of the logits)."""

    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    # record_routes: the experts each position's token was routed to in each of this rank's MoE layers, [b, width +
    # max_new_tokens, layers, k] (int16) over the generation's slots (prompts left-padded to `width`), -1 where none
    routes: Optional[torch.Tensor] = None
    # top_logprobs n > 0: per row, per completion token, the n most likely [(id, log-probability)] of the distribution
    # its log-probability is taken from (OpenAI's top_logprobs; launch/serve.py)
    top: Optional[list] = None


@contextlib.contextmanager
def decoding(model):
    """The model in decoding form for the block: eval mode, inference mode, no sequence parallelism, and FP8's
    input amaxes each rank's own (hybrid.parallel.fp8.Fp8Gemm.token_group: a decoding step's tokens are never split
    over a sequence split's ranks, which decode rows of their own under --grpo)."""
    switched = [(m, name) for m in model.modules() for name in ("sequence_parallel", "reduce_scatter_embeddings")
                if getattr(m, name, False) is True]
    token_groups = [(m, m.token_group) for m in model.modules() if hasattr(m, "token_group")]
    config, was_sp, was_training = model.config, model.config.sequence_parallel, model.training
    for m, name in switched:
        setattr(m, name, False)
    for m, _ in token_groups:
        m.token_group = C.SINGLE_RANK
    config.sequence_parallel = False
    model.eval()
    # inference mode where nothing made here outlives it (tokens leave as host lists); ZeRO-3's hooks gather and
    # re-partition parameters inside the block, which must stay ordinary tensors for training: no_grad there (not
    # where they were gathered before it, hybrid.training.deepspeed_fixes.zero3_gathered_while_generating)
    partitioned = any(hasattr(p, "ds_id") and p.ds_status.name != "AVAILABLE" for p in model.parameters())
    try:
        with torch.no_grad() if partitioned else torch.inference_mode():
            yield
    finally:
        for m, name in switched:
            setattr(m, name, True)
        for m, group in token_groups:
            m.token_group = group
        config.sequence_parallel = was_sp
        model.train(was_training)


def row_generators(keys: Sequence[int], seed: int, device) -> list:
    """One torch.Generator per row, seeded from (seed, the row's global key)."""
    gens = []
    for key in keys:
        g = torch.Generator(device=device)
        g.manual_seed((int(seed) * 1_000_003 + int(key) * 7_919 + 12_345) % (2 ** 63))
        gens.append(g)
    return gens


def choose(logits: torch.Tensor, options: SamplingOptions, generators) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [b, V] fp32 -> (tokens [b], their log-probabilities [b]) as transformers' generate chooses."""
    if options.temperature <= 0:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    scores = TemperatureLogitsWarper(options.temperature)(None, logits)
    logprobs = torch.log_softmax(scores, dim=-1)
    if options.top_k > 0:
        scores = TopKLogitsWarper(options.top_k)(None, scores)
    if options.top_p < 1.0:
        scores = TopPLogitsWarper(options.top_p)(None, scores)
    probs = torch.softmax(scores, dim=-1)
    tokens = torch.cat([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(generators)])
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


class _Pipeline:
    """The virtual stages in order over the pipeline group: who runs each, and the sends between them."""

    def __init__(self, model, groups, dtype):
        self.model, self.groups, self.dtype = model, groups, dtype
        self.plans = sorted(model.all_plans, key=lambda p: p.index)
        self.mine = {stage.plan.index: k for k, stage in enumerate(model.stages)}  # global index -> local
        self.last_rank = self.plans[-1].rank

    def logits(self, ids: torch.Tensor, layout: DecodeLayout, hidden_size: int) -> Optional[torch.Tensor]:
        """Run every stage over the new ids [b, s]; the full-vocabulary fp32 logits [b, V] on the last stage's
        ranks, None elsewhere."""
        pp, me = self.groups.pp, self.groups.pp.rank
        out = ids
        for k, plan in enumerate(self.plans):
            if plan.rank == me:
                out = self.model(out, stage=self.mine[plan.index], decode=layout)  # RankModel.forward
            if plan.last:
                break
            following = self.plans[k + 1].rank
            if following == plan.rank:
                continue
            if me == plan.rank:
                dist.send(out.contiguous(), group=pp.group, group_dst=following)
            elif me == following:
                out = torch.empty(ids.size(1), ids.size(0), hidden_size, dtype=self.dtype, device=ids.device)
                dist.recv(out, group=pp.group, group_src=plan.rank)
        if me != self.last_rank:
            return None
        full = C.all_gather_along_dim(out[-1], -1, self.groups.tp.group)  # [b, V_padded]
        return full[:, :self.model.config.vocab_size].float()

    def share(self, tensor: torch.Tensor) -> torch.Tensor:
        """The last stage's tensor on every pipeline rank."""
        if self.groups.pp.size > 1:
            dist.broadcast(tensor, group=self.groups.pp.group, group_src=self.last_rank)
        return tensor


def generate(model, groups, prompts: list, options: SamplingOptions, keys: Optional[Sequence[int]] = None,
             device=None, stop: Optional[Callable[[int, list], bool]] = None, sync=None,
             record_routes: bool = False, on_step: Optional[Callable[[list], None]] = None,
             compact: bool = True) -> Generated:
    """Complete every prompt (token id lists) with `model` (a RankModel at this rank's layout). `keys`: each
    row's global index for its sampling generator (default 0 ..); `stop(row, tokens)`: a host-side check after
    each step (stop strings) that ends a row early; `sync`: an Axis whose ranks must run every step together
    (expert parallelism: their experts meet in each step), so decoding ends when all of theirs have ended;
    `record_routes`: keep the MoE layers' routing of every token (Generated.routes; --grpo's routing replay);
    `on_step(tokens)`: each step's chosen ids (a host list, one per row; a streaming server's deltas; a row that
    has left the batch gets the padding id).

    Rows with the same prompt (a --grpo group's G completions) are prefilled once: the prompt's step runs over
    the distinct prompts and its cache and logits are copied to their rows. Rows that have ended leave the batch
    once they are a quarter of it (their cache rows dropped), so the longest row does not keep every slot busy.
    `compact` False: neither (every row prefilled, every row kept to the end; bench_generate's baseline)."""
    groups = model.groups if groups is None else groups
    device = device or next(model.parameters()).device
    b, width = len(prompts), max(len(p) for p in prompts)
    slots = width + options.max_new_tokens
    firsts: dict = {}
    index = [firsts.setdefault(tuple(p) if compact else r, len(firsts)) for r, p in enumerate(prompts)]
    distinct = [list(p) for p in firsts] if compact else [list(p) for p in prompts]  # row -> its distinct prompt
    u = len(distinct)
    valid = torch.zeros(u, slots, dtype=torch.bool, device=device)
    ids = torch.full((u, width), options.pad, dtype=torch.long, device=device)
    for r, prompt in enumerate(distinct):
        ids[r, width - len(prompt):] = torch.as_tensor(prompt, dtype=torch.long, device=device)
        valid[r, width - len(prompt):] = True
    valid[:, width:] = True
    positions = (valid[:, :width].long().cumsum(1) - 1).clamp(min=0)  # [u, width]
    expand = torch.as_tensor(index, device=device)
    next_position = valid[:, :width].sum(1)[expand]  # [b]: each row's first completion position
    cache = KVCache(u, slots, valid)
    dtype = next(model.parameters()).dtype
    pipe = _Pipeline(model, groups, dtype)
    gens = row_generators(keys if keys is not None else range(b), options.seed, device) \
        if options.temperature > 0 else None
    eos = torch.as_tensor(list(options.eos) or [-1], device=device)
    out_tokens = torch.zeros(b, options.max_new_tokens, dtype=torch.long, device=device)
    out_logps = torch.zeros(b, options.max_new_tokens, dtype=torch.float32, device=device)
    n_top = min(options.top_logprobs, model.config.vocab_size)
    out_top = torch.zeros(b, options.max_new_tokens, 2, n_top, dtype=torch.float64, device=device) if n_top else None
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    lengths = torch.full((b,), options.max_new_tokens, dtype=torch.long, device=device)
    routes = out_routes = None
    if record_routes and getattr(model, "moe_slots", 0):
        routes = torch.full((u, slots, model.moe_slots, model.config.moe_router_topk), -1,
                            dtype=torch.int16 if model.config.num_experts < 2 ** 15 else torch.int32, device=device)
    rows = torch.arange(b, device=device)  # the batch's rows (they leave it as they end)
    start_time, steps, prefill_s, cache_bytes = time.perf_counter(), 0, 0.0, 0
    with decoding(model):
        layout, start, new = DecodeLayout(positions=positions.t(), cache=cache, start=0, routes=routes), 0, ids
        for step in range(options.max_new_tokens):
            logits = pipe.logits(new, layout, model.config.hidden_size)
            if step == 0:  # the distinct prompts' step, copied to their rows
                if u < b:
                    logits = None if logits is None else logits[expand]
                    cache.select(expand)
                    routes = None if routes is None else routes[expand]
                cache_bytes, out_routes = cache.bytes(), routes  # (the cache's largest)
            chosen = torch.zeros(2 + 2 * n_top, rows.numel(), dtype=torch.float64, device=device)
            if logits is not None:
                tokens, logps = choose(logits, options, gens)
                parts = [tokens.double()[None], logps.double()[None]]
                if n_top:  # the same distribution the chosen token's log-probability is read from
                    top = torch.log_softmax(logits / options.temperature if options.temperature > 0 else logits,
                                            dim=-1).topk(n_top, dim=-1)
                    parts += [top.indices.double().t(), top.values.double().t()]
                chosen = torch.cat(parts)
            chosen = pipe.share(chosen)
            tokens, logps = chosen[0].long(), chosen[1].float()
            out_tokens[rows, step], out_logps[rows, step] = tokens, logps
            if n_top:
                out_top[rows, step] = chosen[2:].reshape(2, n_top, -1).permute(2, 0, 1)
            if on_step is not None:
                full = torch.full((b,), options.pad, dtype=torch.long, device=device)
                on_step(full.index_copy_(0, rows, tokens).tolist())
            ends = (~finished[rows]) & torch.isin(tokens, eos)
            lengths[rows] = torch.where(ends, step + 1, lengths[rows])
            finished[rows] |= ends
            steps = step + 1
            if step == 0:
                prefill_s = time.perf_counter() - start_time
            if stop is not None:
                finished |= _stopped(stop, out_tokens[:, :step + 1], finished, lengths, step)
            done, gone = _step_state(finished, rows, sync)  # one host read per step, as transformers' own loop
            if done:
                break
            start += new.size(1)
            new = tokens[:, None]
            if compact and step + 1 < options.max_new_tokens:
                rows, new, gens, routes = _leave(rows, finished, gone, new, gens, cache, routes, out_routes)
            # a row that has ended and stays is fed at position 0: its own would run on past the model's table
            # (learned positions) while another row still decodes; its outputs are never read
            positions = torch.where(finished[rows], 0, next_position[rows] + step)
            layout = DecodeLayout(positions=positions[None, :], cache=cache, start=start, routes=routes)
        if routes is not None and routes is not out_routes:  # (inside: inference tensors)
            out_routes[rows] = routes
    counts = lengths.clamp(max=steps).tolist()
    tokens, logps = out_tokens.tolist(), out_logps.tolist()
    elapsed = time.perf_counter() - start_time
    top = None
    if n_top:
        host = out_top.tolist()
        top = [[list(zip(map(int, host[r][t][0]), host[r][t][1])) for t in range(counts[r])] for r in range(b)]
    return Generated([tokens[r][:counts[r]] for r in range(b)], [logps[r][:counts[r]] for r in range(b)],
                     {"rows": b, "steps": steps, "prefill_s": prefill_s, "decode_s": elapsed - prefill_s,
                      "new_tokens": int(sum(counts)), "cache_bytes": cache_bytes, "prefilled": u,
                      "rows_at_end": rows.numel()}, out_routes, top)


def _leave(rows, finished, gone: int, new, gens, cache, routes, out_routes):
    """The rows that have ended (`gone` of the batch) leave it once they are a quarter of it, unless every row has
    ended (a rank whose rows all ended keeps its decoding group's steps company with them as they are): their
    cache rows, generators and routes go (the routes they recorded kept in `out_routes`)."""
    if gone == 0 or gone * 4 < rows.numel() or gone == rows.numel():
        return rows, new, gens, routes
    keep = (~finished[rows]).nonzero()[:, 0]
    if routes is not None:
        if routes is not out_routes:  # (the first leave's routes are out_routes itself, every row)
            out_routes[rows] = routes
        routes = routes[keep]
    cache.select(keep)
    gens = None if gens is None else [gens[k] for k in keep.tolist()]
    return rows[keep], new[keep], gens, routes


def _step_state(finished: torch.Tensor, rows: torch.Tensor, sync) -> tuple[bool, int]:
    """(whether decoding is over: every row here, with `sync` every rank's, has ended; how many of the batch's
    rows have ended), in one host read."""
    running = (~finished).any().to(torch.int32).reshape(1)
    if sync is not None:
        dist.all_reduce(running, op=dist.ReduceOp.MAX, group=sync.group)
    state = torch.cat([running, finished[rows].sum().to(torch.int32).reshape(1)]).tolist()
    return not state[0], state[1]


def _stopped(stop, tokens: torch.Tensor, finished, lengths, step: int) -> torch.Tensor:
    """Rows whose text now meets a stop condition (`stop(row, tokens)`), their length set to this step."""
    hit = torch.zeros_like(finished)
    host, done = tokens.tolist(), finished.tolist()
    for r, row in enumerate(host):
        if not done[r] and stop(r, row):
            hit[r] = True
            lengths[r] = step + 1
    return hit
