"""--grpo-environment: multi-turn rollouts against an environment the user names, Gym's reset and step called in
process on the rank that scores (hybrid.training.rollout: a model-parallel group's TP 0 / first-stage rank; its
replies reach the group's other ranks, which generate the same turns).

The environment is a class (or any factory) `FILE.py:NAME` or `package.module:NAME`; each completion gets its own
instance (TRL's environment_factory: interactions stay isolated). Its methods:

- `reset(**row)` (optional): the prompt row's fields as keywords, `prompt` and the other columns (TRL calls it
  with the dataset's example; OpenEnv's reset takes keywords); it may return text, appended to the prompt before
  the first turn (to the last message of a conversational prompt, as TRL appends it).
- `step(action)`: the model's turn as text -> the environment's answer: a string (its reply; the episode goes on),
  None (the episode ends), a mapping or object with `observation` (text or None), `reward` (a number or None),
  `done` and optionally `role` ("user", the default, or "tool" with the tool's `name`; in a conversation the reply
  is that role's message, rendered by the chat template as TRL renders tool results), or Gym's tuple
  (observation, reward, terminated[, truncated, info]).
- `get_reward()` (optional, TRL's): the episode's reward, called once when it has ended.

An episode's reward is the sum of its steps' rewards and get_reward's (None where none gave one): one more reward
column of weight 1 beside --reward-function's (TRL adds an environment's get_reward so); the reward functions also
receive `environments=` (the instances, as TRL passes them).

A turn ends at an end token, --grpo-max-tokens-per-turn tokens, or the completion's budget (--max-new-tokens,
which the replies' tokens count against as TRL's max_completion_length counts tool results); the environment
steps on every turn; its reply's tokens are appended and masked from the loss (TRL's tool_mask), and the next turn
is generated on the whole history, until the environment is done, --grpo-max-turns turns, or the budget is spent
(a reply that does not fit ends the episode, as TRL drops it). Turn t of completion k draws from the generator
keyed k + t x 2^32, so a one-turn episode samples what a run without an environment samples.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from hybrid.data.prompts import Prompt, encode_prompt
from hybrid.errors import ConfigError

TURN_KEY_STRIDE = 1 << 32


def load_user_code(spec: str, flag: str):
    """`FILE.py:NAME` or `package.module:NAME` -> the function or class (the user's own code, run as they asked:
    --reward-function, --grpo-environment)."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(f"{flag} {spec}: expected FILE.py:NAME or package.module:NAME.")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise ConfigError(f"{flag} {spec}: no file {where}.")
            path = os.path.realpath(where)  # one module per file: a class it defines is one class for every flag
            stem = "".join(c if c.isalnum() else "_" for c in os.path.splitext(os.path.basename(path))[0])
            name_of_module = f"hybrid_user_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:10]}"
            module = sys.modules.get(name_of_module)
            if module is None:
                module_spec = importlib.util.spec_from_file_location(name_of_module, path)
                module = importlib.util.module_from_spec(module_spec)
                sys.modules[name_of_module] = module  # as an import registers it (dataclasses and pickling look there)
                try:
                    module_spec.loader.exec_module(module)
                except BaseException:
                    sys.modules.pop(name_of_module, None)
                    raise
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as e:  # the user's module failed to import: one message naming it
        raise ConfigError(f"{flag} {spec}: importing {where} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{flag} {spec}: {where} has no {'function' if flag == '--reward-function' else 'class'} "
                          f"{name}.")
    return fn


@dataclass
class Reply:
    """One step's answer: the reply's text (None: none), the step's reward (None: none), whether it ended the
    episode, the reply's chat role."""

    text: Optional[str]
    reward: Optional[float]
    done: bool
    role: str = "user"
    name: str = "tool"  # a tool reply's tool (the templates that name it)


def _field(result, name, default=None):
    return result.get(name, default) if isinstance(result, dict) else getattr(result, name, default)


