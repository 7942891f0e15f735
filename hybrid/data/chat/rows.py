"""The rows people bring: JSONL (gzipped too), Parquet or a `datasets` directory, each row a conversation (messages,
ShareGPT, Alpaca, prompt/completion, already tokenized) or a preference pair (TRL's format); a malformed row is a
BadRow naming its file and line."""

from __future__ import annotations

import gzip
import json
import os
from typing import Iterator

from hybrid.errors import ConfigError


# ShareGPT's speakers (and the roles messages use) -> the chat template's roles
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "chatgpt": "assistant", "model": "assistant", "tool": "tool", "function": "tool", "observation": "tool",
         "ipython": "tool"}


class BadRow(ValueError):
    """A row that cannot become a training example; its message names the file and the line."""


def read_rows(path: str) -> Iterator[tuple[str, object]]:
    """(where, row) for every row of a JSONL / JSON-lines file (gzipped if it ends in .gz), a Parquet file or a
    `datasets` directory
    (save_to_disk; its "train" split if it holds several); `where` names the file and the line or row."""
    if os.path.isdir(path):
        yield from _dataset_rows(path)
    elif not os.path.isfile(path):
        raise ConfigError(f"--data-path {path}: no such file or directory (--sft takes JSONL or Parquet files, or "
                          f"a directory saved with datasets' save_to_disk).")
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq  # a dependency of `datasets`; only for Parquet files
        try:
            table = pq.read_table(path)
        except Exception as e:
            raise ConfigError(f"--data-path {path}: not a readable Parquet file ({e}).") from None
        for n, row in enumerate(table.to_pylist()):
            yield f"{path} row {n}", row
    else:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield f"{path} line {n}", BadRow(f"{path} line {n}: not UTF-8 text ({e.reason}); --sft reads "
                                                     f"JSON lines (.jsonl, .jsonl.gz), Parquet or datasets directories")
                    continue
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    yield f"{path} line {n}", BadRow(f"{path} line {n}: not valid JSON ({e.msg} at column {e.colno})")
                    continue
                yield f"{path} line {n}", row


def _dataset_rows(path: str):
    try:
        import datasets  # optional: only for save_to_disk directories
    except ImportError:
        raise ConfigError(f"--data-path {path}: a directory is read as a `datasets` save_to_disk directory, which "
                          f"needs the datasets package: pip install datasets.") from None
    try:
        data = datasets.load_from_disk(path)
    except Exception as e:
        raise ConfigError(f"--data-path {path}: not a directory saved with datasets' save_to_disk ({e}).") from None
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise ConfigError(f"--data-path {path}: a DatasetDict without a 'train' split (it has "
                              f"{', '.join(data)}); save the split to train on alone.")
        data = data["train"]
    for n, row in enumerate(data):
        yield f"{path} row {n}", row


def conversation_of(row, where: str):
    """A row -> ("messages", [{"role", "content"}, ...]) or ("tokens", ids, mask); BadRow if it is none."""
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "input_ids" in row:
        return ("tokens",) + _pre_tokenized(row, where)
    if "messages" in row:
        return "messages", _messages(row["messages"], where, "role", "content")
    if "conversations" in row:
        turns = row["conversations"]
        keys = ("role", "content") if turns and isinstance(turns[0], dict) and "role" in turns[0] else ("from", "value")
        return "messages", _messages(turns, where, *keys)
    if "instruction" in row and "output" in row:
        prompt = str(row["instruction"])
        if row.get("input"):
            prompt += "\n\n" + str(row["input"])
        messages = ([{"role": "system", "content": str(row["system"])}] if row.get("system") else [])
        return "messages", _messages(messages + [{"role": "user", "content": prompt},
                                                 {"role": "assistant", "content": str(row["output"])}],
                                     where, "role", "content")
    if "prompt" in row and "completion" in row:
        prompt = row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
        completion = (row["completion"] if isinstance(row["completion"], list)
                      else [{"role": "assistant", "content": row["completion"]}])
        return "messages", _messages(list(prompt) + list(completion), where, "role", "content")
    raise BadRow(f"{where}: no conversation in the row: expected 'messages', 'conversations', "
                 f"'instruction'/'output', 'prompt'/'completion' or 'input_ids' (it has "
                 f"{', '.join(map(str, row)) or 'no fields'})")


def preference_pair_of(row, where: str) -> tuple:
    """A TRL preference row -> (prompt, chosen, rejected): three strings (TRL's standard format: plain text) or
    three message lists (its conversational format; a string side of a conversational row is one turn, the
    prompt's a user's, an answer's the assistant's); BadRow if it is not one or a side is empty."""
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict) or not all(k in row for k in ("prompt", "chosen", "rejected")):
        keys = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
        raise BadRow(f"{where}: a preference pair needs 'prompt', 'chosen' and 'rejected' (TRL's format; it has "
                     f"{keys})")
    for key in ("prompt", "chosen", "rejected"):
        value = row[key]
        if (value is None or (isinstance(value, (str, list)) and not value)
                or (isinstance(value, str) and not value.strip())):
            raise BadRow(f"{where}: the pair's '{key}' is empty")
    if all(isinstance(row[key], str) for key in ("prompt", "chosen", "rejected")):
        return row["prompt"], row["chosen"], row["rejected"]
    sides = []
    for key, role in (("prompt", "user"), ("chosen", "assistant"), ("rejected", "assistant")):
        value = row[key]
        turns = [{"role": role, "content": value}] if isinstance(value, str) else value
        sides.append(_messages(turns, where, "role", "content", need_assistant=key != "prompt"))
    if sides[0][-1]["role"] == "assistant":
        raise BadRow(f"{where}: the prompt ends with an assistant turn; the answers are 'chosen' and 'rejected'")
    return sides[0], sides[1], sides[2]


def _messages(turns, where: str, role_key: str, content_key: str, need_assistant: bool = True) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise BadRow(f"{where}: the conversation is empty or not a list of turns")
    out = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise BadRow(f"{where}: turn {k} is not an object with '{role_key}' and '{content_key}'")
        role = ROLES.get(str(turn[role_key]).lower())
        if role is None:
            raise BadRow(f"{where}: turn {k} has the unknown role {turn[role_key]!r} (known: "
                         f"{', '.join(sorted(ROLES))})")
        content = turn[content_key]
        if content is None or not isinstance(content, (str, list)):
            raise BadRow(f"{where}: turn {k} ({role}) has no text content")
        out.append({"role": role, "content": content})
    if need_assistant and not any(t["role"] == "assistant" for t in out):
        raise BadRow(f"{where}: the conversation has no assistant turn, so nothing to learn from")
    return out


def _pre_tokenized(row, where: str) -> tuple[list[int], list[bool]]:
    ids = row["input_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise BadRow(f"{where}: 'input_ids' must be a non-empty list of token ids")
    labels = row.get("labels")
    if labels is None:
        return list(ids), [True] * len(ids)
    if not isinstance(labels, list) or len(labels) != len(ids):
        raise BadRow(f"{where}: 'labels' must be a list as long as 'input_ids' ({len(ids)})")
    if any(label != -100 and label != token for label, token in zip(labels, ids)):
        raise BadRow(f"{where}: 'labels' must hold each input id or -100 (no loss), aligned with 'input_ids' as "
                     f"transformers' causal LMs take them (the model shifts them)")
    return list(ids), [label != -100 for label in labels]
