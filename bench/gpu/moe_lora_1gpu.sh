#!/usr/bin/env bash
# LoRA and QLoRA on a whole Qwen3-30B-A3B (48 layers, random weights) on ONE
# GPU (issue 49's rows 3 and 4): r16, alpha 32, on attention (q,k,v,o) and the
# experts, bf16 compute. ft at 2 x 2048 beside transformers + peft
# (`target_parameters` on the fused experts, the frozen base in bf16) at the
# largest batch it fits, and the same with the blocks' linear layers in
# bitsandbytes NF4 (which leaves the experts in bf16: transformers 5 holds
# them as parameters, not Linear layers). FT_ARGS adds ft flags;
# PEER_BATCHES (default "1x512 1x1024 2x2048") the peer's shapes, tried in order
# until one runs out of memory; SKIP_PEER=1, SKIP_FT=1, LIMIT per peer (s).
# bitsandbytes travels in .device/pylib, prepared as bench/gpu/qlora_7b.sh says.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
export PYTHONPATH="$D/pylib${PYTHONPATH:+:$PYTHONPATH}"
CONFIG=bench/configs/qwen3-30b-a3b.json
python3 -c 'import torch; print("== GPU:", torch.cuda.get_device_name(0), "torch", torch.__version__)'
if [ -z "${SKIP_FT:-}" ]; then
  # bf16 base with activation checkpointing (what `ft plan` recommends), the same with the adapters' state
  # offloaded, and the NF4 base, with and without offload (FT_VARIANTS picks).
  for variant in ${FT_VARIANTS:-bf16 bf16-offload nf4 nf4-offload}; do
    flags=(--lora-r 16 --lora-alpha 32 --lora-targets q,k,v,o,experts --activation-checkpointing)
    case $variant in *-offload) flags+=(--offload cpu) ;; esac
    case $variant in nf4*) flags+=(--quantize nf4) ;; esac
    "$FT" bench --config $CONFIG --gpus 1 --strategy ddp --batch 2 --seq 2048 --warmup 2 --steps 4 "${flags[@]}" ${FT_ARGS:-} \
      --json $OUT/ft-$variant.json > $OUT/ft-$variant.log 2>&1 \
      && summary "ft LoRA ($variant) 2x2048" $OUT/ft-$variant.json \
      || { echo "== ft LoRA ($variant): FAILED"; grep -vE "^\[rank" $OUT/ft-$variant.log | tail -6; }
  done
fi
[ -n "${SKIP_PEER:-}" ] && exit 0
for quant in bf16 nf4; do
  for shape in ${PEER_BATCHES:-1x512 1x1024 2x2048}; do
    batch=${shape%x*}; seq=${shape#*x}
    timeout ${LIMIT:-240} python3 bench/peers/peft_train_step.py --config $CONFIG --batch $batch --seq $seq --warmup 1 --steps 3 \
      --lora-r 16 --lora-alpha 32 --targets q_proj,k_proj,v_proj,o_proj --target-parameters mlp.experts.gate_up_proj,mlp.experts.down_proj \
      $([ $quant = nf4 ] && echo --qlora) --json $OUT/peft-$quant-$shape.json > $OUT/peft-$quant-$shape.log 2>&1 \
      && summary "transformers + peft ($quant base) $shape" $OUT/peft-$quant-$shape.json \
      || { echo "== transformers + peft ($quant base) $shape: FAILED (rc $?)"; grep -E "Error|error" $OUT/peft-$quant-$shape.log | tail -2; break; }
  done
done
