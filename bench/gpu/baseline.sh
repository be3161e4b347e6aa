#!/usr/bin/env bash
# The seeds' baseline on one GPU: BLOOM-560m shape (random weights), 500
# SQuAD examples, max length 512, batch 4 x grad-accum 4, bf16, 3 epochs,
# eval each epoch — `ft train` and Hugging Face Trainer in the same call.
# Needs .device/configs, .device/squad.json and .device/gpt2-tokenizer.json.
set -euo pipefail
source "$(dirname "$0")/env.sh"
D=.device
nvidia-smi -L
"$FT" train --model $D/configs/bloom-560m/config.json --tokenizer $D/gpt2-tokenizer.json \
  --train-file $D/squad.json --eval-file $D/squad.json --train-samples 500 --eval-samples 100 \
  --max-seq-len 512 --batch-size 4 --grad-accum 4 --epochs 3 --lr 5e-5 --dtype bf16 --nproc-per-node 1 \
  --output-dir $OUT/ft-run 2>&1 | grep -v "^\s*$"
rm -rf $OUT/ft-run/final $OUT/ft-run/tensorboard
python3 bench/peers/hf_trainer_squad.py --config $D/configs/bloom-560m/config.json --tokenizer $D/gpt2-tokenizer.json \
  --squad $D/squad.json --train-samples 500 --eval-samples 100 --json $OUT/hf-trainer.json 2>&1 | grep -E "HF Trainer|Error|error" 
