#!/usr/bin/env bash
# Models on one GPU: parity with transformers for full-size BLOOM-560m and
# OPT-1.3B and 2-layer CodeLlama shapes (MHA and GQA), then the training step
# of BLOOM-560m (batch 8x512, bf16, fp32 master, AdamW) beside transformers
# eager and compiled. Needs the configs carried in .device/configs. Writes $OUT.
set -euo pipefail
source "$(dirname "$0")/env.sh"
C=.device/configs
M=/tmp/models
mkdir -p $M
nvidia-smi -L
"$FT" init-model --config $C/bloom-560m/config.json --out $M/bloom-560m
"$FT" init-model --config $C/opt-1.3b/config.json --out $M/opt-1.3b
"$FT" init-model --config $C/codellama-7b/config.json --out $M/codellama-2layer --set num_hidden_layers=2
"$FT" init-model --config $C/codellama-7b/config.json --out $M/codellama-2layer-gqa --set num_hidden_layers=2 \
  --set num_key_value_heads=8
python3 bench/parity/parity.py --ft "$FT" --device cuda --batch 2 --seq 128 \
  $M/bloom-560m $M/opt-1.3b $M/codellama-2layer $M/codellama-2layer-gqa 2>&1 | grep -v "Loading weights" | tee $OUT/parity.txt || true
BENCH=(--batch 8 --seq 512 --warmup 5 --steps 20)
for run in 1 2; do
  "$FT" bench --config $C/bloom-560m/config.json "${BENCH[@]}" --json $OUT/ft-bloom-$run.json
  "$FT" bench --config $C/bloom-560m/config.json "${BENCH[@]}" --activation-checkpointing --json $OUT/ft-bloom-ckpt-$run.json
done
python3 bench/peers/hf_train_step.py --config $C/bloom-560m/config.json "${BENCH[@]}" --json $OUT/hf-eager.json
python3 bench/peers/hf_train_step.py --config $C/bloom-560m/config.json "${BENCH[@]}" --compile --json $OUT/hf-compiled.json 2>&1 | tail -n 2
