#!/usr/bin/env bash
# Round 2 on one GPU: OPT-1.3B gradients against an fp64 ground truth, and
# the BLOOM-560m step with a per-phase breakdown, beside transformers.
set -euo pipefail
source "$(dirname "$0")/env.sh"
C=.device/configs
M=/tmp/models
mkdir -p $M
"$FT" init-model --config $C/opt-1.3b/config.json --out $M/opt-1.3b >/dev/null
python3 bench/parity/parity.py --ft "$FT" --device cuda --batch 2 --seq 128 --f64 $M/opt-1.3b 2>&1 \
  | grep -v "Loading weights" | tee $OUT/parity-opt-f64.txt || true
BENCH=(--batch 8 --seq 512 --warmup 5 --steps 20)
for run in 1 2; do
  "$FT" bench --config $C/bloom-560m/config.json "${BENCH[@]}" --breakdown --json $OUT/ft-bloom-$run.json
done
"$FT" bench --config $C/bloom-560m/config.json "${BENCH[@]}" --loss-chunk-tokens 4096 --json $OUT/ft-bloom-chunk4096.json
python3 bench/peers/hf_train_step.py --config $C/bloom-560m/config.json "${BENCH[@]}" --json $OUT/hf-eager.json
python3 bench/peers/hf_train_step.py --config $C/bloom-560m/config.json "${BENCH[@]}" --compile --json $OUT/hf-compiled.json 2>&1 | tail -n 1
