#!/usr/bin/env bash
# Llama-7B (CodeLlama-7B shape), full_shard on 2 GPUs, 2 x 2048 tokens per GPU,
# random weights, in one call: `ft bench --fp8 tensorwise` and bf16 at 1 and 2
# GPUs (the gradients reduced in REDUCE: fp32 by default, `compute` for bf16),
# and PyTorch FSDP2 + torchao float8 with float8 all-gathers (torchtitan's
# recipe; torchao's wheel carried in .whl), compiled as PEER_COMPILE says:
# `--compile` (the whole model) or `--compile-blocks` (each decoder block,
# torchtitan's `apply_compile`). The 1-GPU rows need an H200's memory.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
CONFIG=$D/configs/codellama-7b/config.json REDUCE=${REDUCE:-fp32}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/torchao-*.whl \
  || { echo "FAILED torchao install"; exit 1; }
for fp8 in off tensorwise; do
  name=ft-$fp8${REDUCE/fp32/}; name=${name/compute/-reduce-compute}
  timeout ${FT_LIMIT:-280} "$FT" bench --config $CONFIG --gpus 1,2 --strategy full_shard --batch 2 --seq 2048 --warmup 3 --steps 5 \
    --fp8 $fp8 --reduce-dtype $REDUCE --json $OUT/$name.json > $OUT/$name.log 2>&1 || echo "FAILED ft --fp8 $fp8"
  grep -E "^\| llama" $OUT/$name.log
done
export PYTHONPATH=/tmp/site
LIMIT=${LIMIT:-420} fsdp2 2 codellama-7b --mode fsdp2 ${PEER_COMPILE:---compile} --float8 tensorwise --batch 2 --seq 2048 --warmup 8 --steps 6
