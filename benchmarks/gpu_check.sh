#!/usr/bin/env bash
# Every GPU path of hybrid on one CUDA GPU in one command, within GPU_CHECK_BUDGET_S (default 480 s: a step
# that would start past it is reported as skipped, and each step's timeout is cut to what is left);
# installs nothing.
#
#   bash benchmarks/gpu_check.sh            # results in $OUT (or ./gpu_check_out)
#
# Needs torch (CUDA build), transformers and an importable DeepSpeed (e.g. PYTHONPATH to a wheel
# unpacked by shared/gpu's recipe); torchao for the FP8 steps (skipped without it). Runs, most telling first:
# checks/gpu_paths.py (each CUDA-only path against its reference: NCCL, flash-attn vs SDPA, bf16/fp16
# against fp32, the fp16 loss-scale stop, the ring's fused CUDA kernel vs full attention, grouped GEMM vs
# the loop, async save vs sync, pinned batches, compile vs eager, FP8 GEMM vs torchao, --cpu-offloading vs
# none, MoE host syncs, Gated DeltaNet's flash-linear-attention kernel vs its PyTorch form; TP overlap, Ulysses and MoE all-to-all on NCCL with 2+ GPUs),
# benchmarks/bench_vs_transformers.py --preset gpu (Llama-3-8B-shaped layers: tokens/s and MFU against
# transformers eager and compiled), then bf16 ZeRO-1 on the embedded corpus (saved), fp16 with dynamic loss
# scaling, flash-attn when installed, --torch-compile, ZeRO-3, full and selective recompute, FP8 (delayed
# scaling) and benchmarks/bench_fp8.py, Muon under ZeRO-3 and with ZeRO-1 offload, launch/evaluate.py on the
# bf16 checkpoint and its HF export loaded by transformers (loss compared); with 2+ GPUs, every --pipeline-
# schedule at PP 2.
# Each step's log and JSON lines go to $OUT; $OUT/summary.json has one line per step (ok, seconds, last
# logged metrics); $OUT/gpu_paths.jsonl one line per GPU path.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
SUMMARY="$OUT/summary.json"
: > "$SUMMARY"
BUDGET=${GPU_CHECK_BUDGET_S:-480}

python - <<'EOF' > "$OUT/environment.json"
import json, torch
import deepspeed, transformers
try:
    import flash_attn
    fa = flash_attn.__version__
except Exception as e:
    fa = f"not usable: {type(e).__name__}"
try:
    import fla
    linear = getattr(fla, "__version__", "installed")
except Exception as e:
    linear = f"not usable: {type(e).__name__}"
print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
                  "transformers": transformers.__version__, "flash_attn": fa, "flash_linear_attention": linear}))
EOF
cat "$OUT/environment.json"

