#!/usr/bin/env bash
# Llama-7B (CodeLlama-7B shape) full fine-tune on ONE GPU, 2 x 2048, random
# weights, in one call: ft bf16, ft --fp8 tensorwise (both `ft bench`, each
# with 3 profiled steps whose top kernels land in its log), and transformers +
# torch.compile + torchao 0.18 float8 tensorwise (fp32 weights under bf16
# autocast, every linear layer but the LM head). torchao's wheel travels in
# .whl (`pip download torchao==0.18.0 --no-deps`); needs about 125 GB: an H200.
# FP8S=tensorwise runs ft's float8 row alone. First, when carried as
# .device/ft_sys_tests (`cargo test --release -p ft-sys --no-run`), ft's
# float8 cast kernels against ATen's casts, bit for bit.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
CONFIG=$D/configs/codellama-7b/config.json
[ -x $D/ft_sys_tests ] && { $D/ft_sys_tests --ignored --test-threads 1 2>&1 | tail -4; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/torchao-*.whl \
  || { echo "FAILED torchao install"; exit 1; }
for fp8 in ${FP8S:-off tensorwise}; do
  timeout ${FT_LIMIT:-180} "$FT" bench --config $CONFIG --gpus 1 --strategy ddp --batch 2 --seq 2048 --warmup 3 --steps 6 \
    --fp8 $fp8 --profile /tmp/profile-$fp8 --json $OUT/ft-$fp8.json > $OUT/ft-$fp8.log 2>&1 \
    || echo "FAILED ft --fp8 $fp8"
  grep -vE "^\[rank" $OUT/ft-$fp8.log | tail -4
done
cp /tmp/profile-tensorwise/*.kernels.tsv $OUT/ft-tensorwise.kernels.tsv 2>/dev/null
PYTHONPATH=/tmp/site timeout ${LIMIT:-450} python3 bench/peers/hf_train_step.py --config $CONFIG --batch 2 --seq 2048 \
  --warmup 2 --steps 5 --compile --float8 tensorwise --json $OUT/hf-compiled-float8.json > $OUT/hf-compiled-float8.log 2>&1 \
  && tail -n 1 $OUT/hf-compiled-float8.log \
  || { echo "peer failed: compiled + float8"; grep -E "Error|error:" $OUT/hf-compiled-float8.log | tail -3; }
