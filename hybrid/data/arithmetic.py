"""The embedded --grpo task, so `launch/train.py --grpo` runs with no data flags: arithmetic prompts ("Question:
17 + 25 = ?  Answer:") with the answer in a column, and two verifiable rewards in TRL's signature:

- `digits`: the share of the completion's first 8 non-space characters that are digits (0 .. 1), a token-level
  reward a model from scratch can climb within minutes;
- `exact_answer`: 1.0 when the completion's first number is the answer, else 0.0.

`--reward-function` names them as `hybrid.data.arithmetic:digits` (a module path) or any `FILE.py:NAME`.
"""

from __future__ import annotations

import random
import re

from hybrid.data.prompts import Prompt, encode_prompt

DEFAULT_REWARDS = ("hybrid.data.arithmetic:digits", "hybrid.data.arithmetic:exact_answer")
DEFAULT_WEIGHTS = (1.0, 1.0)


def rows(count: int = 512, seed: int = 0) -> list:
    """`count` prompt rows (dicts with 'prompt' and 'answer'), made by a seeded generator."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        op = rng.choice("+-")
        out.append({"prompt": f"Question: {a} {op} {b} = ?  Answer:", "answer": str(a + b if op == "+" else a - b)})
    return out


def prompts(tokenizer, count: int = 512, seed: int = 0) -> list:
    """The task's prompts tokenized as text prompts are (hybrid.data.prompts)."""
    return [Prompt(row["prompt"], encode_prompt(tokenizer, row["prompt"]), {"answer": row["answer"]},
                   f"embedded arithmetic prompt {k}") for k, row in enumerate(rows(count, seed))]


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def digits(prompts, completions, **_) -> list:
    """The share of digits among each completion's first 8 non-space characters."""
    out = []
    for completion in completions:
        head = re.sub(r"\s", "", _text(completion))[:8]
        out.append(sum(ch.isdigit() for ch in head) / 8.0)
    return out


def exact_answer(prompts, completions, answer, **_) -> list:
    """1.0 where the completion's first number is the answer."""
    out = []
    for completion, want in zip(completions, answer):
        found = re.search(r"-?\d+", _text(completion))
        out.append(1.0 if found and found.group(0) == str(want) else 0.0)
    return out
