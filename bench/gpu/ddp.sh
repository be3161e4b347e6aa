#!/usr/bin/env bash
# `ft train` data parallel over NCCL on 2 GPUs against 1 GPU with the same
# global batches (BLOOM-560m shape, 512 SQuAD examples, bf16): per-step losses
# should agree to bf16 rounding, and throughput per GPU should hold.
set -euo pipefail
source "$(dirname "$0")/env.sh"
D=.device
COMMON=(--model $D/configs/bloom-560m/config.json --tokenizer $D/gpt2-tokenizer.json --train-file $D/squad.json
  --train-samples 512 --eval-samples 32 --max-seq-len 512 --epochs 1 --lr 5e-5 --dtype bf16)
"$FT" train "${COMMON[@]}" --batch-size 4 --grad-accum 2 --nproc-per-node 2 --output-dir $OUT/gpus2 2>&1 \
  | grep -E "samples/s|memory rank|utilisation|epoch 1|error"
"$FT" train "${COMMON[@]}" --batch-size 8 --grad-accum 2 --nproc-per-node 1 --output-dir $OUT/gpus1 2>&1 \
  | grep -E "samples/s|memory rank|utilisation|epoch 1|error"
rm -rf $OUT/gpus*/final $OUT/gpus*/tensorboard $OUT/gpus*/metrics.csv $OUT/gpus*/predictions.json
python3 - "$OUT" <<'PY'
import json, sys
loss = lambda run: [json.loads(l)["loss"] for l in open(f"{sys.argv[1]}/{run}/metrics.jsonl") if '"loss"' in l]
two, one = loss("gpus2"), loss("gpus1")
worst = max(abs(a - b) / b for a, b in zip(two, one))
print(f"{len(two)} steps; max relative loss difference 2 GPUs vs 1 GPU: {worst:.2e}")
PY
