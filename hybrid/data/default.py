"""The embedded default corpus and tokenizer, so `python launch/train.py` trains with no download.

Shipped in `hybrid/data/default/`: `corpus.jsonl.gz`, about 1.5 MB of real English prose from
CPython's own documentation (the `pydoc_data` help topics and the standard library's
docstrings; PSF licence), and a byte-level BPE tokenizer trained on it with `tokenizers`,
written as GPT-2-format `vocab.json` / `merges.txt`. `python -m hybrid.data.default` rebuilds
those files; the token files are made on first use into a cache directory.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import os
import pathlib
import random
import re
import shutil
import sys

from tokenizers import ByteLevelBPETokenizer

from hybrid.data.indexed import IndexedDatasetBuilder, best_dtype
from hybrid.data.tokenizer import GPT2BPETokenizer

ASSETS = pathlib.Path(__file__).with_name("default")
CORPUS = ASSETS / "corpus.jsonl.gz"
VOCAB = ASSETS / "vocab.json"
MERGES = ASSETS / "merges.txt"
VOCAB_SIZE = 8192
_MAX_BYTES = 1_500_000


def _paragraph_documents(text: str, target: int = 2000):
    """Split long text into documents of about `target` characters on blank lines."""
    doc, size = [], 0
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if not para:
            continue
        doc.append(para)
        size += len(para)
        if size >= target:
            yield "\n\n".join(doc)
            doc, size = [], 0
    if doc:
        yield "\n\n".join(doc)


def _stdlib_docstrings():
    """Module, class and function docstrings of the standard library, in a fixed order."""
    stdlib = pathlib.Path(os.__file__).parent
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        parts = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    parts.append(doc)
        if parts:
            yield "\n\n".join(parts)


def collect_corpus() -> list[str]:
    """Documents from this Python's documentation, at most about 1.5 MB."""
    import pydoc_data.topics  # the corpus' source, read once when the corpus is built
    documents, total = [], 0
    sources = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    sources += list(_stdlib_docstrings())
    for text in sources:
        for doc in _paragraph_documents(text):
            if total + len(doc) > _MAX_BYTES:
                return documents
            documents.append(doc)
            total += len(doc)
    return documents


def build_assets(out_dir: pathlib.Path = ASSETS) -> None:
    """Write corpus.jsonl.gz and train the BPE tokenizer on it (vocab.json, merges.txt) (and, with
    build_chat_asset, the --sft tutorial's chat.jsonl.gz)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    documents = collect_corpus()
    with gzip.GzipFile(out_dir / "corpus.jsonl.gz", "wb", mtime=0) as f:
        for doc in documents:
            f.write((json.dumps({"text": doc}) + "\n").encode())
    tokenizer = ByteLevelBPETokenizer(add_prefix_space=False)
    tokenizer.train_from_iterator(documents, vocab_size=VOCAB_SIZE, min_frequency=2,
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.save_model(str(out_dir))


CHAT = ASSETS / "chat.jsonl.gz"
CHAT_SYSTEM = "You answer questions about Python briefly."
_QUESTIONS = {"topic": ("Explain {} in Python.", "How does {} work in Python?", "What should I know about {}?"),
              "module": ("What is the {} module for?", "What does Python's {} module do?", "Tell me about {}."),
              "function": ("What does {} do?", "Explain {}.", "What is {} in the standard library?")}
_ANSWER_CHARS = 360


def _answer(text: str) -> str:
    """The first paragraphs of a documentation text, at most about _ANSWER_CHARS, ending at a sentence."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip() and not p.startswith("*")]
    out = ""
    for para in paragraphs:
        if out and len(out) + len(para) > _ANSWER_CHARS:
            break
        out = f"{out}\n\n{para}" if out else para
    if len(out) > _ANSWER_CHARS:
        cut = out[:_ANSWER_CHARS]
        out = cut[:cut.rfind(". ") + 1] if ". " in cut else cut
    return out.strip()


