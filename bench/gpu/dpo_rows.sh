#!/usr/bin/env bash
# Issue 36's two DPO rows in one call, each beside TRL's fastest settings
# measured before (bench/results/2026-11-26-h100-dpo.md): BLOOM-560m
# (dpo_1gpu.sh) beside TRL with precomputed references under torch.compile,
# Llama-7B LoRA r16 (dpo_lora_7b.sh) beside TRL + peft under torch.compile;
# first `ft bench --task dpo`'s breakdown (ft's kernels against ATen's on the
# same inputs, the label log-probabilities among them) and kernel profile.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
"$FT" bench --config $D/configs/bloom-560m/config.json --task dpo --batch 8 --seq 512 --breakdown \
  --profile $OUT/dpo-profile --json $OUT/ft-bench-dpo.json > $OUT/ft-bench-dpo.log 2>&1 || echo "FAILED ft bench"
grep -E "label log-prob|tokens/s|step" $OUT/ft-bench-dpo.log | tail -n 6
TRL_SETTINGS="--precompute --compile" bash "$(dirname "$0")/dpo_1gpu.sh"
TRL_SETTINGS="--compile" bash "$(dirname "$0")/dpo_lora_7b.sh"