# GPT-2 small shape, short runs: enough to exercise each path, not to train. GPU_CHECK_MODEL and
# GPU_CHECK_BENCH override the model flags and the benchmark's (a CPU smoke test of this script uses both).
SEQ=${GPU_CHECK_SEQ:-1024}
MODEL=${GPU_CHECK_MODEL:-"--num-layers 12 --hidden-size 768 --num-attention-heads 12 --micro-batch-size 8
       --global-batch-size 8"}
MODEL="$MODEL --seq-length $SEQ --max-position-embeddings $SEQ --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 5
       --lr-decay-style cosine --clip-grad 1.0 --log-interval 5 --eval-interval 20 --eval-iters 2 --no-progress-bar"
BENCH=${GPU_CHECK_BENCH:-"--preset gpu --rounds 3 --steps 5"}
MOCK="--mock-data --tokenizer-type NullTokenizer --vocab-size 50257"

step() {  # step NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2; shift 2
    local start=$SECONDS left=$((BUDGET - SECONDS))
    echo "=== $name"
    if [ "$left" -lt 30 ]; then
        echo "{\"step\": \"$name\", \"ok\": null, \"skipped\": \"past the ${BUDGET} s budget\"}" >> "$SUMMARY"
        tail -n 1 "$SUMMARY"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    python - "$name" "$rc" "$((SECONDS - start))" "$OUT" >> "$SUMMARY" <<'EOF'
import json, os, sys
name, rc, seconds, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
record = {"step": name, "ok": rc == 0, "exit_code": rc, "seconds": seconds}
path = os.path.join(out, f"{name}.jsonl")
if os.path.exists(path):
    lines = [json.loads(l) for l in open(path) if l.strip()]
    train = [l for l in lines if "consumed_samples" in l]
    if train:
        last = train[-1]
        record.update({k: last[k] for k in ("iteration", "lm_loss", "loss_scale", "skipped_iterations",
                                            "tokens_per_s", "tflops_per_gpu") if k in last})
    valid = [l for l in lines if l.get("split") == "valid"]
    if valid:
        record["valid_lm_loss"] = valid[-1]["lm_loss"]
    if lines and not train and not valid:
        record["result"] = lines[-1]
else:  # a step that prints one JSON line (the HF comparison)
    last = (open(os.path.join(out, f"{name}.log")).read().strip().splitlines() or [""])[-1]
    if last.startswith("{"):
        record["result"] = json.loads(last)
if rc != 0:
    record["tail"] = open(os.path.join(out, f"{name}.log")).read()[-1500:]
print(json.dumps(record))
EOF
    tail -n 1 "$SUMMARY"
}

step gpu_paths 240 python checks/gpu_paths.py --out "$OUT/gpu_paths.jsonl"
step bench_vs_transformers 180 python benchmarks/bench_vs_transformers.py $BENCH \
    --variants hybrid,hybrid_compiled,transformers_eager,transformers_compiled \
    --json "$OUT/bench_vs_transformers.json" --chart "$OUT/bench_vs_transformers.png"
step bf16_zero1_save 240 python launch/train.py $MODEL --bf16 --deepspeed ds_configs/zero1.json --train-iters 40 \
    --save "$OUT/ckpt" --save-interval 40 --log-json "$OUT/bf16_zero1_save.jsonl"
step fp16_dynamic_loss_scale 120 python launch/train.py $MODEL $MOCK --fp16 --train-iters 20 \
    --log-interval 1 --log-json "$OUT/fp16_dynamic_loss_scale.jsonl"
if python -c "import flash_attn" 2>/dev/null; then
    step flash_attn 120 python launch/train.py $MODEL $MOCK --bf16 --use-flash-attn --train-iters 20 \
        --log-json "$OUT/flash_attn.jsonl"
else
    echo '{"step": "flash_attn", "ok": null, "skipped": "flash-attn not installed"}' >> "$SUMMARY"
fi
step torch_compile 180 python launch/train.py $MODEL $MOCK --bf16 --torch-compile --train-iters 20 \
    --log-json "$OUT/torch_compile.jsonl"
step zero3 120 python launch/train.py $MODEL $MOCK --bf16 --deepspeed ds_configs/zero3.json --train-iters 20 \
    --log-json "$OUT/zero3.jsonl"
# Muon's sharded form on CUDA + NCCL: ZeRO-3 (bf16 gathers, Newton-Schulz on the GPU) and ZeRO-1 with optimizer
# offload (the momentum on the host, the blends moved to the GPU for the collectives)
step muon_zero3 120 python launch/train.py $MODEL $MOCK --bf16 --optimizer muon --deepspeed ds_configs/zero3.json \
    --train-iters 20 --log-json "$OUT/muon_zero3.jsonl"
step muon_zero1_offload 120 python launch/train.py $MODEL $MOCK --bf16 --optimizer muon \
    --deepspeed ds_configs/zero1_offload.json --train-iters 20 --log-json "$OUT/muon_zero1_offload.jsonl"
step recompute_full 120 python launch/train.py $MODEL $MOCK --bf16 --recompute-granularity full \
    --recompute-method uniform --recompute-num-layers 1 --train-iters 20 --log-json "$OUT/recompute_full.jsonl"
step recompute_selective 120 python launch/train.py $MODEL $MOCK --bf16 --recompute-granularity selective \
    --train-iters 20 --log-json "$OUT/recompute_selective.jsonl"
# FP8 GEMMs (torch._scaled_mm, compute capability 8.9+): delayed scaling in a bf16 run, and the benchmark
# (Llama-3-8B GEMM shapes and layers against bf16, the loss gap after 200 steps)
if python -c "import torchao.float8" 2>/dev/null; then
    step fp8_delayed_bf16 120 python launch/train.py $MODEL $MOCK --bf16 --fp8-format hybrid --fp8-recipe delayed \
        --fp8-amax-history-len 16 --fp8-amax-compute-algo max --train-iters 20 --log-json "$OUT/fp8_delayed_bf16.jsonl"
    step bench_fp8 120 python benchmarks/bench_fp8.py --preset gpu --repeats 5 --out "$OUT/bench_fp8.json"
else
    echo '{"step": "fp8", "ok": null, "skipped": "torchao not installed"}' >> "$SUMMARY"
fi

DATA=$(python -c "from hybrid.data.default import default_data_prefix; print(default_data_prefix())")
step evaluate 120 python launch/evaluate.py --load "$OUT/ckpt" --data-path "$DATA" --seq-length "$SEQ" \
    --micro-batch-size 2 --eval-iters 4 --log-json "$OUT/evaluate.jsonl"
step hf_export 120 python conversion/checkpoint_util.py --model-type GPT --load-dir "$OUT/ckpt" \
    --save-dir "$OUT/hf" --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1 --hf-convert
step hf_load_and_loss 120 python - "$OUT" "$DATA" "$SEQ" <<'EOF'
import json, sys, torch
from transformers import AutoModelForCausalLM
from hybrid.evaluation import stream_windows
out, data, seq = sys.argv[1], sys.argv[2], int(sys.argv[3])
device = "cuda" if torch.cuda.is_available() else "cpu"
model = AutoModelForCausalLM.from_pretrained(f"{out}/hf", dtype=torch.float32).to(device).eval()
windows = torch.from_numpy(stream_windows(data, seq, 8)).to(device)
with torch.no_grad():  # the same 8 windows launch/evaluate.py scored (4 iterations x micro-batch 2)
    logits = torch.cat([model(input_ids=w[None, :-1]).logits for w in windows])
loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), windows[:, 1:].reshape(-1))
ours = json.loads(open(f"{out}/evaluate.jsonl").read().splitlines()[-1])["lm_loss"]
print(json.dumps({"transformers_loss": loss.item(), "hybrid_evaluate_loss": ours,
                  "relative_difference": abs(loss.item() - ours) / ours}))
EOF
# Pipeline schedules need 2+ GPUs (one rank per GPU): each runs PP 2 with ZeRO-1, bf16, 8 micro-batches.
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    for schedule in 1f1b interleaved-1f1b zero-bubble zbv dualpipev; do
        virtual=""
        case $schedule in interleaved-1f1b|zero-bubble) virtual="--num-virtual-stages-per-pipeline-rank 2";; esac
        step "pp2_$schedule" 180 python -m torch.distributed.run --nproc_per_node 2 launch/train.py $MODEL $MOCK \
            --bf16 --deepspeed ds_configs/zero1.json --pipeline-model-parallel-size 2 --pipeline-schedule $schedule \
            $virtual --global-batch-size 64 --train-iters 20 --log-json "$OUT/pp2_$schedule.jsonl"
    done
else
    echo '{"step": "pipeline_schedules", "ok": null, "skipped": "needs 2 or more GPUs"}' >> "$SUMMARY"
fi
echo "=== summary ($SUMMARY)"
cat "$SUMMARY"
