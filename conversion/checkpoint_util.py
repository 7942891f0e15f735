"""Convert checkpoints between hybrid (any TP x PP) and HuggingFace transformers.

    # hybrid -> HuggingFace (the Megatron-LM tutorial's command, conversion/ for tools/)
    python conversion/checkpoint_util.py --model-type GPT --load-dir CKPT --save-dir HF_OUT \
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1 --hf-convert \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt
    # HuggingFace -> hybrid at TP=2, PP=2 (then: launch/train.py --load OUT [--finetune])
    python conversion/checkpoint_util.py --loader hf --load-dir HF_DIR --save-dir OUT \
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    # reshard a hybrid checkpoint
    python conversion/checkpoint_util.py --load-dir CKPT --save-dir OUT --target-tensor-parallel-size 4
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.conversion.checkpoint_util import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
