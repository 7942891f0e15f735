"""--grpo's rollouts: the training engine's own model generates each iteration's completions at the training layout
(hybrid.model.generate: no export, no second copy of the weights, the same layers the loss then runs), the reward
functions score them, and the rows go to the runtime as micro-batches for the GRPO objective
(hybrid.model.objectives.GroupPolicy).

Which prompts and which random draws an iteration gets is a function of the run's seed and its consumed
completions only: generation g takes the next --global-batch-size / G prompts of an epoch-seeded permutation of
the prompt set, and completion k of the run draws from its own generator keyed by k. A resumed run (weights and
consumed samples restored) therefore generates exactly what the uninterrupted run generated.

Each data-parallel rank generates its own whole groups (B / (G x DP) prompts, G completions each), so the group
statistics of the advantages need no communication. Under a sequence split (CP, Ulysses) the split's ranks share
their data-parallel rank's rows for sampling (each a contiguous share, with the same keys), then every one of them
holds all of them, and the rows train split over the sequence (hybrid.model.loss.whole_sequence). Every rank of a
model-parallel group holds the same completions (the tokens are shared by the decoding loop) and computes the same
rewards: reward functions must be deterministic functions of their arguments (as TRL's are called on each process
for its own rows).
"""

from __future__ import annotations

import math
import numbers
import random
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.data import arithmetic, gym_tasks, prompts
from hybrid.data.tokenizer import end_ids
from hybrid.errors import ConfigError
from hybrid.model.generate import SamplingOptions, generate
from hybrid.model.grpo import GRPOOptions, Value, advantages, completion_rows, nanstd
from hybrid.model.forward_only import forward_only
from hybrid.model.loss import token_logps, whole_sequence
from hybrid.model.objectives import reference_logps
from hybrid.parallel.cross_entropy import IGNORE_INDEX
from hybrid.training import deepspeed_fixes
from hybrid.training.environments import Environment, load_user_code, share_in_group
from hybrid.training.logging import log


