#!/usr/bin/env bash
# The rowwise recipe's casts in ft's kernels against ATen's: Llama-7B
# full_shard on 2 GPUs, 2 x 2048 tokens per GPU, random weights, gradients
# reduced in bf16, `--fp8 rowwise` with the build before ($D/ft-before,
# carried beside $FT: ATen's casts) and after, then bf16 and `--fp8
# tensorwise` with the build after, in one call. First, when carried as
# $D/ft_sys_tests, ft's casts against ATen's, both recipes, bit for bit.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
[ -x $D/ft_sys_tests ] && { $D/ft_sys_tests --ignored --test-threads 1 2>&1 | grep -E "test result|panicked|assert" | head -5; }
for run in rowwise-before rowwise off tensorwise; do
  binary=$FT; [ $run = rowwise-before ] && binary=$D/ft-before
  timeout ${FT_LIMIT:-150} $binary bench --config $D/configs/codellama-7b/config.json --gpus 2 --strategy full_shard --batch 2 --seq 2048 \
    --warmup 3 --steps 5 --fp8 ${run%-before} --reduce-dtype compute --json $OUT/$run.json > $OUT/$run.log 2>&1 || echo "FAILED $run"
  grep -E "^\| llama" $OUT/$run.log | sed "s/^/$run /"
done
