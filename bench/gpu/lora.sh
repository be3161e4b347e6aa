#!/usr/bin/env bash
# LoRA on the Llama-7B (CodeLlama-7B) shape, 1 GPU, r=16 alpha=32 on every
# linear layer of the blocks (q,k,v,o,gate,up,down), 2 x 2048 tokens, bf16
# frozen base, fp32 adapters: `ft bench --lora-r` beside transformers + peft
# (bench/peers/peft_train_step.py) eager and compiled, in one call.
#
# peft travels unpacked from its wheel in .device/pylib (put first on
# PYTHONPATH, so it wins over any peft the GPU image holds). Prepare it here:
#   pip download peft==0.21.2 --no-deps -d /tmp/w && unzip -q /tmp/w/peft-*.whl -d .device/pylib
# peft 0.21.2's Requires-Dist (its METADATA, extras left out), all of which the
# GPU machine must already hold: numpy>=1.17, packaging>=20.0, psutil, pyyaml,
# torch>=1.13.0, transformers, tqdm, accelerate>=0.21.0, safetensors,
# huggingface_hub>=0.25.0 (KINDS.md lists every one of them in the image).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
CONFIG=$D/configs/codellama-7b/config.json
# FT_ROWS picks ft's rows: bf16 (the frozen base's GEMMs in bf16) and fp8 (in float8, tensorwise).
for row in ${FT_ROWS:-bf16}; do
  fp8=(); [ $row = fp8 ] && fp8=(--fp8 tensorwise)
  "$FT" bench --config $CONFIG --gpus 1 --strategy ddp --batch 2 --seq 2048 \
    --lora-r 16 --lora-alpha 32 --lora-targets q,k,v,o,gate,up,down "${fp8[@]}" \
    --warmup 3 --steps 8 --profile $OUT/lora-$row-profile --json $OUT/ft-lora-$row.json 2>&1 | grep -vE "^\[rank" | tail -8
done
[ -d $D/pylib/peft ] || echo "no $D/pylib/peft: the peers use the image's own peft, if any"
export PYTHONPATH="$D/pylib${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import peft, transformers, torch; print('peft', peft.__version__, 'from', peft.__file__, '| transformers', transformers.__version__, '| torch', torch.__version__)" \
  || echo "peft import failed"
# peft_peer NAME [peft_train_step.py flags…] (stopped after LIMIT seconds, default 300); full log in $OUT/NAME.log
peft_peer() {
  local name=$1; shift
  timeout ${LIMIT:-300} python3 bench/peers/peft_train_step.py --config $CONFIG --batch 2 --seq 2048 \
    --lora-r 16 --lora-alpha 32 --warmup 2 --steps 6 --json $OUT/$name.json "$@" > $OUT/$name.log 2>&1 \
    && grep -E "tokens/s" $OUT/$name.log || { echo "peer failed: $name"; grep -E "Error|error:" $OUT/$name.log | tail -3; }
}
# PEERS picks them: eager, compiled, compiled-liger (torch.compile over Liger Kernel's).
for peer in ${PEERS:-eager compiled}; do
  case $peer in
    eager) peft_peer peft-eager ;;
    compiled) peft_peer peft-compiled --compile ;;
    compiled-liger) peft_peer peft-compiled-liger --compile --liger ;;
  esac
done
