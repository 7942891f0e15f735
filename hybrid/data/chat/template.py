"""The model's chat template: a conversation rendered and tokenized, with the mask of the tokens that take loss
(the `{% generation %}` spans where the template has them, otherwise the assistant messages found in the
rendering: hybrid.data.chat), and preference pairs tokenized as TRL tokenizes them."""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass

import numpy as np

from hybrid.data.chat.options import ChatOptions, Counts
from hybrid.data.chat.rows import BadRow, conversation_of, preference_pair_of
from hybrid.distributed import log
from hybrid.errors import ConfigError


CACHE_VERSION = 3  # 2: assistant spans found in the rendering; 3: preference pairs as TRL 1.16 tokenizes them


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
        h.update(repr((self.options.train_on_prompt, self.options.pairs, self.separator, CACHE_VERSION)).encode())
        return h.hexdigest()[:16]


_MARKER = re.compile("\ue000(\\d+)\ue001")  # a message's place in a rendering (private-use characters)


def _text_of(content) -> str:
    """A message's text: a string, or the text parts of a content list ({"type": "text", "text": ...})."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")


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
