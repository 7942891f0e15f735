#!/usr/bin/env bash
# Writes tests/data/pipeline_engine/: a checkpoint of DeepSpeed's PipelineEngine (layer files, ZeRO-1, PP 2, a tied
# embedding) as hybrid wrote them before the one runtime, and the losses of the same run uninterrupted.
# Run it from a checkout of hybrid at commit f13f7c5 (the last one training 1f1b on DeepSpeed's PipelineEngine):
#   git worktree add /tmp/old f13f7c5 && (cd /tmp/old && bash /path/to/tests/data/pipeline_engine/make.sh OUT)
set -euo pipefail
out=${1:?output directory}
flags=(--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 16 --max-position-embeddings 16
       --micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --min-lr 1e-3 --lr-decay-style cosine
       --lr-warmup-iters 1 --weight-decay 0.01 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 --seed 7
       --mock-data --tokenizer-type NullTokenizer --vocab-size 63 --make-vocab-size-divisible-by 8
       --log-interval 1 --eval-iters 0 --no-progress-bar --num-workers 0 --pipeline-model-parallel-size 2
       --deepspeed ds_configs/zero1.json)
export OMP_NUM_THREADS=1
mkdir -p "$out"
torchrun --nproc_per_node 2 --master_port 29577 launch/train.py "${flags[@]}" --train-iters 4 \
    --log-json "$out/uninterrupted.jsonl"
torchrun --nproc_per_node 2 --master_port 29578 launch/train.py "${flags[@]}" --train-iters 4 --save "$out/ckpt" \
    --save-interval 2 --exit-interval 2
rm -f "$out"/ckpt/zero_to_*.py
