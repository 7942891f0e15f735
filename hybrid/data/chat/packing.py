"""Packing: conversations (or preference pairs side by side) fill windows of seq_length + 1 tokens in order, each
followed by the separator; too long ones are truncated or dropped (--sft-truncation; for pairs TRL's rules)."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from hybrid.data.chat.options import ChatOptions, Counts
from hybrid.data.chat.template import Tokenized


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
