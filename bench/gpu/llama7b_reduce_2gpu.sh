#!/usr/bin/env bash
# Llama-7B (CodeLlama-7B shape), full_shard, 2 x 2048 tokens per GPU, random
# weights, in one call: `ft bench --gpus 1,2` in bf16 and `--fp8 tensorwise`
# with the gradients reduced in the compute dtype (`--reduce-dtype compute`:
# half the reduce-scatter bytes of fp32), then PyTorch FSDP2 + torchao float8
# with float8 all-gathers and each block compiled (torchtitan's recipe:
# `apply_compile` compiles block by block; torchao's wheel carried in .whl).
# The 1-GPU rows need an H200's memory.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
CONFIG=$D/configs/codellama-7b/config.json
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/torchao-*.whl \
  || { echo "FAILED torchao install"; exit 1; }
for fp8 in off tensorwise; do
  started=$(date +%s)
  timeout ${FT_LIMIT:-200} "$FT" bench --config $CONFIG --gpus 1,2 --strategy full_shard --batch 2 --seq 2048 --warmup 3 --steps 5 \
    --fp8 $fp8 --reduce-dtype compute --json $OUT/ft-$fp8-reduce-compute.json > $OUT/ft-$fp8-reduce-compute.log 2>&1 || echo "FAILED ft --fp8 $fp8"
  grep -E "^\| llama" $OUT/ft-$fp8-reduce-compute.log
  echo "ft --fp8 $fp8: $(( $(date +%s) - started )) s"
done
export PYTHONPATH=/tmp/site
started=$(date +%s)
LIMIT=${LIMIT:-200} fsdp2 2 codellama-7b --mode fsdp2 --compile-blocks --float8 tensorwise --batch 2 --seq 2048 --warmup 8 --steps 6
echo "fsdp2 float8: $(( $(date +%s) - started )) s"
