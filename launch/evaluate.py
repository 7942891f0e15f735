"""Mean LM loss of a hybrid checkpoint over the first windows of a dataset's token stream.

    torchrun --nproc_per_node 4 launch/evaluate.py --load CKPT --data-path my-gpt2_text_document \
        --seq-length 1024 --micro-batch-size 4 --eval-iters 10 [--log-json eval.jsonl]

Run it at the checkpoint's TP x PP (a multiple of it: extra ranks split the batches). Prints
{"lm_loss": ..., "tokens": ...}.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.evaluation import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
