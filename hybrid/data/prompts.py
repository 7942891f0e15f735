"""Prompts for generation and for --grpo: rows of a JSONL / Parquet file (or a datasets directory) with a `prompt`
(text, or TRL's conversational form: a list of {"role", "content"} messages) or `messages`; every other column
rides along to the reward functions.

Tokenized as TRL's GRPOTrainer tokenizes them: text by the tokenizer's own call (its special tokens, a BOS where
it adds one); messages by its chat template with the generation prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jinja2.exceptions import TemplateError

from hybrid.data.chat.rows import BadRow, read_rows
from hybrid.errors import ConfigError


@dataclass
class Prompt:
    """One row: what to show the reward (`prompt` as the file holds it), its token ids, the other columns."""

    prompt: object
    ids: list
    columns: dict = field(default_factory=dict)
    where: str = ""


def prompt_of(row, where: str):
    """The row's prompt: text or a list of messages; a bad row is one ConfigError naming it."""
    if isinstance(row, BadRow):
        raise ConfigError(str(row))
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object with a 'prompt' or 'messages' field, got "
                          f"{type(row).__name__}.")
    prompt = row.get("prompt", row.get("messages"))
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m and "content" in m
                                                   for m in prompt):
        return prompt
    raise ConfigError(f"{where}: no prompt: give 'prompt' (non-empty text, or a list of {{\"role\", \"content\"}} "
                      f"messages) or 'messages'.")


def encode_prompt(tokenizer, prompt) -> list:
    """Token ids of a prompt as TRL's GRPOTrainer makes them (see the module docstring)."""
    if isinstance(prompt, str):
        return list(tokenizer(text=prompt)["input_ids"])
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(ids["input_ids"])


def read_prompts(path: str, tokenizer, flag: str = "--prompts") -> list:
    """Every prompt of the file, tokenized; the file's other columns kept per row."""
    if tokenizer is None:
        raise ConfigError(f"{flag} {path}: prompts need a tokenizer: give --tokenizer-model DIR (or --load-hf DIR).")
    prompts = []
    for where, row in read_rows(path):
        prompt = prompt_of(row, where)
        if not isinstance(prompt, str) and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{where}: a conversational prompt needs a chat template, and the tokenizer has none "
                              f"(give text prompts, or a tokenizer with a chat template).")
        try:
            ids = encode_prompt(tokenizer, prompt)
        except TemplateError as e:  # the template's own refusal (raise_exception), e.g. roles out of order
            raise ConfigError(f"{where}: the chat template could not render the prompt: {e}") from None
        if not ids:
            raise ConfigError(f"{where}: the prompt encodes to no tokens.")
        columns = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
        prompts.append(Prompt(prompt, ids, columns, where))
    if not prompts:
        raise ConfigError(f"{flag} {path}: no prompts in the file.")
    return prompts
