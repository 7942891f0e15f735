"""An OpenAI-compatible endpoint on a checkpoint's own layers at its training layout (see hybrid.serving).

    torchrun --nproc_per_node 2 launch/serve.py --load-hf DIR --tensor-model-parallel-size 2 --port 8000
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.serving import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