class Rewards:
    """The weighted reward functions, called as TRL calls them: fn(prompts=..., completions=..., completion_ids=...,
    **the rows' other columns) -> one float (or None: not applicable) per completion."""

    def __init__(self, specs, weights):
        self.specs = list(specs)
        self.functions = [load_user_code(spec, "--reward-function") for spec in self.specs]
        self.weights = torch.tensor(list(weights) or [1.0] * len(self.specs), dtype=torch.float64)
        self.names = unique_names([spec.rpartition(":")[2] for spec in self.specs])  # rewards/NAME/mean (TRL's)

    def __call__(self, prompts: list, completions: list, completion_ids: list, column=None, environments=None):
        """Per completion, the weighted sum of the functions' values (a function's None is left out, as TRL's
        nansum) [n] fp64, and each function's values [functions, n]. --grpo-environment: its rewards `column`
        [n] (NaN: none) join with weight 1, and the functions receive `environments=` (the instances, TRL's)."""
        table = torch.empty(len(self.functions), len(prompts), dtype=torch.float64)
        extra = {} if environments is None else {"environments": environments}
        for k, (spec, fn) in enumerate(zip(self.specs, self.functions)):
            table[k] = self._values(spec, fn, prompts, completions, completion_ids, extra)
        weights = self.weights
        if column is not None:
            table, weights = torch.cat([table, column[None]]), torch.cat([weights, weights.new_ones(1)])
        return (table * weights[:, None]).nansum(0), table

    @staticmethod
    def _call(fn, prompts, completions, completion_ids, extra, rows=slice(None)):
        columns = {key: [p.columns.get(key) for p in prompts[rows]] for p in prompts for key in p.columns}
        columns.update({key: value[rows] for key, value in extra.items()})
        return fn(prompts=[p.prompt for p in prompts[rows]], completions=completions[rows],
                  completion_ids=completion_ids[rows], **columns)

    def _values(self, spec, fn, prompts, completions, completion_ids, extra) -> torch.Tensor:
        try:
            values = self._call(fn, prompts, completions, completion_ids, extra)
        except Exception as batch_error:  # find the row it fails on, to name it
            for k in range(len(prompts)):
                try:
                    self._call(fn, prompts, completions, completion_ids, extra, slice(k, k + 1))
                except Exception as e:
                    raise ConfigError(f"--reward-function {spec} raised {type(e).__name__}: {e} (on "
                                      f"{prompts[k].where}, completion {completions[k]!r:.80})") from None
            raise ConfigError(f"--reward-function {spec} raised {type(batch_error).__name__}: {batch_error} on the "
                              f"batch from {prompts[0].where} on (each row alone passes)") from None
        if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # a numpy array or a tensor
            values = values.tolist()
        if not isinstance(values, (list, tuple)) or len(values) != len(prompts):
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise ConfigError(f"--reward-function {spec} returned {got} values for {len(prompts)} completions (from "
                              f"{prompts[0].where} on): return a list with one float per completion.")
        out = torch.empty(len(values), dtype=torch.float64)
        for k, value in enumerate(values):
            if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a 0-d tensor or numpy value (TRL's)
                value = value.item()
            if value is None:
                out[k] = math.nan
            elif isinstance(value, numbers.Real) and math.isfinite(value):
                out[k] = float(value)
            else:
                raise ConfigError(f"--reward-function {spec} returned {value!r} for {prompts[k].where}: give a finite "
                                  f"number (or None where the reward does not apply).")
        return out


def unique_names(names: list) -> list:
    """The names, a repeated one numbered (_2, _3, ...) until no two are the same."""
    out = []
    for name in names:
        candidate, k = name, 1
        while candidate in out or (candidate != name and candidate in names):
            k += 1
            candidate = f"{name}_{k}"
        out.append(candidate)
    return out


ROUND_KEY_STRIDE = 1 << 48  # --grpo-dynamic-sampling: round r's completion keys start r x 2^48 on


def _has_signal(rewards: torch.Tensor) -> bool:
    """A group whose scored rewards differ (an advantage to learn from)."""
    finite = rewards[~torch.isnan(rewards)]
    return finite.numel() > 1 and bool(finite.max() > finite.min())


@dataclass
class Sampled:
    """Rows sampled and scored: their prompts, completions' ids, the sampler's log-probabilities, the model's-token
    masks (--grpo-environment; else None), rewards [n] fp64, the generator's routing at the training rows' positions
    (None without MoE), generation seconds, new tokens, the KV cache's bytes, (turns, replies, episodes)."""

    prompts: list
    tokens: list
    logprobs: list
    masks: Optional[list]
    total: torch.Tensor
    routes: Optional[torch.Tensor]
    seconds: float
    new_tokens: int
    cache_bytes: int
    turns: tuple
    table: Optional[torch.Tensor] = None  # each reward column's values [columns, n] (the scoring rank's; else None)

    @staticmethod
    def gathered(part: "Sampled", axis) -> "Sampled":
        """Every rank of `axis`'s rows in rank order (the sequence split's ranks each sample a share of the rows,
        then all train on all of them); seconds and the cache's bytes are the slowest rank's and the largest."""
        mine = replace(part, routes=None if part.routes is None else part.routes.cpu())
        parts = [None] * axis.size
        dist.all_gather_object(parts, mine, group=axis.group)  # host lists and CPU tensors: once per generation batch
        def cat(name):
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else [v for value in values for v in value]
        routes = None if part.routes is None else torch.cat([p.routes for p in parts]).to(part.routes.device)
        return Sampled(cat("prompts"), cat("tokens"), cat("logprobs"), cat("masks"),
                       torch.cat([p.total for p in parts]), routes, max(p.seconds for p in parts),
                       sum(p.new_tokens for p in parts), max(p.cache_bytes for p in parts),
                       tuple(sum(p.turns[i] for p in parts) for i in range(3)),
                       None if part.table is None else torch.cat([p.table for p in parts], 1))

    @staticmethod
    def joined(groups: list, g: int, batches: list) -> "Sampled":
        """The (batch, first row) groups of G rows, as one batch; the generation's sums over every batch sampled."""
        rows = [(b, k + j) for b, k in groups for j in range(g)]
        masks = None if rows[0][0].masks is None else [b.masks[r] for b, r in rows]
        routes = None if rows[0][0].routes is None else torch.stack([b.routes[r] for b, r in rows])
        return Sampled([b.prompts[r] for b, r in rows], [b.tokens[r] for b, r in rows],
                       [b.logprobs[r] for b, r in rows], masks, torch.stack([b.total[r] for b, r in rows]), routes,
                       sum(b.seconds for b in batches), sum(b.new_tokens for b in batches),
                       max(b.cache_bytes for b in batches),
                       tuple(sum(b.turns[i] for b in batches) for i in range(3)),
                       None if rows[0][0].table is None else torch.stack([b.table[:, r] for b, r in rows], 1))


def usable_prompts(prompts: list, seq_length: int, max_new_tokens: int) -> list:
    """The prompts whose tokens and the completion limit fit one training window (--seq-length + 1 tokens); the
    others are dropped and counted in the log."""
    room = seq_length + 1 - max_new_tokens
    kept = [p for p in prompts if len(p.ids) <= room]
    if len(kept) < len(prompts):
        log(f"--grpo: {len(prompts) - len(kept)} of {len(prompts)} prompts are longer than --seq-length + 1 - "
            f"--max-new-tokens = {room} tokens and are left out")
    if not kept:
        raise ConfigError(f"--grpo: no prompt fits --seq-length {seq_length} with --max-new-tokens {max_new_tokens} "
                          f"(at most {room} prompt tokens): raise --seq-length or lower --max-new-tokens.")
    return kept


class Rollout:
    """The runtime's micro-batches for --grpo (an iterator; see the module docstring)."""

    def __init__(self, run, groups, engine, prompts: list, tokenizer, consumed: int, stats, before_generate=None,
                 reference=None):
        t = run.training
        self.reference, self.vocab_size = reference, run.model.vocab_size  # --grpo-beta > 0: the frozen model
        self.options: GRPOOptions = t.grpo
        self.groups, self.engine, self.model = groups, engine, engine.module
        self.tokenizer, self.stats, self.before_generate = tokenizer, stats, before_generate
        self.prompts = usable_prompts(prompts, t.seq_length, self.options.max_new_tokens)
        self.seq_length, self.micro, self.seed = t.seq_length, t.micro_batch_size, t.seed
        self.global_batch = t.global_batch_size
        self.device = torch.device(engine.device)
        self.zero3 = run.zero_stage == 3
        self.conversational = not isinstance(self.prompts[0].prompt, str)
        self.rewards = Rewards(self.options.reward_functions, self.options.reward_weights)
        # every end of turn the model's generation config lists, and the tokenizer's EOS (as TRL stops)
        self.eos = end_ids(tokenizer, run.checkpoint.load_hf, run.args.get("tokenizer_model"))
        o = self.options
        self.environment = None if not o.environment else Environment(
            o.environment, tokenizer, self.eos, self.conversational, o.max_turns, o.max_tokens_per_turn)
        self.stats.columns = unique_names(self.rewards.names + (["environment"] if self.environment else []))
        self.iteration = consumed // self.global_batch  # the optimizer steps taken (no batch ramp-up with --grpo)
        if self.iteration % self.options.iterations:
            log(f"--grpo: resuming at iteration {self.iteration}, inside a generation batch (--grpo-iterations "
                f"{self.options.iterations}): its completions are generated again with the checkpoint's weights, so "
                f"the run does not repeat the uninterrupted one exactly; save at multiples of --grpo-iterations")
        self.queue: list = []
        self.rows = None  # the current generation batch (ids, labels, values) on this rank, or None

    def __iter__(self):
        return self

    def __next__(self):
        if not self.queue:
            generation, use = divmod(self.iteration, self.options.iterations)
            if use == 0 or self.rows is None:
                self.rows = self._generate(generation)
            ids, labels, values, routes = self.rows
            values = values.clone()
            values[:, Value.FRESH] = 1.0 if use == 0 else 0.0  # fresh: the sampler's policy is the trainer's
            self.queue = [(ids[k:k + self.micro], labels[k:k + self.micro], values[k:k + self.micro])
                          + (() if routes is None else (routes[k:k + self.micro],))
                          for k in range(0, ids.size(0), self.micro)]
            self.iteration += 1
        return self.queue.pop(0)

    # --- one generation batch --------------------------------------------------------------------------------

    def _prompt_indices(self, generation: int) -> list:
        """This DP rank's prompts (indices into the prompt set) of generation `generation`."""
        per_generation = self.global_batch // self.options.group_size
        mine = per_generation // self.groups.dp.size
        first = generation * per_generation + self.groups.dp.rank * mine
        n, out, epoch, order = len(self.prompts), [], None, None
        for q in range(first, first + mine):
            if q // n != epoch:
                epoch = q // n
                order = list(range(n))
                random.Random(self.seed + 1 + epoch).shuffle(order)
            out.append(order[q % n])
        return out

    def _generate(self, generation: int):
        g = self.options.group_size
        options = SamplingOptions(self.options.max_new_tokens, self.options.temperature, self.options.top_p,
                                  self.options.top_k, self.seed, self.eos, self.eos[0] if self.eos else 0)
        if self.before_generate is not None:
            self.before_generate()
        peak = self.device.type == "cuda"
        if peak:  # the generation's own peak (the run's peak after it is then the training's since this point)
            torch.cuda.reset_peak_memory_stats(self.device)
        with deepspeed_fixes.zero3_gathered_while_generating(self.engine, log) as gathered:
            batch = self._sample(self._prompt_indices(generation), generation, 0, options, self.sync(gathered))
            rounds, generated = 1, 0
            if self.options.dynamic_sampling:
                batch, rounds, generated = self._refilled(batch, generation, options, self.sync(gathered))
        peak_bytes = torch.cuda.max_memory_allocated(self.device) if peak else 0
        prompts, total, masks = batch.prompts, batch.total, batch.masks
        adv = advantages(total, g, self.options.scale_rewards, self._batch_std(total)).float().nan_to_num(0.0)
        lengths = torch.tensor([len(t) for t in batch.tokens] if masks is None else [sum(m) for m in masks],
                               dtype=torch.float64)  # the model's tokens (an environment's: TRL's tool_mask ones)
        finite = total[~torch.isnan(total)]
        flat = sum(1 - _has_signal(total[k:k + g]) for k in range(0, len(prompts), g))
        self.stats.add_rollout(torch.tensor([len(prompts), float(finite.sum()), float((finite ** 2).sum()),
                                             float(lengths.sum()), batch.seconds, float(batch.new_tokens),
                                             float(len(finite)), float(batch.cache_bytes), float(peak_bytes),
                                             *batch.turns, flat, len(prompts) // g, rounds, generated],
                                            dtype=torch.float64, device=self.device))
        self.stats.add_columns(self._column_sums(batch.table))
        ids, labels, values = self._rows(prompts, batch.tokens, batch.logprobs, adv, masks)
        routes = batch.routes
        if self.options.iterations > 1:
            if routes is not None and self.model.config.moe_routing_replay == "R2":  # the trainer's routing, recorded
                routes = routes.new_full(routes.shape, -1)
            self._trainer_logps(ids, labels, values, routes)
        return ids, labels, values, routes

    def _sample(self, chosen: list, generation: int, round_: int, options: SamplingOptions, sync) -> "Sampled":
        """G completions of each chosen prompt (one turn, or --grpo-environment's episodes), scored. Completion k of
        round r (--grpo-dynamic-sampling's refills) draws from the generator keyed k + r x 2^48."""
        g = self.options.group_size
        prompts = [self.prompts[i] for i in chosen for _ in range(g)]
        first_key = generation * self.global_batch + self.groups.dp.rank * len(prompts) + round_ * ROUND_KEY_STRIDE
        keys = list(range(first_key, first_key + len(prompts)))
        axis = self.groups.sequence
        if axis.size > 1:  # a sequence split: its ranks sample as data-parallel ranks, each a share of the rows
            share = slice(len(prompts) * axis.rank // axis.size, len(prompts) * (axis.rank + 1) // axis.size)
            return Sampled.gathered(self._sample_rows(prompts[share], keys[share], options, sync), axis)
        return self._sample_rows(prompts, keys, options, sync)

    def _sample_rows(self, prompts: list, keys: list, options: SamplingOptions, sync) -> "Sampled":
        start = time.perf_counter()
        if self.environment is not None:  # the prompts with reset's text; the environment's rewards and instances
            out = self._episodes(prompts, keys, options, sync)
            total, table = self._scored(out.prompts, out.completions, out.tokens, out.error, out.rewards,
                                        out.instances)
            return Sampled(out.prompts, out.tokens, out.logprobs, out.masks, total, None, out.seconds,
                           out.new_tokens, out.cache_bytes, (out.turns, out.replies, len(prompts)), table)
        out = generate(self.model, self.groups, [p.ids for p in prompts], options, keys=keys, device=self.device,
                       sync=sync, record_routes=True)
        seconds = time.perf_counter() - start
        texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in out.tokens]
        completions = [[{"role": "assistant", "content": t}] for t in texts] if self.conversational else texts
        total, table = self._scored(prompts, completions, out.tokens)
        return Sampled(prompts, out.tokens, out.logprobs, None, total, self._routes(prompts, out), seconds,
                       out.stats["new_tokens"], out.stats["cache_bytes"], (len(prompts), 0, 0), table)

    def _refilled(self, batch: "Sampled", generation: int, options: SamplingOptions, sync) -> tuple:
        """--grpo-dynamic-sampling (DAPO's; verl's filter_groups): groups whose rewards all agree carry no
        advantage and are dropped; refill rounds sample G completions of further prompts (a draw keyed by the
        seed, the generation, the data-parallel rank and the round: a resumed run draws the same) until every
        data-parallel rank holds its groups (the ranks agree on the rounds: their collectives stay in step), at
        most --grpo-dynamic-sampling-max-rounds; short of that the batch is topped up with dropped groups (no
        signal, as without the filter). -> the batch, its rounds, the groups generated."""
        g, quota = self.options.group_size, len(batch.prompts) // self.options.group_size
        kept, dropped, rounds, batches = [], [], 1, [batch]
        while True:
            for k in range(0, len(batch.prompts), g):
                (kept if _has_signal(batch.total[k:k + g]) else dropped).append((batch, k))
            need = torch.tensor([max(quota - len(kept), 0)], device=self.device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(need, op=dist.ReduceOp.MAX)  # one small read per round
            if not int(need.item()) or rounds == self.options.dynamic_sampling_rounds:
                break
            rng = random.Random(((self.seed * 1_000_003 + generation) * 7_919 + self.groups.dp.rank) * 104_729
                                + rounds)
            batch = self._sample(rng.choices(range(len(self.prompts)), k=quota), generation, rounds, options, sync)
            batches.append(batch)
            rounds += 1
        return Sampled.joined((kept + dropped)[:quota], g, batches), rounds, rounds * quota

    def _column_sums(self, table) -> torch.Tensor:
        """Each reward column's sum, square sum and count of scored values [3, columns] fp64 on the device (TRL's
        rewards/NAME/mean and std); zeros on the ranks that do not score (their data-parallel sums are the
        scoring ranks')."""
        if table is None:
            return torch.zeros(3, len(self.stats.columns), dtype=torch.float64, device=self.device)
        scored = ~torch.isnan(table)
        values = table.nan_to_num(0.0)
        return torch.stack([values.sum(1), (values ** 2).sum(1), scored.sum(1).double()]).to(self.device)

    def _episodes(self, prompts: list, keys: list, options: SamplingOptions, sync):
        """--grpo-environment's multi-turn episodes (hybrid.training.environments) of this rank's rows."""
        g = self.groups

        def turn(rows: list, row_keys: list, limits: list):
            if not rows:  # no episode left here
                generate(self.model, g, [[options.pad]], options, keys=[0], device=self.device, sync=sync,
                         stop=lambda r, tokens: True)
                return None
            return generate(self.model, g, rows, options, keys=row_keys, device=self.device, sync=sync,
                            stop=lambda r, tokens: len(tokens) >= limits[r])

        def agree(active: int) -> int:
            if sync is None:
                return active
            count = torch.tensor([active], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=sync.group)  # one small read per turn
            return int(count.item())

        return self.environment.episodes(prompts, keys, options.max_new_tokens,
                                         lambda length: self.seq_length + 1 - length, turn,
                                         g.tp.rank == 0 and g.pp.rank == 0, share_in_group(g, self.device), agree)

    def _trainer_logps(self, ids, labels, values, routes) -> None:
        """--grpo-iterations > 1: the trainer's log-probabilities of the batch's labels with the weights that
        generated it (TRL's old_per_token_logps), for the later passes' ratios and rollout correction: one forward
        without gradients through this rank's stages, kept on the last stage (Value.TRAINER). With
        --moe-routing-replay R2 the forward records its routing into `routes` (the passes replay it)."""
        micro = self.micro
        starts = list(range(0, ids.size(0), micro))
        record = self.model.config.moe_routing_replay == "R2"
        inputs = [{} if routes is None else {"routes": routes[k:k + micro], "record_routes": record} for k in starts]
        outputs = forward_only(self.model, self.groups, self.device, [ids[k:k + micro] for k in starts],
                               lambda mb, logits: whole_sequence(token_logps(
                                   logits, labels[starts[mb]:starts[mb] + micro], self.groups, self.vocab_size,
                                   self.options.temperature), self.groups),
                               call=self.engine, inputs=inputs)
        for k, logps in zip(starts, outputs):
            values[k:k + micro, Value.TRAINER] = logps

    def sync(self, gathered: bool):
        """The ranks whose decoding steps must run together: at ZeRO-3 with its parameters not gathered for the
        generation every data-parallel rank (each step's hooks all-gather parameters over them), with expert
        parallelism the expert group (its all-to-alls), else none (a rank whose rows all ended stops)."""
        if self.zero3 and not gathered:
            return self.groups.dp_cp
        return self.groups.ep if self.groups.ep.size > 1 else None

    def _scored(self, prompts: list, completions: list, completion_ids: list, error: str = "", column=None,
                environments=None) -> torch.Tensor:
        """The weighted rewards [n] fp64 (host): computed once per model-parallel group (its TP 0 / first-stage
        rank, so a reward that calls out or draws is called once and every rank trains on the same values) and
        broadcast over TP and PP; a failing function (or `error`: the environment's) stops every rank with its
        one message. `column`, `environments`: --grpo-environment's rewards and instances (Rewards). -> (the
        rewards, each reward column's values [columns, n] on the scoring rank, None elsewhere)."""
        g, n = self.groups, len(prompts)
        scorer = g.tp.rank == 0 and g.pp.rank == 0
        total = table = None
        if scorer and not error:
            try:
                total, table = self.rewards(prompts, completions, completion_ids, column, environments)
            except ConfigError as e:
                error = str(e)
        # --grpo-environment alone: some episode of the batch (on any rank) must have got a reward
        rewarded = 1.0 if column is not None and not column.isnan().all() else 0.0
        if dist.is_initialized() and dist.get_world_size() > 1:
            flags = torch.tensor([1.0 if error else 0.0, rewarded], device=self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # one small read per generation batch
            failed, rewarded = flags.tolist()
            if failed:
                messages = [None] * dist.get_world_size()
                dist.all_gather_object(messages, error)
                raise ConfigError(next(m for m in messages if m))
        elif error:
            raise ConfigError(error)
        if self.environment is not None and not self.rewards.functions and not rewarded:
            raise ConfigError(f"--grpo-environment {self.environment.spec}: no episode of the batch got a reward (its "
                              f"steps' rewards and get_reward were all None) and no --reward-function is given: give "
                              f"one of them (TRL's rule: a reward source is required).")
        values = total.to(self.device) if scorer else torch.empty(n, dtype=torch.float64, device=self.device)
        for axis in (g.tp, g.pp):
            if axis.size > 1:
                dist.broadcast(values, group=axis.group, group_src=0)
        return values.cpu(), table

    def _batch_std(self, total: torch.Tensor):
        """--grpo-scale-rewards batch: the std of the whole generation batch (every data-parallel rank's rewards,
        as TRL takes it over the gathered batch); None otherwise."""
        if self.options.scale_rewards != "batch":
            return None
        if self.groups.dp.size > 1:
            local = total.to(self.device)
            gathered = torch.empty(local.numel() * self.groups.dp.size, dtype=local.dtype, device=self.device)
            dist.all_gather_into_tensor(gathered, local, group=self.groups.dp.group)
            total = gathered.cpu()
        return nanstd(total)

    def _routes(self, prompts: list, out):
        """The generation's routing (Generated.routes, over its left-padded slots) at the training rows' positions,
        [n, s, layers, k]: each prompt token's and each completion token the generator fed back (its last is never
        fed); -1 elsewhere (padding: routed live). None for a model without MoE layers on this rank."""
        if out.routes is None:
            return None
        n, width = len(prompts), out.routes.size(1) - self.options.max_new_tokens
        routes = out.routes.new_full((n, self.seq_length) + tuple(out.routes.shape[2:]), -1)
        for r, (prompt, completion) in enumerate(zip(prompts, out.tokens)):
            fed = len(prompt.ids) + len(completion) - 1
            pad = width - len(prompt.ids)
            routes[r, :fed] = out.routes[r, pad:pad + fed]
        return routes

    def _rows(self, prompts: list, tokens: list, logprobs: list, adv: torch.Tensor, masks=None):
        """Training rows: ids = prompt + completion (right-padded), labels = the completion's tokens at their
        positions (not the environment's: `masks` 0), values [n, 5, s] (hybrid.model.grpo.Value): the advantage,
        the sampler's log-probabilities, the reference's (zeros without --grpo-beta)."""
        n = len(prompts)
        ids, labels, values = completion_rows([p.ids for p in prompts], tokens, logprobs, adv, self.seq_length,
                                              self.eos[0] if self.eos else 0)
        for r, mask in enumerate(masks or ()):  # the environment's replies: context, not trained (TRL's tool_mask)
            first = len(prompts[r].ids) - 1
            replies = torch.tensor(mask) == 0
            labels[r, first:first + len(mask)][replies] = IGNORE_INDEX
        if self.options.mask_truncated_completions:  # rows that ran to --max-new-tokens train on nothing (TRL's)
            pad = getattr(self.tokenizer, "pad_token_id", None)
            ends = set(self.eos) | ({pad} if pad is not None else set())
            truncated = torch.tensor([not t or t[-1] not in ends for t in tokens])
            labels[truncated] = IGNORE_INDEX
        ids, labels, values = ids.to(self.device), labels.to(self.device), values.to(self.device)
        if self.reference is not None:  # the KL's reference log-probabilities, tempered as the policy's
            for k in range(0, n, self.micro):
                values[k:k + self.micro, Value.REFERENCE] = whole_sequence(reference_logps(
                    self.reference, ids[k:k + self.micro], labels[k:k + self.micro], self.groups, self.vocab_size,
                    self.options.temperature), self.groups)
        return ids, labels, values


def grpo_prompts(run, tokenizer) -> list:
    """The run's prompts: --grpo-reasoning-gym's tasks, --data-path's file (hybrid.data.prompts), or the embedded
    arithmetic task."""
    hf = tokenizer.to_transformers() if hasattr(tokenizer, "to_transformers") else None
    if hf is None:
        raise ConfigError("--grpo decodes completions for its rewards with a HuggingFace tokenizer: use --load-hf DIR, "
                          "--tokenizer-type HFTokenizer --tokenizer-model DIR, or the default GPT-2 BPE files.")
    paths, o = run.data.data_path or [], run.training.grpo
    if o.reasoning_gym:
        return gym_tasks.prompts(hf, list(o.reasoning_gym), o.reasoning_gym_size, run.training.seed), hf
    if not paths:
        return arithmetic.prompts(hf, seed=run.training.seed), hf
    if len(paths) != 1:
        raise ConfigError("--grpo: --data-path takes one prompt file (JSONL / Parquet rows with 'prompt' or "
                          "'messages'; the other columns go to the reward functions).")
    return prompts.read_prompts(paths[0], hf, "--data-path"), hf