def reply_of(result, spec: str) -> Reply:
    """A step's return value (see the module docstring) -> Reply; anything else is one message naming the spec."""
    if result is None or isinstance(result, str):
        return Reply(result, None, result is None)
    if isinstance(result, tuple) and len(result) in (3, 4, 5):
        text, reward, done = result[0], result[1], bool(result[2]) or (len(result) == 5 and bool(result[3]))
        role, name = "user", "tool"
    elif isinstance(result, dict) or hasattr(result, "done"):
        text, reward, done = _field(result, "observation"), _field(result, "reward"), bool(_field(result, "done"))
        role, name = _field(result, "role", "user") or "user", _field(result, "name", "tool") or "tool"
    else:
        raise ConfigError(f"--grpo-environment {spec}: step returned {type(result).__name__}; return the reply's text, "
                          f"None (the episode ends), a dict or object with 'observation', 'reward' and 'done', or "
                          f"Gym's (observation, reward, terminated, truncated, info).")
    if text is not None and not isinstance(text, str):
        raise ConfigError(f"--grpo-environment {spec}: step's observation is {type(text).__name__}; give text or None.")
    if reward is not None and not (isinstance(reward, numbers.Real) and math.isfinite(reward)):
        raise ConfigError(f"--grpo-environment {spec}: step's reward is {reward!r}; give a finite number or None.")
    if role not in ("user", "tool"):
        raise ConfigError(f"--grpo-environment {spec}: a reply's role is 'user' or 'tool', got {role!r}.")
    return Reply(text, None if reward is None else float(reward), done, role, str(name))


@dataclass
class Episodes:
    """One generation batch's episodes on this rank, row by row: the prompt (reset's text appended), the
    completion's ids (every turn and every reply), the sampler's log-probability of each (0 at the replies'), 1 at
    the model's tokens and 0 at the replies', the completion as the rewards see it (text, or the messages), the
    environment's reward [n] fp64 (NaN: none; the scoring rank's only, else None), the instances (scoring rank)."""

    prompts: list
    tokens: list
    logprobs: list
    masks: list
    completions: list = field(default_factory=list)
    rewards: Optional[torch.Tensor] = None
    instances: list = field(default_factory=list)
    turns: int = 0  # the model's turns, all episodes
    replies: int = 0  # the environment's replies appended, all episodes
    new_tokens: int = 0
    seconds: float = 0.0
    cache_bytes: int = 0
    error: str = ""  # the environment's failure (one message), raised once every rank knows


