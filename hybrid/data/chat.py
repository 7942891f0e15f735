"""Chat data for supervised fine-tuning (--sft): conversations straight from JSONL, Parquet or a `datasets`
directory, tokenized with the model's own chat template, the loss on the assistant's tokens, packed.

What a row may be (the formats people bring):
- `messages`: [{"role", "content"}, ...] (OpenAI style; ShareGPT converted to messages);
- `conversations`: [{"from", "value"}, ...] (ShareGPT; human -> user, gpt -> assistant);
- `instruction` / `input` / `output` (+ optional `system`): Alpaca, one user turn and one answer;
- `prompt` / `completion` (strings or message lists): TRL's prompt-completion rows;
- `input_ids` (+ `labels` with -100 where no loss is taken): already tokenized.

The loss mask: the template's `{% generation %}` spans where it has them (transformers'
`apply_chat_template(return_assistant_tokens_mask=True)`), otherwise found in the conversation rendered once:
its user and assistant messages located in order in the text (as written, or trimmed as templates trim them),
each assistant message's span its text and the special token the template closes the turn with, the tokens
overlapping a span marked as transformers marks a `{% generation %}` span. This holds for templates that move
or drop the system prompt (Mistral v0.3 folds it into the last user turn, Gemma 3 into the first) or add one
(Qwen2.5), and equals a tagged twin's mask for ChatML, Llama 3, Mistral, Gemma and DeepSeek templates.

Packing: conversations, shuffled by the seed, fill windows of seq_length + 1 tokens in order, each followed by
a separator token that the template never emits; the model's packed-document masks and positions
(--reset-attention-mask / --reset-position-ids, hybrid.model.sequence) split the windows at it, so no token
attends across conversations and each conversation's positions start at 0: the same numbers as the
conversation alone. The separator and the rest of a window take no loss.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from hybrid.data.gpt_dataset import parse_data_path, split_ranges
from hybrid.data.indexed import IndexedDataset
from hybrid.distributed import log
from hybrid.errors import ConfigError

# ShareGPT's speakers (and the roles messages use) -> the chat template's roles
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "chatgpt": "assistant", "model": "assistant", "tool": "tool", "function": "tool", "observation": "tool",
         "ipython": "tool"}
TRUNCATION = ("truncate", "drop")
_CACHE_VERSION = 3  # 2: assistant spans found in the rendering; 3: preference pairs as TRL 1.16 tokenizes them
DPO_TRUNCATION = ("keep_start", "keep_end")


class BadRow(ValueError):
    """A row that cannot become a training example; its message names the file and the line."""


@dataclass(frozen=True)
class ChatOptions:
    """How conversations become training tokens (the --sft-* flags)."""

    train_on_prompt: bool = False  # --sft-train-on-prompt: every token of the conversation takes loss
    truncation: str = "truncate"  # --sft-truncation: a conversation longer than a window is cut ("truncate") or dropped
    skip_bad: bool = False  # --sft-skip-bad: malformed rows are counted and skipped instead of stopping the run
    pairs: bool = False  # --dpo: rows are preference pairs (prompt, chosen, rejected), packed side by side
    # a pair's truncation (TRL's DPOConfig, applied when windows are packed: the tokenized pairs do not depend on it)
    # --dpo-max-length: TRL's max_length, each side's tokens; 0: half a window (seq_length // 2)
    dpo_max_length: int = 0
    dpo_max_prompt_length: int = 0  # --dpo-max-prompt-length: the prompt's last tokens kept first (TRL 0.x); 0: all
    dpo_truncation_mode: str = "keep_start"  # --dpo-truncation-mode: TRL's truncation_mode (keep_start, keep_end)
    stream_buffer: int = 0  # --sft-streaming's shuffle buffer (hybrid.data.chat_stream); 0: the whole file up front


@dataclass
class Counts:
    """What reading and packing did, for the log."""

    conversations: int = 0
    skipped_bad: int = 0
    truncated: int = 0
    dropped: int = 0
    loss_tokens: int = 0
    first_bad: list = field(default_factory=list)

    def merge(self, other: "Counts") -> None:
        for name in ("conversations", "skipped_bad", "truncated", "dropped", "loss_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.first_bad = (self.first_bad + other.first_bad)[:3]


# ---------------------------------------------------------------------------------------------- reading rows

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


# ------------------------------------------------------------------------------------------ chat template

def _common_prefix(ids: list, other: list) -> int:
    """The number of leading tokens two sequences share (TRL's common_prefix_length)."""
    n = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        n += 1
    return n


class ChatEncoder:
    """A HuggingFace tokenizer with a chat template: conversations -> (ids, loss mask), and the separator
    token packed conversations are split at."""

    def __init__(self, tokenizer, source: str, options: ChatOptions = ChatOptions()):
        self.tok, self.options, self.source = tokenizer, options, source
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
        if not template:
            raise ConfigError(f"{source}: the tokenizer has no chat template (tokenizer_config.json / "
                              f"chat_template.jinja), so conversations cannot be rendered as the model expects; use "
                              f"the tokenizer of a chat model or set its chat_template.")
        self.generation_tags = "generation" in template and "{%" in template and "endgeneration" in template
        self.separator = self._separator(source)

    def _render(self, messages, **kwargs):
        return self.tok.apply_chat_template(messages, tokenize=False, **kwargs)

    def _separator(self, source: str) -> int:
        """The first of the pad, end-of-text and other special tokens that the template does not emit for a
        conversation (so it can only mean "a conversation ends here")."""
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                 {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"},
                 {"role": "assistant", "content": "b"}]
        try:
            used = set(self.tok(self._render(probe), add_special_tokens=False)["input_ids"])
        except Exception:  # templates that refuse a system turn (Gemma)
            used = set(self.tok(self._render(probe[1:]), add_special_tokens=False)["input_ids"])
        if self.options.pairs:  # plain-text pairs hold the tokenizer's own BOS and the EOS their answers end with
            used |= {self.tok.bos_token_id, self.tok.eos_token_id}
        # then the tokenizer's other special tokens (Llama 3's <|end_of_text|> and reserved tokens, Mistral's
        # control tokens: special, but not in all_special_ids), in id order
        added = [i for i, t in sorted(getattr(self.tok, "added_tokens_decoder", {}).items()) if t.special]
        candidates = [self.tok.pad_token_id, self.tok.eos_token_id, *self.tok.all_special_ids, *added,
                      self.tok.bos_token_id, self.tok.unk_token_id]
        for token in candidates:
            if token is not None and token not in used:
                return int(token)
        raise ConfigError(f"{source}: every special token of the tokenizer appears in its chat template's output, "
                          f"so none can separate packed conversations. Give the tokenizer a special token its "
                          f"template never writes, one whose id is below the model's vocabulary size (an unused "
                          f"reserved token renamed, or a padding row of the embedding), and save the tokenizer.")

    def encode(self, messages: list[dict], where: str) -> tuple[list[int], list[bool]]:
        """The conversation's token ids and, per token, whether it takes loss."""
        try:
            if self.options.train_on_prompt:
                ids = self.tok(self._render(messages), add_special_tokens=False)["input_ids"]
                return ids, [True] * len(ids)
            if self.generation_tags:
                out = self.tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                   return_assistant_tokens_mask=True)
                return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
            return self._encode_by_messages(messages, where)
        except BadRow:
            raise
        except Exception as e:  # the template's own refusal (raise_exception), e.g. roles out of order
            raise BadRow(f"{where}: the chat template could not render the conversation: {e}") from None

    def encode_pair(self, prompt, chosen, rejected, where: str):
        """[(ids, mask) of prompt + chosen, (ids, mask) of prompt + rejected] as TRL 1.16's DPOTrainer tokenizes a
        pair: message lists rendered by the chat template (the prompt alone with its generation prompt, and the
        prompt followed by each answer), plain text by the tokenizer as it is called by default, each answer's text
        ending with the EOS token (added where it does not). The answer (the mask) is every token after the
        longest prefix the prompt's tokens share with both sides: the template's text after the answer (its turn's
        end) included, as TRL scores it; where the template renders the prompt differently once an answer
        follows, the answer starts where the renderings part, as in TRL."""
        try:
            if isinstance(prompt, str):
                eos = self.tok.eos_token
                if not eos:
                    raise ConfigError(f"{self.source}: plain-text preference pairs end each answer with the "
                                      f"tokenizer's EOS token (as TRL does), and this tokenizer has none; give the "
                                      f"pairs as message lists (rendered by the chat template) or a tokenizer with an "
                                      f"eos_token.")
                texts = [prompt] + [prompt + (a if a.endswith(eos) else a + eos) for a in (chosen, rejected)]
                head, *sides = [list(self.tok(text)["input_ids"]) for text in texts]
            else:
                head, *sides = [list(self.tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                                  add_generation_prompt=generation)["input_ids"])
                                for messages, generation in ((prompt, True), (prompt + chosen, False),
                                                             (prompt + rejected, False))]
        except (BadRow, ConfigError):
            raise
        except Exception as e:  # the template's own refusal (raise_exception)
            raise BadRow(f"{where}: the chat template could not render the pair: {e}") from None
        shared = min(_common_prefix(head, ids) for ids in sides)
        out = []
        for side, ids in zip(("chosen", "rejected"), sides):
            if len(ids) <= shared:
                raise BadRow(f"{where}: the {side} answer has no tokens")
            out.append((ids, [k >= shared for k in range(len(ids))]))
        return out

    def _encode_by_messages(self, messages, where: str) -> tuple[list[int], list[bool]]:
        """Without {% generation %} tags: where the template writes each message is learned by rendering the
        conversation with every content replaced by a marker no template writes (so a template that moves the
        system prompt into a user turn, drops it or adds its own is followed as it is); the real rendering is
        then read along that layout, each content as written or trimmed (as templates trim). An assistant
        message's span is its text and the special token that opens what the template writes after it (the
        turn's end); the tokens overlapping a span take loss, as transformers marks a generation span (from the
        token holding its first character to the one holding its last)."""
        text = self._render(messages)
        layout = re.split(_MARKER, self._render([dict(m, content=f"\ue000{i}\ue001") for i, m in enumerate(messages)]))
        closings = sorted(self._special_texts(), key=len, reverse=True)
        spans, at = [], 0
        for k in range(0, len(layout) - 1, 2):  # boilerplate, message index, boilerplate, ...
            boilerplate, index, after = layout[k], int(layout[k + 1]), layout[k + 2]
            content = _text_of(messages[index]["content"])
            if not text.startswith(boilerplate, at):
                raise BadRow(f"{where}: the chat template writes the conversation differently once its texts are in "
                             f"place (turn {index}), so the assistant's tokens cannot be found; use a template with "
                             f"{{% generation %}} markers")
            at += len(boilerplate)
            written = next((c for c in (content, content.strip()) if text.startswith(c, at)), None)
            if written is None:
                raise BadRow(f"{where}: the chat template does not write turn {index}'s text as given (nor trimmed), "
                             f"so the assistant's tokens cannot be found; use a template with {{% generation %}} "
                             f"markers")
            if messages[index]["role"] == "assistant":
                closing = next((t for t in closings if after.startswith(t)), "")
                spans.append((at, at + len(written) + len(closing)))
            at += len(written)
        encoded = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [any(lo < hi_span and hi > lo_span for lo_span, hi_span in spans)
                for lo, hi in encoded["offset_mapping"]]
        return list(encoded["input_ids"]), mask

    def _special_texts(self) -> list[str]:
        """Every special token's text (a turn ends with one: <|im_end|>, <|eot_id|>, </s>, <end_of_turn>, ...)."""
        added = [t.content for t in getattr(self.tok, "added_tokens_decoder", {}).values() if t.special]
        return [t for t in {*self.tok.all_special_tokens, *added} if t]

    def fingerprint(self) -> str:
        """What the tokens depend on: the tokenizer, its template and the options."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        h = hashlib.sha256(backend.to_str().encode() if backend is not None else repr(self.tok.get_vocab()).encode())
        h.update(str(self.tok.chat_template).encode())
        h.update(repr((self.options.train_on_prompt, self.options.pairs, self.separator, _CACHE_VERSION)).encode())
        return h.hexdigest()[:16]


_MARKER = re.compile("\ue000(\\d+)\ue001")  # a message's place in a rendering (private-use characters)


def _text_of(content) -> str:
    """A message's text: a string, or the text parts of a content list ({"type": "text", "text": ...})."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")


