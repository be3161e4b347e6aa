#!/usr/bin/env bash
# Two builds of ft side by side: the build before a change ($D/ft-before,
# carried beside $FT) and after, in one call, alternating: Llama-7B full_shard
# on 2 GPUs, 2 x 2048 tokens per GPU, bf16 and `--fp8 tensorwise`, gradients
# reduced in fp32 (the default). First, when carried as $D/ft_sys_tests,
# ft's kernels against ATen's, bit for bit. Used for the bf16 -> fp32
# widening kernel and for one fp32 reduction in flight.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
[ -x $D/ft_sys_tests ] && { $D/ft_sys_tests --ignored --test-threads 1 2>&1 | tail -3; }
for fp8 in off tensorwise; do
  for build in before after; do
    binary=$FT; [ $build = before ] && binary=$D/ft-before
    timeout ${FT_LIMIT:-150} $binary bench --config $D/configs/codellama-7b/config.json --gpus 2 --strategy full_shard --batch 2 --seq 2048 \
      --warmup 3 --steps 5 --fp8 $fp8 --json $OUT/$fp8-$build.json > $OUT/$fp8-$build.log 2>&1 || echo "FAILED $fp8 $build"
    grep -E "^\| llama" $OUT/$fp8-$build.log | sed "s/^/$fp8 $build /"
  done
done
