"""Chat fixtures: a real byte-level BPE tokenizer (the embedded one) with Qwen2's ChatML template, tiny Qwen2
models that use it, and conversation files in the formats --sft reads. Nothing from a hub."""

from __future__ import annotations

import json
import random

# Qwen2-Instruct's ChatML template (a default system prompt when none is given), with transformers'
# {% generation %} markers around what the assistant writes: its content and <|im_end|>
CHATML = (
    "{%- for message in messages %}"
    "{%- if loop.first and messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# the same template as Qwen2 ships it: no generation markers
CHATML_PLAIN = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")

WORDS = ("the python language reads code from files and runs each statement in order while a function "
         "returns its value to the caller and a class groups methods with the data they use").split()


def make_chat_tokenizer(path=None, template: str = CHATML):
    """The embedded corpus's BPE with <|im_start|> / <|im_end|> and a ChatML template (Qwen2's tokens: eos
    <|im_end|>, pad <|endoftext|>); saved to `path` when given."""
    from transformers import Qwen2Tokenizer

    from checks.launch_helpers import MERGES, VOCAB
    tok = Qwen2Tokenizer(vocab=VOCAB, merges=MERGES, unk_token=None, bos_token=None, eos_token="<|im_end|>",
                         pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template
    if path is not None:
        tok.save_pretrained(path)
    return tok


def make_chat_model(path, seed: int = 0, **overrides):
    """A tiny Qwen2 (Q/K/V biases, GQA, tied) of the chat tokenizer's vocabulary, saved with the tokenizer."""
    from tests.hf_families import make_family
    tok = make_chat_tokenizer()
    model = make_family("qwen2", path, seed=seed, tokenizer=False, vocab_size=len(tok),
                        eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=tok.pad_token_id, **overrides)
    tok.save_pretrained(path)
    return model, tok


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def conversations(n: int, seed: int = 0, long_every: int = 0) -> list[list[dict]]:
    """`n` conversations of one to three exchanges, some with a system prompt; every `long_every`-th one long."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        turns = [{"role": "system", "content": _sentence(rng, 2, 6)}] if rng.random() < 0.3 else []
        scale = 8 if long_every and k % long_every == long_every - 1 else 1
        for _ in range(rng.randint(1, 3)):
            turns += [{"role": "user", "content": _sentence(rng, 2, 10 * scale)},
                      {"role": "assistant", "content": _sentence(rng, 1, 12 * scale)}]
        out.append(turns)
    return out


def as_row(messages: list[dict], fmt: str) -> dict:
    """One conversation as a row of `fmt`: messages | sharegpt | alpaca (one exchange, optional system)."""
    if fmt == "messages":
        return {"messages": messages}
    if fmt == "sharegpt":
        speaker = {"system": "system", "user": "human", "assistant": "gpt"}
        return {"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in messages]}
    if fmt == "alpaca":
        system = [m["content"] for m in messages if m["role"] == "system"]
        user = next(m["content"] for m in messages if m["role"] == "user")
        answer = next(m["content"] for m in messages if m["role"] == "assistant")
        return dict({"instruction": user, "input": "", "output": answer}, **({"system": system[0]} if system else {}))
    raise ValueError(fmt)


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def preference_rows(n: int, seed: int = 0, style: str = "messages") -> list[dict]:
    """`n` TRL preference rows: the prompt is a conversation up to its last user turn, `chosen` its answer,
    `rejected` another conversation's; as message lists, or (`style` "strings") one user and one answer string."""
    rng = random.Random(seed + 1)
    convs = conversations(n + 1, seed=seed)
    rows = []
    for k in range(n):
        prompt, answer = convs[k][:-1], convs[k][-1]["content"]
        other = convs[(k + 1 + rng.randrange(n)) % (n + 1)][-1]["content"]
        if other == answer:
            other = answer + " " + rng.choice(WORDS)
        if style == "strings":
            user = next(m["content"] for m in reversed(prompt) if m["role"] == "user")
            rows.append({"prompt": user, "chosen": answer, "rejected": other})
        else:
            rows.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": answer}],
                         "rejected": [{"role": "assistant", "content": other}]})
    return rows
