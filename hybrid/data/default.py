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
import re
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
    """Write corpus.jsonl.gz and train the BPE tokenizer on it (vocab.json, merges.txt)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    documents = collect_corpus()
    with gzip.GzipFile(out_dir / "corpus.jsonl.gz", "wb", mtime=0) as f:
        for doc in documents:
            f.write((json.dumps({"text": doc}) + "\n").encode())
    tokenizer = ByteLevelBPETokenizer(add_prefix_space=False)
    tokenizer.train_from_iterator(documents, vocab_size=VOCAB_SIZE, min_frequency=2,
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.save_model(str(out_dir))


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
    print(f"wrote {ASSETS}")