def _questions_and_answers():
    """(kind, subject, answer) from the help topics, module docstrings and function/class docstrings."""
    import pydoc_data.topics  # the chat set's source, read once when it is built
    for key in sorted(pydoc_data.topics.topics):
        text = pydoc_data.topics.topics[key]
        title, _, body = text.partition("\n")
        body = body.lstrip("*\n")
        if title.strip() and _answer(body):
            yield "topic", title.strip(), _answer(body)
    stdlib = pathlib.Path(os.__file__).parent
    for path in sorted(stdlib.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        doc = ast.get_docstring(tree)
        if doc and len(doc) > 80:
            yield "module", f"`{path.stem}`", _answer(doc)
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 60:
                    yield "function", f"`{path.stem}.{node.name}`", _answer(doc)


def collect_chat(limit: int = 1500) -> list[list[dict]]:
    """Conversations about Python from its own documentation (one or two exchanges, some with a system
    prompt), for the --sft tutorial; deterministic."""
    rng = random.Random(0)
    pairs = [(rng.choice(_QUESTIONS[kind]).format(subject), answer) for kind, subject, answer in
             _questions_and_answers() if answer]
    rng.shuffle(pairs)
    conversations, k = [], 0
    while k < len(pairs) and len(conversations) < limit:
        turns = [{"role": "system", "content": CHAT_SYSTEM}] if rng.random() < 0.3 else []
        for question, answer in pairs[k:k + (2 if rng.random() < 0.25 else 1)]:
            turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            k += 1
        conversations.append(turns)
    return conversations


def build_chat_asset(out_dir: pathlib.Path = ASSETS) -> None:
    """Write chat.jsonl.gz (messages rows)."""
    with gzip.GzipFile(out_dir / "chat.jsonl.gz", "wb", mtime=0) as f:
        for messages in collect_chat():
            f.write((json.dumps({"messages": messages}) + "\n").encode())


# ChatML (Qwen2's template) with transformers' {% generation %} markers around what the assistant writes
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def default_chat_tokenizer() -> str:
    """A transformers tokenizer directory: the embedded BPE with ChatML's <|im_start|> / <|im_end|> and
    template (eos <|im_end|>, pad <|endoftext|>), made on first use (atomically) in the cache."""
    directory = cache_dir() / "chat-tokenizer"
    if (directory / "tokenizer_config.json").exists():
        return str(directory)
    from transformers import GPT2TokenizerFast  # transformers' import takes seconds: the --sft tutorial only
    tok = GPT2TokenizerFast(vocab=str(VOCAB), merges=str(MERGES), eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            bos_token=None, unk_token=None)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML_TEMPLATE
    tmp = directory.with_name(f"chat-tokenizer.{os.getpid()}")
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, directory)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(directory)


def read_corpus() -> list[str]:
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def cache_dir() -> pathlib.Path:
    root = os.environ.get("HYBRID_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hybrid")
    digest = hashlib.sha256(CORPUS.read_bytes() + VOCAB.read_bytes()).hexdigest()[:12]
    return pathlib.Path(root) / f"default-{digest}"


def default_data_prefix() -> str:
    """Prefix of the default corpus's .bin/.idx, tokenized on first use (atomically)."""
    directory = cache_dir()
    prefix = str(directory / "corpus_text_document")
    if os.path.exists(prefix + ".idx") and os.path.exists(prefix + ".bin"):
        return prefix
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = GPT2BPETokenizer(str(VOCAB), str(MERGES))
    # A private prefix per process, renamed at the end: concurrent first uses cannot clash.
    tmp_prefix = str(directory / f"corpus_text_document.{os.getpid()}")
    builder = IndexedDatasetBuilder(tmp_prefix, best_dtype(tokenizer.vocab_size))
    for ids in tokenizer.tokenize_batch(read_corpus()):
        builder.add_document(ids + [tokenizer.eod])
    builder.finalize()
    os.replace(tmp_prefix + ".bin", prefix + ".bin")
    os.replace(tmp_prefix + ".idx", prefix + ".idx")
    return prefix


if __name__ == "__main__":
    build_assets(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ASSETS)
    build_chat_asset(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ASSETS)
    print(f"wrote {ASSETS}")
