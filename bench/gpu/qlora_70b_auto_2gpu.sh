#!/usr/bin/env bash
# The configuration `ft plan` picks (what `ft train --strategy auto` runs) for
# Llama-2-70B QLoRA r16 on every linear layer, two 80 GB GPUs, one sequence
# of 2048 tokens per GPU — then that configuration measured with its
# prediction beside it (`ft bench --plan-check`), random weights quantized
# unit by unit as they are made.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
CONFIG=bench/configs/llama-2-70b.json
LORA="--lora-r 16 --lora-alpha 32 --lora-targets q,k,v,o,gate,up,down --quantize nf4"
"$FT" plan --model $CONFIG --gpus 2 --batch 1 --seq 2048 $LORA --json $OUT/plan-70b.json | grep -E "^recommended"
read -r strategy offload checkpointing < <(python3 -c "
import json; r = json.load(open('$OUT/plan-70b.json'))['recommended']
print(r['strategy'], r['offload'], '--activation-checkpointing' if r['activation_checkpointing'] else '')")
timeout ${FT_LIMIT:-240} "$FT" bench --config $CONFIG --gpus 2 --strategy $strategy --offload $offload $checkpointing --batch 1 --seq 2048 \
  $LORA --warmup 2 --steps 4 --plan-check --json $OUT/ft-qlora-70b-auto.json 2>&1 | grep -vE "^\[rank" | tail -8
