#!/usr/bin/env bash
# QLoRA on the Llama-7B (CodeLlama-7B) shape, 1 GPU, LoRA r=16 alpha=32 on
# every linear layer of the blocks, 2 x 2048 tokens, bf16 compute:
# `ft bench --quantize nf4` (NF4, double quantization, block 64) beside ft's
# LoRA on a bf16 base and transformers + bitsandbytes 0.50.2 `Linear4bit` +
# peft (bench/peers/peft_train_step.py --qlora), eager and compiled, in one call.
#
# bitsandbytes travels unpacked from its wheel in .device/pylib (the GPU
# image has none), keeping only its CUDA 13.0 and CPU libraries. Prepare it here:
#   pip download bitsandbytes==0.50.2 --no-deps -d /tmp/w && unzip -q /tmp/w/bitsandbytes-*.whl -d .device/pylib
#   find .device/pylib/bitsandbytes -name 'libbitsandbytes_*.so' ! -name '*cuda130*' ! -name '*cpu*' -delete
# Its Requires-Dist (torch, numpy, packaging) are in the image.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
CONFIG=$D/configs/codellama-7b/config.json
LORA="--lora-r 16 --lora-alpha 32 --lora-targets q,k,v,o,gate,up,down"
export PYTHONPATH="$D/pylib${PYTHONPATH:+:$PYTHONPATH}"
for quantize in nf4 none; do
  "$FT" bench --config $CONFIG --gpus 1 --strategy ddp --batch 2 --seq 2048 $LORA --quantize $quantize \
    --warmup 3 --steps 8 --json $OUT/ft-qlora-$quantize.json 2>&1 | grep -vE "^\[rank" | tail -3
done
python3 -c "import bitsandbytes, peft, transformers, torch; print('bitsandbytes', bitsandbytes.__version__, '| peft', peft.__version__, '| transformers', transformers.__version__, '| torch', torch.__version__)" \
  || echo "bitsandbytes import failed"
for peer in ${PEERS:-eager compiled}; do
  flags=""; [ $peer = compiled ] && flags=--compile
  timeout ${LIMIT:-300} python3 bench/peers/peft_train_step.py --config $CONFIG --batch 2 --seq 2048 --lora-r 16 --lora-alpha 32 \
    --qlora $flags --warmup 2 --steps 6 --json $OUT/peft-qlora-$peer.json > $OUT/peft-qlora-$peer.log 2>&1 \
    && grep -E "tokens/s" $OUT/peft-qlora-$peer.log || { echo "peer failed: $peer"; grep -E "Error|error:" $OUT/peft-qlora-$peer.log | tail -3; }
done