class Environment:
    """--grpo-environment's factory and how its replies become tokens."""

    def __init__(self, spec: str, tokenizer, eos: list, conversational: bool, max_turns: int,
                 max_tokens_per_turn: Optional[int]):
        self.spec, self.factory = spec, load_user_code(spec, "--grpo-environment")
        self.tokenizer, self.eos, self.conversational = tokenizer, list(eos), conversational
        self.max_turns, self.per_turn = max_turns, max_tokens_per_turn or math.inf

    # --- the scoring rank: the instances -------------------------------------------------------------------------

    def _start(self, prompts: list) -> tuple:
        """One instance per row, reset with the row's columns; the prompts with reset's text appended."""
        instances, started = [], []
        for p in prompts:
            env = self.factory()
            if not callable(getattr(env, "step", None)):
                raise ConfigError(f"--grpo-environment {self.spec}: the instance has no step(action) method.")
            text = env.reset(prompt=p.prompt, **p.columns) if callable(getattr(env, "reset", None)) else None
            if text is not None and not isinstance(text, str):
                raise ConfigError(f"--grpo-environment {self.spec}: reset returned {type(text).__name__}; return "
                                  f"text (appended to the prompt) or None.")
            instances.append(env)
            started.append(p if not text else self._extended(p, text))
        return instances, started

    def _extended(self, p: Prompt, text: str) -> Prompt:
        if isinstance(p.prompt, str):
            prompt = p.prompt + text
        else:  # appended to the last message, as TRL appends reset's text to the last user message
            prompt = [dict(m) for m in p.prompt]
            prompt[-1]["content"] = prompt[-1]["content"] + text
        return Prompt(prompt, encode_prompt(self.tokenizer, prompt), p.columns, p.where)

    def reply_ids(self, reply: Reply, turn_ended: bool) -> list:
        """The reply's tokens: the text's own (text prompts), or the chat template's rendering of the reply's
        message after an assistant turn with the next generation prompt (TRL's _get_tool_suffix_ids); a turn the
        per-turn limit cut gets its end token first (it belongs to the reply: masked)."""
        if not self.conversational:
            return list(self.tokenizer(reply.text, add_special_tokens=False)["input_ids"])
        if reply.role == "tool":
            call = {"type": "function", "function": {"name": reply.name, "arguments": {}}}
            assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
            message = {"role": "tool", "name": reply.name, "content": reply.text}
        else:
            assistant, message = {"role": "assistant", "content": "dummy"}, {"role": "user", "content": reply.text}
        history = [{"role": "user", "content": "dummy"}, assistant]
        prefix = self._template(history, False)
        full = self._template(history + [message], True)
        ends = [k for k, t in enumerate(prefix) if t in self.eos]
        prefix = prefix[:ends[-1] + 1] if ends else prefix
        if full[:len(prefix)] != prefix:
            raise ConfigError(f"--grpo-environment {self.spec}: the chat template renders an assistant turn "
                              f"differently when a {reply.role} message follows it, so a reply cannot be appended "
                              f"to the generated turn; give text prompts, or a template that appends messages.")
        suffix = full[len(prefix):]
        return suffix if turn_ended or not ends else [prefix[ends[-1]]] + suffix

    def _template(self, messages: list, generation_prompt: bool) -> list:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                                 return_dict=True)
        return list(out["input_ids"])

    def _reward(self, env, steps: list):
        total = [r for r in steps if r is not None]
        if callable(getattr(env, "get_reward", None)):
            value = env.get_reward()
            if value is not None and not (isinstance(value, numbers.Real) and math.isfinite(value)):
                raise ConfigError(f"--grpo-environment {self.spec}: get_reward returned {value!r}; give a finite "
                                  f"number or None.")
            total += [] if value is None else [float(value)]
        return math.fsum(total) if total else math.nan

    # --- every rank: the turns -------------------------------------------------------------------------------

    def episodes(self, prompts: list, keys: list, budget: int, room: Callable[[int], int],
                 turn: Callable, scorer: bool, share: Callable, agree: Callable) -> Episodes:
        """The episodes of `prompts` (this rank's rows). `turn(prompt_ids, keys, limits)` generates one turn
        (Generated; None rows: the rank only keeps its decoding group's steps company), `share(obj)` gives the
        scoring rank's object to the model-parallel group, `agree(n)` the largest n of the ranks that decode
        together (or n), `room(prompt_length)` the tokens a window leaves after the prompt."""
        n, error, instances = len(prompts), "", []
        if scorer:
            try:
                instances, prompts = self._start(prompts)
            except ConfigError as e:
                error = str(e)
            except Exception as e:  # the user's code: one message naming it
                hint = " (reset receives the row's fields, prompt and the other columns, as keywords: give it " \
                       "**kwargs)" if isinstance(e, TypeError) else ""
                error = f"--grpo-environment {self.spec}: creating or resetting it raised {type(e).__name__}: {e}{hint}"
        ids, error = share(([p.ids for p in prompts], error))
        prompts = [p if p.ids == row else Prompt(p.prompt, row, p.columns, p.where) for p, row in zip(prompts, ids)]
        left = [min(budget, room(len(p.ids))) for p in prompts]
        if not error and min(left) < 1:
            k = left.index(min(left))
            error = (f"--grpo-environment {self.spec}: reset's text leaves {prompts[k].where} no room for a "
                     f"completion in --seq-length; raise --seq-length or return shorter text.")
        out = Episodes(prompts, [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)],
                       [[] if self.conversational else "" for _ in range(n)], instances=instances)
        done, steps = [bool(error)] * n, [[] for _ in range(n)]
        for t in range(self.max_turns):
            active = [r for r in range(n) if not done[r]]
            if not agree(len(active)):
                break
            limits = [min(left[r], self.per_turn) for r in active]
            gen = turn([prompts[r].ids + out.tokens[r] for r in active],
                       [keys[r] + t * TURN_KEY_STRIDE for r in active], limits)
            if gen is None:
                continue
            out.seconds += gen.stats["prefill_s"] + gen.stats["decode_s"]
            out.new_tokens += gen.stats["new_tokens"]
            out.cache_bytes = max(out.cache_bytes, gen.stats["cache_bytes"])
            for r, tokens, logps in zip(active, gen.tokens, gen.logprobs):
                out.tokens[r] += tokens
                out.logprobs[r] += logps
                out.masks[r] += [1] * len(tokens)
                left[r] -= len(tokens)
                out.turns += 1
            replies = None
            if scorer and not error:
                try:
                    replies = self._step(out, active, gen, steps, left, last=t + 1 == self.max_turns)
                except ConfigError as e:
                    error = str(e)
                except Exception as e:
                    error = f"--grpo-environment {self.spec}: step raised {type(e).__name__}: {e}"
            replies, error = share((replies, error))
            for k, r in enumerate(active):
                reply = None if error else replies[k]
                if reply is None:
                    done[r] = True
                    continue
                out.tokens[r] += reply
                out.logprobs[r] += [0.0] * len(reply)
                out.masks[r] += [0] * len(reply)
                left[r] -= len(reply)
                out.replies += 1
        if scorer and not error:
            try:
                out.rewards = torch.tensor([self._reward(env, s) for env, s in zip(instances, steps)],
                                           dtype=torch.float64)
            except ConfigError as e:
                error = str(e)
            except Exception as e:
                error = f"--grpo-environment {self.spec}: get_reward raised {type(e).__name__}: {e}"
        if not self.conversational:
            out.completions = [self.tokenizer.decode(t, skip_special_tokens=True) for t in out.tokens]
        out.error = error
        return out

    def _step(self, out: Episodes, active: list, gen, steps: list, left: list, last: bool) -> list:
        """Each active row's environment steps on its new turn; per row the reply's tokens, or None where the
        episode ended (done, no reply, the last turn, or a reply that does not fit the budget)."""
        replies = []
        for r, tokens in zip(active, gen.tokens):
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            if self.conversational:
                out.completions[r].append({"role": "assistant", "content": text})
            reply = reply_of(out.instances[r].step(text), self.spec)
            steps[r].append(reply.reward)
            ids = None
            if not (reply.done or reply.text is None or last or left[r] < 1):
                ids = self.reply_ids(reply, bool(tokens) and tokens[-1] in self.eos)
                if len(ids) >= left[r]:
                    ids = None  # it leaves no room for the next turn
                elif self.conversational:  # (TRL's tool messages name their tool)
                    out.completions[r].append({"role": reply.role, "content": reply.text} if reply.role == "user"
                                              else {"role": "tool", "name": reply.name, "content": reply.text})
            replies.append(ids)
        return replies


def share_in_group(groups, device) -> Callable:
    """`share(obj)`: the scoring rank's (TP 0, first stage) object on every rank of its model-parallel group."""
    def share(obj):
        for axis in (groups.tp, groups.pp):
            if axis.size > 1:
                box = [obj]
                dist.broadcast_object_list(box, group=axis.group, group_src=0, device=device)
                obj = box[0]
        return obj
    return share
