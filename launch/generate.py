"""Complete a file of prompts with a checkpoint's own layers at its training layout (see hybrid.generation).

    torchrun --nproc_per_node 2 launch/generate.py --load-hf DIR --tensor-model-parallel-size 2 \
        --prompts prompts.jsonl --max-new-tokens 64 --output completions.jsonl
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.generation import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
