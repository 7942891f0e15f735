"""Tokenizers named as Megatron-LM's --tokenizer-type, all backed by HF's fast `tokenizers`.

GPT2BPETokenizer: GPT-2-format vocab.json + merges.txt (byte-level BPE, GPT-2's pre-tokenizer);
HFTokenizer: any local transformers tokenizer directory (--tokenizer-model);
NullTokenizer: ids are given directly (--vocab-size N; the end-of-document id is N, as Megatron);
GPTSentencePieceTokenizer / SentencePieceTokenizer / Llama2Tokenizer: a SentencePiece `.model`
file (--tokenizer-model), through the `sentencepiece` package, as Megatron-LM encodes with them.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, pre_tokenizers
from tokenizers.models import BPE

from hybrid.errors import ConfigError

EOD_TOKEN = "<|endoftext|>"


class Tokenizer:
    """The interface the data pipeline and the model need."""

    name = "base"
    vocab_size: int
    eod: int

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def detokenize(self, ids) -> str:
        raise NotImplementedError


class GPT2BPETokenizer(Tokenizer):
    """Byte-level BPE from GPT-2-format files."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path:
                raise ConfigError(f"GPT2BPETokenizer needs {flag} (GPT-2-format vocab.json / merges.txt).")
            if not os.path.isfile(path):
                raise ConfigError(f"{flag} {path}: no such file.")
        try:
            model = BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # malformed JSON or merges
            raise ConfigError(f"could not read --vocab-file {vocab_file} / --merge-file {merge_file} as "
                              f"GPT-2 BPE files: {e}") from None
        tok = RustTokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        self._tok = tok
        self.vocab_file, self.merge_file = vocab_file, merge_file
        self.vocab_size = tok.get_vocab_size()
        eod = tok.token_to_id(EOD_TOKEN)
        if eod is None:
            raise ConfigError(f"--vocab-file {vocab_file} has no {EOD_TOKEN!r} token (needed as end of document).")
        self.eod = eod

    def tokenize_batch(self, texts):
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids) -> str:
        return self._tok.decode(list(ids))

    def to_transformers(self):
        """A transformers GPT2TokenizerFast over the same files (for export)."""
        from transformers import GPT2TokenizerFast  # transformers' import takes seconds: only for exports

        # transformers 5 takes the file paths as vocab=/merges=; the old vocab_file=/merges_file=
        # keywords are silently ignored there and give a tokenizer that encodes everything to [].
        tok = GPT2TokenizerFast(vocab=self.vocab_file, merges=self.merge_file)
        if not tok("hello world")["input_ids"]:
            raise RuntimeError("GPT2TokenizerFast built from the vocab/merges files encodes nothing")
        return tok


class HFTokenizer(Tokenizer):
    """A local transformers tokenizer directory (no hub access)."""

    name = "HFTokenizer"

    def __init__(self, path: str):
        if not path or not os.path.isdir(path):
            raise ConfigError(f"--tokenizer-model {path!r}: expected a local tokenizer directory "
                              f"(made by tokenizer.save_pretrained).")
        from transformers import AutoTokenizer  # transformers' import takes seconds: HFTokenizer only
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:
            raise ConfigError(f"--tokenizer-model {path}: could not load a tokenizer: {e}") from None
        self.path = path
        self.vocab_size = len(self._tok)
        eod = self._tok.eos_token_id
        if eod is None and EOD_TOKEN in self._tok.get_vocab():
            eod = self._tok.convert_tokens_to_ids(EOD_TOKEN)
        if eod is None:
            raise ConfigError(f"--tokenizer-model {path}: the tokenizer has no eos token to end documents.")
        self.eod = eod

    def tokenize_batch(self, texts):
        return self._tok(texts, add_special_tokens=False)["input_ids"]

    def detokenize(self, ids) -> str:
        return self._tok.decode(list(ids))

    def to_transformers(self):
        return self._tok


class NullTokenizer(Tokenizer):
    """Text is a whitespace-separated list of ids; vocabulary N plus an end-of-document id N."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int):
        if not vocab_size or vocab_size < 1:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size N (N >= 1).")
        self.eod = vocab_size
        self.vocab_size = vocab_size + 1

    def tokenize_batch(self, texts):
        return [[int(t) for t in text.split()] for text in texts]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (Llama, Llama-2 and many Megatron-DeepSpeed runs).

    GPTSentencePieceTokenizer / SentencePieceTokenizer encode text as the model's ids with no
    added tokens; Llama2Tokenizer puts BOS first (Megatron-LM's `tokenize(text, bos=True)`).
    EOD is the model's EOS id."""

    def __init__(self, model_file: Optional[str], name: str = "GPTSentencePieceTokenizer"):
        if not model_file or not os.path.isfile(model_file):
            raise ConfigError(f"--tokenizer-type {name} needs --tokenizer-model FILE.model (a SentencePiece "
                              f"model); got {model_file!r}.")
        try:
            import sentencepiece  # SentencePiece tokenizers only
        except ImportError:
            raise ConfigError(f"--tokenizer-type {name} needs the sentencepiece package: "
                              f"pip install sentencepiece.") from None
        self.name = name
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self._sp.vocab_size()
        self.eod = self._sp.eos_id()
        self.bos = self._sp.bos_id()
        if self.eod < 0:
            raise ConfigError(f"--tokenizer-model {model_file}: the SentencePiece model has no EOS piece "
                              f"to end documents with.")

    def tokenize_batch(self, texts):
        ids = self._sp.encode(list(texts))
        if self.name == "Llama2Tokenizer":
            return [[self.bos] + list(x) for x in ids]
        return [list(x) for x in ids]

    def detokenize(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


SENTENCEPIECE_TYPES = ("GPTSentencePieceTokenizer", "SentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = ("GPT2BPETokenizer", "HFTokenizer", "NullTokenizer") + SENTENCEPIECE_TYPES


def build_tokenizer(tokenizer_type: str, vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    tokenizer_model: Optional[str] = None, vocab_size: Optional[int] = None) -> Tokenizer:
    """The tokenizer `--tokenizer-type` names, with a clear error for missing pieces."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in ("HFTokenizer", "HuggingFaceTokenizer", "PretrainedFromHF"):
        return HFTokenizer(tokenizer_model)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(tokenizer_model, tokenizer_type)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise ConfigError(f"--tokenizer-type {tokenizer_type!r} is not supported; use one of {', '.join(TOKENIZER_TYPES)}.")


def end_ids(tokenizer, *directories: Optional[str]) -> tuple:
    """The ids that end a completion, as transformers' `generate` and TRL's GRPOTrainer stop: every id of
    generation_config.json's eos_token_id (an id or a list) in the first of `directories` that has the file (the
    model's, then the tokenizer's), and the tokenizer's EOS; the first is the padding. None: completions run to the
    token limit. Models whose turn ends in another token than the tokenizer's EOS list it there (Gemma 3's
    <end_of_turn>, GLM-4.5's <|user|> and <|observation|>, GPT-OSS's <|call|>)."""
    ids = []
    for directory in directories:
        path = os.path.join(directory, "generation_config.json") if directory else None
        if path and os.path.isfile(path):
            try:
                with open(path) as f:
                    eos = json.load(f).get("eos_token_id")
            except (OSError, ValueError, AttributeError) as error:
                raise ConfigError(f"{path}: not a generation config transformers writes ({error}).") from None
            ids = [int(i) for i in (eos if isinstance(eos, list) else [] if eos is None else [eos])]
            break
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and int(eos) not in ids:
        ids.append(int(eos))
    return tuple(ids)
