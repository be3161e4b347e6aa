#!/usr/bin/env bash
# Two builds of ft side by side: the build before a change ($D/ft-before,
# carried beside $FT) and after, in one call, alternating: Llama-7B full_shard
# on 2 GPUs, 2 x 2048 tokens per GPU, random weights, for each FP8:REDUCE of
# RUNS (default: bf16 and `--fp8 tensorwise`, gradients reduced in fp32).
# PEER=1 then runs FSDP2 + compile + torchao float8 all-gathers with its
# gradients reduced in fp32 (torchao's wheel carried in .whl). PROFILE=1
# also writes each run's kernel table to $OUT/profile-NAME. First, when
# carried as $D/ft_sys_tests, ft's kernels against ATen's, bit for bit. Used
# for the bf16 -> fp32 widening kernel, for one fp32 reduction in flight, and
# for a reduction waiting for room before its gradient is widened, and for
# RMSNorm's amax in its kernel. GPUS, STRATEGY and EXTRA (more `ft bench`
# flags, e.g. `--set num_hidden_layers=8`) change the row.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
[ -x $D/ft_sys_tests ] && { $D/ft_sys_tests --ignored --test-threads 1 2>&1 | tail -3; }
for run in ${RUNS:-off:fp32 tensorwise:fp32}; do
  fp8=${run%:*} reduce=${run#*:}
  for build in before after; do
    binary=$FT; [ $build = before ] && binary=$D/ft-before
    name=$fp8-$reduce-$build profile=()
    [ "${PROFILE:-0}" = 1 ] && profile=(--profile $OUT/profile-$name)
    timeout ${FT_LIMIT:-150} $binary bench --config $D/configs/codellama-7b/config.json --gpus ${GPUS:-2} --strategy ${STRATEGY:-full_shard} \
      --batch 2 --seq 2048 --warmup 3 --steps 5 --fp8 $fp8 --reduce-dtype $reduce ${EXTRA:-} "${profile[@]}" --json $OUT/$name.json \
      > $OUT/$name.log 2>&1 || echo "FAILED $name"
    grep -E "^\| llama" $OUT/$name.log | sed "s/^/$fp8 $reduce $build /"
    rm -f $OUT/profile-$name/*.trace.json
  done
done
if [ "${PEER:-0}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/torchao-*.whl \
    || { echo "FAILED torchao install"; exit 1; }
  export PYTHONPATH=/tmp/site
  LIMIT=${LIMIT:-300} fsdp2 2 codellama-7b --mode fsdp2 --compile --float8 tensorwise --reduce-dtype fp32 --batch 2 --seq 2048 --warmup 6 --steps 4
fi
