"""--grpo-reasoning-gym NAME ...: reasoning_gym's procedurally generated tasks as --grpo's prompts and reward
(`pip install reasoning-gym`; its own generators and scorers, nothing of them rewritten here).

Each task gives --grpo-reasoning-gym-size entries, `reasoning_gym.create_dataset(name, size=..., seed=--seed + k)`
for the k-th name. A prompt is the entry's question: with a chat template, reasoning_gym's default system prompt
(answer inside <answer></answer>) and the question as the user's message; without one, the text
"Question: ...\nAnswer:". The reward `score` is reasoning_gym's own scorer of the entry's dataset
(`get_score_answer_fn`) on the completion's answer: the text inside its <answer> tags (reasoning_gym's
`extract_answer`), else the completion's first line.
"""

from __future__ import annotations

import difflib
import functools

from hybrid.data.prompts import Prompt, encode_prompt
from hybrid.errors import ConfigError

REWARD = "hybrid.data.gym_tasks:score"


def _library():
    try:
        import reasoning_gym  # not at the top: an optional package (the rl extra), imported only when asked for
    except ImportError:
        raise ConfigError("--grpo-reasoning-gym needs the reasoning_gym package: pip install reasoning-gym (or "
                          "pip install 'hybrid[rl]').") from None
    return reasoning_gym


def prompts(tokenizer, names: list, size: int, seed: int) -> list:
    """Every task's entries as prompts; each row's column `entry` (the reasoning_gym entry) goes to the reward."""
    rg = _library()
    known = sorted(rg.factory.DATASETS)
    out = []
    for k, name in enumerate(names):
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            raise ConfigError(f"--grpo-reasoning-gym {name}: reasoning_gym has no such task"
                              f"{' (did you mean ' + ', '.join(close) + '?)' if close else ''}; its {len(known)} "
                              f"tasks are listed by reasoning_gym.factory.DATASETS.")
        for index, entry in enumerate(rg.create_dataset(name, size=size, seed=seed + k)):
            prompt = _prompt(rg, tokenizer, entry["question"])
            out.append(Prompt(prompt, encode_prompt(tokenizer, prompt), {"entry": entry},
                              f"reasoning_gym {name} entry {index}"))
    return out


def _prompt(rg, tokenizer, question: str):
    if getattr(tokenizer, "chat_template", None):
        return [{"role": "system", "content": rg.utils.SYSTEM_PROMPTS["default"]},
                {"role": "user", "content": question}]
    return f"Question: {question}\nAnswer:"


def answer_of(completion) -> str:
    """The completion's answer: inside its <answer> tags (reasoning_gym's extract_answer), else its first line."""
    rg = _library()
    text = completion if isinstance(completion, str) else completion[-1]["content"]
    tagged = rg.utils.extract_answer(text)
    return tagged if tagged is not None else text.strip().split("\n")[0].strip()


def score(prompts, completions, entry, **_) -> list:
    """reasoning_gym's score of each completion's answer for its entry (0 .. 1)."""
    return [float(_scorer(e["metadata"]["source_dataset"])(answer_of(c), e)) for c, e in zip(completions, entry)]


@functools.lru_cache(maxsize=None)
def _scorer(name: str):
    """reasoning_gym's scorer of a task (it builds the task's dataset: once per task)."""
    return _library().get_score_answer_fn(name)
