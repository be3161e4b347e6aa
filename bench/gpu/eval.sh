#!/usr/bin/env bash
# Generation-based evaluation on one GPU, BLOOM-560m shape (random weights),
# SQuAD prompts, greedy 16 new tokens, bf16: `ft eval` beside transformers'
# `generate` (left padding, KV cache) at the same batch sizes, prompts
# sorted by length on both sides; examples/s of the scoring alone.
set -euo pipefail
source "$(dirname "$0")/env.sh"
"$FT" init-model --config .device/configs/bloom-560m/config.json --out /tmp/bloom --tokenizer .device/gpt2-tokenizer.json >/dev/null
for run in "1 64" "32 512" "64 512"; do
  set -- $run
  FT_TASK__MAX_NEW_TOKENS=16 "$FT" eval --model /tmp/bloom --eval-file .device/squad.json --eval-samples $2 --batch-size $1 \
    --max-seq-len 512 --output-dir /tmp/ft-eval-$1 2>&1 | grep -E "^scored|error" | sed "s/^/ft batch $1: /"
  python3 bench/peers/hf_generate.py --model /tmp/bloom --tokenizer .device/gpt2-tokenizer.json --squad .device/squad.json \
    --samples $2 --batch $1 --max-new-tokens 16 --json $OUT/hf-generate-$1.json 2>&1 | tail -n 1
done
