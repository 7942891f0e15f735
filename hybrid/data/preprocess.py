"""JSON lines -> Megatron `.bin/.idx` token files (the logic behind launch/preprocess_data.py).

Lines are read in chunks by the main process, parsed and tokenized by `--workers` processes
(each chunk is one `encode_batch` call, the tokenizer's fast path), and written in input order.
Output goes to temporary names, renamed when complete.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
from itertools import chain
from typing import Optional

import numpy as np

from hybrid.data.indexed import IndexedDatasetBuilder, best_dtype
from hybrid.data.tokenizer import TOKENIZER_TYPES, build_tokenizer
from hybrid.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Tokenize JSON lines into Megatron .bin/.idx files.",
                                allow_abbrev=False)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSON lines file, one document per line")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (one output per key)")
    g.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence (nltk's punkt), documents kept; writes <prefix>_<key>_sentence")
    g.add_argument("--keep-newlines", action="store_true", help="with --split-sentences: newlines stay in sentences")
    g.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed JSON lines")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="GPT2BPETokenizer",
                   choices=TOKENIZER_TYPES + ("HuggingFaceTokenizer", "PretrainedFromHF"))
    g.add_argument("--vocab-file", "--vocab", dest="vocab_file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", "--tokenizer-name-or-path", dest="tokenizer_model", default=None,
                   help="local HF tokenizer directory (HFTokenizer) or SentencePiece .model file")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary size")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token")
    g.add_argument("--lang", default="english", help="accepted for compatibility")
    g = p.add_argument_group("chat data (train.py --sft / --dpo)")
    g.add_argument("--sft", action="store_true",
                   help="--input holds conversations (JSONL, Parquet or a datasets directory, in any format "
                        "train.py --sft reads), tokenized with --tokenizer-model's chat template: writes "
                        "<prefix>_text_document and <prefix>_loss_mask_document (.bin/.idx) and "
                        "<prefix>_text_document.sft.json; train with --sft --data-path <prefix>_text_document")
    g.add_argument("--dpo", action="store_true", help="with --sft: --input holds preference pairs (train.py --dpo)")
    g.add_argument("--sft-train-on-prompt", action="store_true",
                   help="with --sft: every token takes loss (as train.py --sft-train-on-prompt)")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    g.add_argument("--dataset-impl", default="mmap", choices=["mmap"], help="only mmap (Megatron's default)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--partitions", type=int, default=1, choices=[1], help="accepted; only 1")
    g.add_argument("--chunk-size", type=int, default=256, help="documents per worker task")
    g.add_argument("--log-interval", type=int, default=10000, help="documents between progress lines")
    return p


_WORKER: dict = {}


def sentence_splitter(lang: str = "english", keep_newlines: bool = False, log=None):
    """nltk's punkt splitter as Megatron-LM's preprocess_data.py builds it: the trained `lang`
    model when nltk's data has it (offline machines may not: then punkt's untrained defaults,
    and a log line says so), with newlines treated as whitespace unless `keep_newlines`."""
    try:
        # nltk is needed for --split-sentences only (an optional dependency)
        import nltk
        from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer
    except ImportError:
        raise ConfigError("--split-sentences needs nltk: pip install nltk (and, for Megatron's exact splits, "
                          "python -m nltk.downloader punkt).") from None
    try:
        trained = nltk.data.load(f"tokenizers/punkt/{lang}.pickle")
        params = trained._params
    except (LookupError, OSError, ValueError):
        params = None
        if log:
            log(f"nltk's punkt model for {lang!r} is not installed: splitting with punkt's untrained defaults "
                f"(python -m nltk.downloader punkt gives Megatron's exact sentence boundaries)")
    if keep_newlines:
        return PunktSentenceTokenizer(params) if params else PunktSentenceTokenizer()

    class NewlinesAreSpaces(PunktLanguageVars):
        # as Megatron-LM: whitespace after a sentence end may be absent and may contain newlines
        _period_context_fmt = r"""
            \S*
            %(SentEndChars)s
            \s*
            (?=(?P<after_tok>
                %(NonWord)s
                |
                (?P<next_tok>\S+)
            ))"""
    return PunktSentenceTokenizer(params, lang_vars=NewlinesAreSpaces()) if params else \
        PunktSentenceTokenizer(lang_vars=NewlinesAreSpaces())


def _init_worker(tokenizer_kwargs: dict, keys: list[str], append_eod: bool, skip_bad: bool, dtype,
                 split_sentences: bool = False, lang: str = "english", keep_newlines: bool = False) -> None:
    _WORKER.update(tokenizer=build_tokenizer(**tokenizer_kwargs), keys=keys, append_eod=append_eod,
                   skip_bad=skip_bad, dtype=np.dtype(dtype),
                   splitter=sentence_splitter(lang, keep_newlines) if split_sentences else None)


def _encode_documents(texts: list[str]):
    """Texts -> (per document, its list of token sequences), one sequence per document unless
    sentences are split; EOD goes after a document's last sequence. Documents without tokens
    come back as empty lists."""
    w = _WORKER
    splitter = w["splitter"]
    pieces = [splitter.tokenize(t) for t in texts] if splitter else [[t] for t in texts]
    flat = w["tokenizer"].tokenize_batch([p for doc in pieces for p in doc]) if texts else []
    out, k = [], 0
    for doc in pieces:
        sequences = [list(ids) for ids in flat[k:k + len(doc)] if len(ids)]
        k += len(doc)
        if sequences and w["append_eod"]:
            sequences[-1].append(w["tokenizer"].eod)
        out.append(sequences)
    return out


def _encode_chunk(task):
    """(first line number, lines) -> per key (flat tokens, sizes), counts, or an error message."""
    first_line, lines, path = task
    w = _WORKER
    texts = {k: [] for k in w["keys"]}
    bad = empty = 0
    for offset, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if w["skip_bad"]:
                bad += 1
                continue
            return None, f"{path}:{first_line + offset}: malformed JSON ({e}); fix the line or pass --skip-bad-lines."
        for key in w["keys"]:
            if key not in record:
                return None, (f"{path}:{first_line + offset}: no key {key!r} (keys: {sorted(record)}); "
                              f"choose keys with --json-keys.")
            text = record[key]
            if not isinstance(text, str):
                return None, f"{path}:{first_line + offset}: value of {key!r} is {type(text).__name__}, not text."
            texts[key].append(text)
    out = {}
    for key, batch in texts.items():
        sizes, flat, per_doc = [], [], []
        for sequences in _encode_documents(batch):
            if not sequences:
                empty += 1
                continue
            for seq in sequences:
                flat.append(np.asarray(seq, dtype=w["dtype"]))
                sizes.append(len(seq))
            per_doc.append(len(sequences))
        out[key] = (np.concatenate(flat) if flat else np.zeros(0, w["dtype"]), np.asarray(sizes, np.int64),
                    np.asarray(per_doc, np.int64))
    nbytes = sum(len(line) for line in lines)
    return (out, bad, empty // max(1, len(w["keys"])), nbytes), None


def _chunks(path: str, chunk_size: int):
    with open(path, "r", encoding="utf-8") as f:
        lines, first = [], 1
        for number, line in enumerate(f, start=1):
            lines.append(line)
            if len(lines) == chunk_size:
                yield first, lines, path
                lines, first = [], number + 1
        if lines:
            yield first, lines, path


def _init_chat_worker(tokenizer_kwargs: dict, options, source: str) -> None:
    from hybrid.data.chat.template import ChatEncoder  # chat data's modules: only --sft reads chat data
    _WORKER.update(encoder=ChatEncoder(build_tokenizer(**tokenizer_kwargs).to_transformers(), source, options))


def _encode_chat_chunk(rows):
    from hybrid.data.chat.template import encode_rows  # chat data's modules: only --sft reads chat data
    return encode_rows(rows, _WORKER["encoder"])


def _row_chunks(path: str, chunk_size: int):
    from hybrid.data.chat.rows import read_rows  # chat data's modules: only --sft reads chat data
    rows = []
    for item in read_rows(path):
        rows.append(item)
        if len(rows) == chunk_size:
            yield rows
            rows = []
    if rows:
        yield rows


@contextlib.contextmanager
def _ordered_map(workers: int, initializer, initargs):
    """A `map` over tasks whose results come in task order: in this process, or in a pool of `workers` forked
    processes (each set up by `initializer`), ended with the block."""
    if workers <= 1:
        initializer(*initargs)
        yield map
        return
    pool = mp.get_context("fork").Pool(workers, initializer=initializer, initargs=initargs)
    try:
        yield pool.imap
    finally:
        pool.terminate()


@contextlib.contextmanager
def _written(builders):
    """Output files that appear only whole: each builder renames its files in finalize; an error before then
    removes them."""
    try:
        yield
    except BaseException:
        for builder in builders:
            builder.abort()
        raise


def _tokenizer_kwargs(args) -> dict:
    kind = args.tokenizer_type
    if args.sft and kind == "GPT2BPETokenizer" and args.tokenizer_model and not args.vocab_file:
        kind = "HFTokenizer"  # --sft --tokenizer-model DIR: the chat model's tokenizer
    return dict(tokenizer_type=kind, vocab_file=args.vocab_file, merge_file=args.merge_file,
                tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size)


def _check_output(args) -> None:
    if args.workers < 1 or args.chunk_size < 1:
        raise ConfigError("--workers and --chunk-size must be >= 1.")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise ConfigError(f"--output-prefix {args.output_prefix}: directory {out_dir} does not exist.")


def preprocess_chat(args: argparse.Namespace, log=print) -> dict:
    """--sft: conversations (or, with --dpo, preference pairs) through the tokenizer's chat template, as train.py
    --sft tokenizes them (hybrid.data.chat), written as Megatron .bin/.idx files: each sequence a document of
    tokens, beside it the same document of loss-mask bytes, and a description (the tokenizer's fingerprint, the
    options, the counts) that train.py checks. Rows are tokenized by --workers processes in chunks, in order."""
    # chat data's modules: only --sft reads chat data
    from hybrid.data.chat.cache import describe_preprocessed, preprocessed_files
    from hybrid.data.chat.options import ChatOptions
    from hybrid.data.chat.template import ChatEncoder, collect
    if not os.path.exists(args.input):
        raise ConfigError(f"--input {args.input}: no such file or directory.")
    _check_output(args)
    kwargs = _tokenizer_kwargs(args)
    options = ChatOptions(train_on_prompt=args.sft_train_on_prompt, skip_bad=args.skip_bad_lines, pairs=args.dpo)
    source = f"--tokenizer-model {args.tokenizer_model}"
    tokenizer = build_tokenizer(**kwargs)
    encoder = ChatEncoder(tokenizer.to_transformers(), source, options)  # fails fast without a template
    text, mask, description = preprocessed_files(args.output_prefix)
    builders = [IndexedDatasetBuilder(text, best_dtype(tokenizer.vocab_size)), IndexedDatasetBuilder(mask, np.uint8)]
    stats = dict(sequences=0, tokens=0, loss_tokens=0)

    def add(sequences):
        for tokens, loss in sequences:
            builders[0].add_document(tokens)
            builders[1].add_document(np.asarray(loss, dtype=np.uint8))
            stats["sequences"] += 1
            stats["tokens"] += len(tokens)
            stats["loss_tokens"] += int(sum(loss))

    start = time.perf_counter()
    with _written(builders), _ordered_map(args.workers, _init_chat_worker, (kwargs, options, source)) as ordered:
        results = chain.from_iterable(ordered(_encode_chat_chunk, _row_chunks(args.input, args.chunk_size)))
        counts = collect(results, options, f"--input {args.input}", add)
        for builder in builders:
            builder.finalize()
        tmp = f"{description}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(describe_preprocessed(encoder, counts, mask), f, indent=1)
        os.replace(tmp, description)  # last: the files are complete when it exists
    elapsed = time.perf_counter() - start
    stats.update(conversations=counts.conversations, skipped_bad=counts.skipped_bad, seconds=elapsed)
    kind = "preference pairs" if args.dpo else "conversations"
    log(f"done: {counts.conversations} {kind} ({stats['sequences']} sequences, {stats['tokens']} tokens, "
        f"{stats['loss_tokens']} taking loss) in {elapsed:.1f}s ({counts.conversations / elapsed:.0f}/s); skipped "
        f"{counts.skipped_bad} bad rows; wrote {text}.bin/.idx, {mask}.bin/.idx, {description}; train with "
        f"--{'dpo' if args.dpo else 'sft'} --data-path {text}")
    return stats


def preprocess(args: argparse.Namespace, log=print) -> dict:
    """Run the conversion; returns counts and throughput."""
    if args.sft:
        return preprocess_chat(args, log)
    if args.dpo or args.sft_train_on_prompt:
        raise ConfigError("--dpo / --sft-train-on-prompt describe chat data: add --sft.")
    if args.split_sentences:
        sentence_splitter(args.lang, args.keep_newlines, log)  # fail fast without nltk; say which model
    if not os.path.isfile(args.input):
        raise ConfigError(f"--input {args.input}: no such file.")
    _check_output(args)
    tokenizer_kwargs = _tokenizer_kwargs(args)
    tokenizer = build_tokenizer(**tokenizer_kwargs)  # fail fast, in this process, on bad tokenizer flags
    dtype = best_dtype(tokenizer.vocab_size)
    level = "sentence" if args.split_sentences else "document"  # Megatron-LM's output names
    builders = {k: IndexedDatasetBuilder(f"{args.output_prefix}_{k}_{level}", dtype) for k in args.json_keys}
    init = (tokenizer_kwargs, args.json_keys, args.append_eod, args.skip_bad_lines, np.dtype(dtype).str,
            args.split_sentences, args.lang, args.keep_newlines)
    stats = dict(documents=0, skipped_bad_lines=0, skipped_empty=0, tokens=0, bytes=0)
    start = time.perf_counter()
    with _written(builders.values()), _ordered_map(args.workers, _init_worker, init) as ordered:
        results = ordered(_encode_chunk, _chunks(args.input, args.chunk_size))
        next_log = args.log_interval
        for result, error in results:
            if error:
                raise ConfigError(error)
            per_key, bad, empty, nbytes = result
            for key, (flat, sizes, per_doc) in per_key.items():
                builders[key].add_encoded_chunk(flat, sizes, per_doc)
                stats["tokens"] += int(flat.size)
            stats["documents"] += len(next(iter(per_key.values()))[2]) if per_key else 0
            stats["skipped_bad_lines"] += bad
            stats["skipped_empty"] += empty
            stats["bytes"] += nbytes
            if stats["documents"] >= next_log:
                next_log += args.log_interval
                elapsed = time.perf_counter() - start
                log(f"processed {stats['documents']} documents ({stats['documents'] / elapsed:.0f} docs/s, "
                    f"{stats['bytes'] / elapsed / 1e6:.2f} MB/s)")
        if stats["documents"] == 0:
            raise ConfigError(f"--input {args.input}: no non-empty documents found.")
        for builder in builders.values():
            builder.finalize()
    elapsed = time.perf_counter() - start
    stats.update(seconds=elapsed, docs_per_s=stats["documents"] / elapsed, mb_per_s=stats["bytes"] / elapsed / 1e6)
    log(f"done: {stats['documents']} documents, {stats['tokens']} tokens in {elapsed:.1f}s "
        f"({stats['mb_per_s']:.2f} MB/s); skipped {stats['skipped_bad_lines']} malformed lines and "
        f"{stats['skipped_empty']} empty documents; wrote "
        + ", ".join(f"{b.prefix}.bin/.idx" for b in builders.values()))
    return stats


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        preprocess(args, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
