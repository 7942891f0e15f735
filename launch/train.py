"""Train a GPT with Megatron-LM flags on DeepSpeed (ZeRO, pipeline engine, activation checkpointing).

    python launch/train.py                                  # small GPT on the embedded corpus, 1 rank
    deepspeed --num_gpus 2 launch/train.py --deepspeed ds_configs/zero1.json --tensor-model-parallel-size 2 ...
    torchrun --nproc_per_node 4 launch/train.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 ...
    accelerate launch --config_file launch/accelerate/zero2.yaml --num_processes 2 launch/train.py ...

Every Megatron-LM pretrain_gpt.py flag of a typical run script works unchanged (see --help).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.training.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