# ------------------------------------------------------------------------------ tokenized conversations

@dataclass
class Tokenized:
    """Every conversation of a file, tokenized: flat ids and loss mask, with offsets per conversation."""

    ids: np.ndarray  # [total] int32
    mask: np.ndarray  # [total] bool
    offsets: np.ndarray  # [n + 1] int64
    counts: Counts
    group: int = 1  # sequences per unit: 1 (a conversation), 2 (a preference pair: chosen, rejected)

    def __len__(self) -> int:
        """The number of units (conversations or pairs)."""
        return (len(self.offsets) - 1) // self.group

    def conversation(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[k], self.offsets[k + 1]
        return self.ids[lo:hi], self.mask[lo:hi]

    def unit(self, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        return [self.conversation(k * self.group + j) for j in range(self.group)]


def encode_row(row, where: str, encoder: ChatEncoder) -> list[tuple[list[int], list[bool]]]:
    """One row -> its token sequences and loss masks (a conversation: one; a preference pair: chosen, rejected);
    BadRow, naming `where`, for a row that cannot be one."""
    if encoder.options.pairs:
        sequences = encoder.encode_pair(*preference_pair_of(row, where), where)
    else:
        kind, *rest = conversation_of(row, where)
        sequences = [rest if kind == "tokens" else encoder.encode(rest[0], where)]
    for tokens, loss in sequences:
        if encoder.separator in tokens:
            raise BadRow(f"{where}: the conversation holds token {encoder.separator} "
                         f"({encoder.tok.convert_ids_to_tokens(encoder.separator)!r}), which separates packed "
                         f"conversations")
        if not any(loss):
            raise BadRow(f"{where}: no token of the conversation takes loss (no assistant content)")
    return sequences


def encode_rows(rows, encoder: ChatEncoder) -> list:
    """(where, row) pairs -> (where, sequences, or the BadRow's message) each, in order (a worker's chunk)."""
    out = []
    for where, row in rows:
        try:
            out.append((where, encode_row(row, where, encoder)))
        except BadRow as e:
            out.append((where, str(e)))
    return out


def collect(encoded, options: ChatOptions, source: str, add) -> Counts:
    """Encoded rows (encode_rows' pairs, in file order; `source`: the flag and file, for messages) ->
    `add(sequences)` for each usable one; a bad row stops
    with one message, or is counted with --sft-skip-bad; a log line every 10 seconds with the rate."""
    counts = Counts()
    start = last = time.time()
    for _, sequences in encoded:
        if isinstance(sequences, str):
            if not options.skip_bad:
                raise ConfigError(f"{sequences} (--sft-skip-bad counts and skips such rows)")
            counts.skipped_bad += 1
            counts.first_bad = (counts.first_bad + [sequences])[:3]
            continue
        add(sequences)
        counts.conversations += 1
        if time.time() - last > 10:
            last = time.time()
            log(f"sft: {source}: {counts.conversations} conversations tokenized "
                f"({counts.conversations / (last - start):.0f}/s)")
    if counts.conversations == 0:
        raise ConfigError(f"{source}: no usable conversation ({counts.skipped_bad} bad rows skipped"
                          f"{': ' + counts.first_bad[0] if counts.first_bad else ''}).")
    return counts


def tokenize_file(path: str, encoder: ChatEncoder) -> Tokenized:
    """Every conversation of `path`, tokenized in this process (bad rows stop the run, or are counted with
    --sft-skip-bad)."""
    ids, mask, offsets = [], [], [0]

    def add(sequences):
        for tokens, loss in sequences:
            ids.extend(tokens)
            mask.extend(loss)
            offsets.append(len(ids))

    counts = collect((encode_rows([item], encoder)[0] for item in read_rows(path)), encoder.options,
                     f"--data-path {path}", add)
    return Tokenized(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool),
                     np.asarray(offsets, dtype=np.int64), counts, 2 if encoder.options.pairs else 1)


# --------------------------------------------------- preprocessed files (launch/preprocess_data.py --sft)

PREPROCESSED_SUFFIX = ".sft.json"  # beside <prefix>_text_document.bin/.idx: what they hold and how they were made


def preprocessed_files(prefix: str) -> tuple[str, str, str]:
    """The files launch/preprocess_data.py --sft writes for `--output-prefix prefix`: the tokens' and the loss
    masks' .bin/.idx prefixes (Megatron's indexed format, one document a sequence) and the description."""
    text = f"{prefix}_text_document"
    return text, f"{prefix}_loss_mask_document", text + PREPROCESSED_SUFFIX


def is_preprocessed(path: str) -> bool:
    """`--data-path` names a `<prefix>_text_document` that preprocess_data.py --sft wrote."""
    return os.path.isfile(path + PREPROCESSED_SUFFIX)


def describe_preprocessed(encoder: ChatEncoder, counts: Counts, mask_prefix: str) -> dict:
    return {"format": "hybrid-sft", "version": _CACHE_VERSION, "fingerprint": encoder.fingerprint(),
            "pairs": encoder.options.pairs, "train_on_prompt": encoder.options.train_on_prompt,
            "mask": os.path.basename(mask_prefix), "counts": counts.__dict__}


def load_preprocessed(path: str, encoder: ChatEncoder) -> Tokenized:
    """The conversations of `<prefix>_text_document` (tokens) and its loss masks, memory-mapped; refused when
    they were made with another tokenizer, chat template or option than the run's."""
    with open(path + PREPROCESSED_SUFFIX) as f:
        meta = json.load(f)
    made = "launch/preprocess_data.py --sft" + (" --dpo" if meta.get("pairs") else "") + (
        " --sft-train-on-prompt" if meta.get("train_on_prompt") else "")
    if meta.get("pairs") != encoder.options.pairs:
        wanted = "(--dpo) trains on preference pairs" if encoder.options.pairs else "(--sft) trains on conversations"
        raise ConfigError(f"--data-path {path}: made by {made}, which holds "
                          f"{'preference pairs' if meta.get('pairs') else 'conversations'}; this run {wanted}.")
    if meta.get("fingerprint") != encoder.fingerprint():
        raise ConfigError(f"--data-path {path}: made by {made} with another tokenizer, chat template or "
                          f"--sft-train-on-prompt than this run's {encoder.source}; preprocess it again with the "
                          f"run's tokenizer and options.")
    tokens = IndexedDataset(path)
    masks = IndexedDataset(os.path.join(os.path.dirname(path), meta["mask"]))
    if not np.array_equal(tokens.sizes, masks.sizes):
        raise ConfigError(f"--data-path {path}: its loss masks {masks.prefix} do not match its sequences; "
                          f"preprocess it again.")
    offsets = np.concatenate([[0], np.cumsum(tokens.sizes, dtype=np.int64)])
    ids, mask = tokens.flat(), masks.flat().view(bool)
    return Tokenized(ids, mask, offsets, Counts(**meta["counts"]), 2 if encoder.options.pairs else 1)


def load_tokenized(path: str, encoder: ChatEncoder) -> Tokenized:
    """`path`'s conversations: preprocessed files as they are, any other file tokenized here."""
    return load_preprocessed(path, encoder) if is_preprocessed(path) else tokenize_file(path, encoder)


def _signature(path: str) -> list:
    """The files' names, sizes and modification times (a directory's every file)."""
    files = [path] if os.path.isfile(path) else sorted(os.path.join(root, name) for root, _, names in os.walk(path)
                                                       for name in names)
    return [(os.path.relpath(f, path), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]


def cached_tokenize(path: str, encoder: ChatEncoder, cache_dir: Optional[str] = None) -> Tokenized:
    """tokenize_file, once: rank 0 tokenizes and writes `<cache>/<name>.<fingerprint>.sft.npz` (beside the file
    or directory, or in --data-cache-path), the other ranks wait and read it; a changed file, tokenizer, template or
    option makes another key."""
    if is_preprocessed(path):  # launch/preprocess_data.py --sft's files: read as they are
        return load_preprocessed(path, encoder)
    key = hashlib.sha256(repr((os.path.abspath(path), _signature(path),
                               encoder.fingerprint())).encode()).hexdigest()[:16]
    base = cache_dir or os.path.dirname(os.path.abspath(os.path.normpath(path)))
    cache = os.path.join(base, f"{os.path.basename(os.path.normpath(path))}.{key}.sft.npz")
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0 and not os.path.exists(cache):
        data = tokenize_file(path, encoder)
        os.makedirs(base, exist_ok=True)
        tmp = f"{cache}.{os.getpid()}.tmp.npz"
        np.savez(tmp, ids=data.ids, mask=data.mask, offsets=data.offsets,
                 counts=np.frombuffer(json.dumps(data.counts.__dict__).encode(), dtype=np.uint8))
        os.replace(tmp, cache)
    if dist.is_initialized():
        dist.barrier()
    else:  # before the process group exists (--train-epochs): wait for rank 0's file
        deadline = time.time() + float(os.environ.get("HYBRID_SFT_CACHE_WAIT_S", "3600"))
        while not os.path.exists(cache):
            if time.time() > deadline:
                raise ConfigError(f"--data-path {path}: rank 0 did not write the tokenized cache {cache} in time.")
            time.sleep(0.5)
    with np.load(cache, allow_pickle=False) as f:
        return Tokenized(f["ids"], f["mask"], f["offsets"], Counts(**json.loads(bytes(f["counts"]).decode())),
                         2 if encoder.options.pairs else 1)


# ------------------------------------------------------------------------------------------------- packing

def pack_units(units, width: int, separator: int, options: ChatOptions, counts: Counts) -> Iterator[tuple]:
    """Units (each a list of (ids, loss mask) sequences: a conversation, or a preference pair's two sides) packed
    in the order given into windows of `width` tokens (seq_length + 1), each sequence followed by the separator;
    the rest of a window is separators. Yields (tokens [width] int32, loss mask [width] bool) as each window is
    full. A conversation longer than `width` is truncated to it or dropped (--sft-truncation); a pair is cut as
    TRL cuts it (`pair_as_trl`). Counted in `counts`."""
    tokens = np.full(width, separator, dtype=np.int32)
    mask = np.zeros(width, dtype=bool)
    fill = 0
    for unit in units:
        if options.pairs:
            unit = pair_as_trl(unit, width, options, counts)
            if unit is None:
                continue
        size = sum(len(ids) for ids, _ in unit) + len(unit) - 1
        if size > width:
            if options.truncation == "drop":
                counts.dropped += 1
                continue
            counts.truncated += 1
            unit = [(ids[:width], loss[:width]) for ids, loss in unit]
            if not unit[0][1][1:].any():  # nothing left to learn from
                counts.dropped += 1
                continue
            size = width
        if fill and fill + 1 + size > width:  # does not fit after a separator: the next window
            yield tokens, mask
            tokens, mask, fill = np.full(width, separator, dtype=np.int32), np.zeros(width, dtype=bool), 0
        for ids, loss in unit:
            start = fill + 1 if fill else 0
            tokens[start:start + len(ids)] = ids
            mask[start:start + len(ids)] = loss
            mask[start] = False  # a sequence's first token is never predicted (as in transformers)
            fill = start + len(ids)
            counts.loss_tokens += int(mask[start:fill].sum())
    if fill:
        yield tokens, mask


def pair_max_length(options: ChatOptions, width: int) -> int:
    """Each side's most tokens (TRL's max_length): --dpo-max-length, or half a window (both sides and the
    separator between them fit in one window of `width` = seq_length + 1 tokens)."""
    return options.dpo_max_length or (width - 1) // 2


def truncation_rule(options: ChatOptions, width: int) -> str:
    """The rule that cut or dropped units, for the log and messages."""
    if not options.pairs:
        return f"--sft-truncation {options.truncation}"
    prompt = f", the prompt to its last {options.dpo_max_prompt_length}" if options.dpo_max_prompt_length else ""
    return (f"TRL's truncation: --dpo-truncation-mode {options.dpo_truncation_mode} at "
            f"{pair_max_length(options, width)} tokens a side{prompt}")


def pair_as_trl(unit, width: int, options: ChatOptions, counts: Counts):
    """A tokenized preference pair [(ids, mask) chosen, (ids, mask) rejected], its mask every token after the shared
    prompt, cut as TRL cuts it: with --dpo-max-prompt-length P the prompt keeps its last P tokens (TRL 0.x's
    max_prompt_length); then each side is cut to max_length tokens (`pair_max_length`) from its end (keep_start)
    or its start (keep_end), as TRL 1.16's DataCollatorForPreference; under keep_start a pair whose prompt alone
    has max_length tokens or more is dropped, as TRL's DPOTrainer drops it. None for a dropped pair (counted)."""
    limit = pair_max_length(options, width)
    prompt = int(np.argmax(np.asarray(unit[0][1])))  # the shared prompt's length: where the answer's mask starts
    cut = max(0, prompt - options.dpo_max_prompt_length) if options.dpo_max_prompt_length else 0
    prompt -= cut
    if options.dpo_truncation_mode == "keep_start" and prompt >= limit:
        counts.dropped += 1
        return None
    keep = slice(None, limit) if options.dpo_truncation_mode == "keep_start" else slice(-limit, None)
    out = [(ids[cut:][keep], loss[cut:][keep]) for ids, loss in unit]
    if cut or any(len(ids) - cut > limit for ids, _ in unit):
        counts.truncated += 1
    return out


def pack(data: Tokenized, order, width: int, separator: int, options: ChatOptions, counts: Counts
         ) -> tuple[np.ndarray, np.ndarray]:
    """The units of `data` in `order` packed (pack_units) -> tokens [n, width] int32, loss mask [n, width] bool."""
    windows = list(pack_units((data.unit(int(k)) for k in order), width, separator, options, counts))
    if not windows:
        return np.zeros((0, width), dtype=np.int32), np.zeros((0, width), dtype=bool)
    return np.stack([t for t, _ in windows]), np.stack([m for _, m in windows])


class ChatDataset(torch.utils.data.Dataset):
    """Packed windows served `num_samples` times in all: epoch e is every window once, in an order drawn from
    the seed and e (so a run resumed at `consumed_samples` continues at exactly the next window)."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, num_samples: int, seed: int, shuffle: bool = True):
        self.tokens, self.mask, self.num_samples, self.seed, self.shuffle = tokens, mask, num_samples, seed, shuffle
        self._orders = {}
        self.reference_logps: Optional[np.ndarray] = None  # --dpo-reference-logps: [windows, documents] sums

    @property
    def windows(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return self.num_samples

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.RandomState(self.seed + 1 + epoch).permutation(self.windows)
                            if self.shuffle else np.arange(self.windows)}
        return self._orders[epoch]

    def __getitem__(self, index: int) -> dict:
        epoch, k = divmod(int(index), self.windows)
        w = self._order(epoch)[k]
        sample = {"text": torch.from_numpy(self.tokens[w].astype(np.int64)),
                  "loss_mask": torch.from_numpy(self.mask[w])}
        if self.reference_logps is not None:
            sample["reference_logps"] = torch.from_numpy(self.reference_logps[w])
        return sample


def split_datasets(path: str, ranges_of, num_samples, seq_length: int, seed: int, encoder: ChatEncoder,
                   cache_dir: Optional[str] = None) -> list[Optional[ChatDataset]]:
    """One ChatDataset per split of one file (conversation ranges from `ranges_of(n)`, as --split divides
    documents); each split's conversations shuffled by the seed, then packed. None where a split is empty."""
    data = cached_tokenize(path, encoder, cache_dir)
    out, counts = [], Counts(conversations=len(data), skipped_bad=data.counts.skipped_bad)
    for name, (start, stop), wanted in zip(("train", "valid", "test"), ranges_of(len(data)), num_samples):
        if stop <= start or wanted <= 0:
            out.append(None)
            continue
        order = start + np.random.RandomState(seed).permutation(stop - start)
        split_counts = Counts()
        tokens, mask = pack(data, order, seq_length + 1, encoder.separator, encoder.options, split_counts)
        counts.merge(Counts(truncated=split_counts.truncated, dropped=split_counts.dropped))
        if len(tokens) == 0:
            raise ConfigError(f"--data-path {path}: the {name} split has no conversation left after "
                              f"{truncation_rule(encoder.options, seq_length + 1)} at --seq-length {seq_length}.")
        fill = float((tokens != encoder.separator).mean())
        log(f"sft: {path} {name}: {stop - start} conversations -> {len(tokens)} windows of {seq_length + 1} tokens "
            f"({fill:.0%} filled, {split_counts.loss_tokens} loss tokens)")
        out.append(ChatDataset(tokens, mask, wanted, seed))
    log(f"sft: {path}: {counts.conversations} conversations, {counts.skipped_bad} bad rows skipped, "
        f"{counts.truncated} truncated, {counts.dropped} dropped ({truncation_rule(encoder.options, seq_length + 1)})")
    return out


def train_windows(data_config, seq_length: int, seed: int, encoder: ChatEncoder) -> int:
    """How many packed windows one epoch of the training conversations is (for --train-epochs): the train
    split of --data-path (one file) or all of --train-data-path, packed exactly as split_datasets packs it."""
    own = (data_config.split_data_paths or (None,))[0]
    paths, weights = parse_data_path(own or data_config.data_path, "--train-data-path" if own else "--data-path")
    if weights is not None and len(paths) > 1:
        raise ConfigError("--train-epochs counts the passes over one file's conversations; with a weighted blend "
                          "of several give --train-iters or --train-samples.")
    data = cached_tokenize(paths[0], encoder, data_config.data_cache_path)
    start, stop = ((0, len(data)) if own
                   else split_ranges(data_config.split, len(data), data_config.legacy_data_rules)[0])
    order = start + np.random.RandomState(seed).permutation(stop - start)
    tokens, _ = pack(data, order, seq_length + 1, encoder.separator, encoder.options, Counts())
    return len(tokens)


def evaluation_windows(path: str, seq_length: int, encoder: ChatEncoder) -> tuple[np.ndarray, np.ndarray, Counts]:
    """Every conversation of `path` once, in file order, packed (launch/evaluate.py --sft)."""
    data = load_tokenized(path, encoder)
    counts = Counts(conversations=len(data), skipped_bad=data.counts.skipped_bad)
    tokens, mask = pack(data, range(len(data)), seq_length + 1, encoder.separator, encoder.options, counts)
    return tokens, mask, counts
