"""Tokenize JSON lines into Megatron-LM's .bin/.idx format.

    python launch/preprocess_data.py --input corpus.jsonl --output-prefix my-gpt2 \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \
        --tokenizer-type GPT2BPETokenizer --dataset-impl mmap --append-eod --workers 2

writes my-gpt2_text_document.bin/.idx (one pair per --json-keys key).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.data.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
