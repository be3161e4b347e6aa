#!/usr/bin/env bash
# baseline.sh twice, sides interleaved, for a median: at this batch size both
# sides are bound by host-side overhead, which varies from machine to machine.
set -euo pipefail
source "$(dirname "$0")/env.sh"
D=.device
for run in 1 2; do
  "$FT" train --model $D/configs/bloom-560m/config.json --tokenizer $D/gpt2-tokenizer.json \
    --train-file $D/squad.json --eval-file $D/squad.json --train-samples 500 --eval-samples 100 \
    --max-seq-len 512 --batch-size 4 --grad-accum 4 --epochs 3 --lr 5e-5 --dtype bf16 --nproc-per-node 1 \
    --output-dir $OUT/ft-$run 2>&1 | grep -E "train samples/s|memory rank"
  rm -rf $OUT/ft-$run/final $OUT/ft-$run/tensorboard $OUT/ft-$run/metrics.csv $OUT/ft-$run/predictions.json $OUT/ft-$run/metrics.jsonl
  python3 bench/peers/hf_trainer_squad.py --config $D/configs/bloom-560m/config.json --tokenizer $D/gpt2-tokenizer.json \
    --squad $D/squad.json --train-samples 500 --eval-samples 100 --json $OUT/hf-$run.json 2>&1 | grep -E "HF Trainer"
done
