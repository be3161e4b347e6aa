#!/usr/bin/env bash
# Llama-7B (CodeLlama-7B shape) full fine-tune on ONE GPU, 2 x 2048, bf16
# (ft: bf16 compute over fp32 masters; peers: fp32 weights under autocast):
# `ft bench` with its kernel check beside transformers + torch.compile, with
# and without Liger Kernel (PEERS picks: compiled, compiled-liger). Needs
# about 125 GB of GPU memory: an H200.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
CONFIG=$D/configs/codellama-7b/config.json
"$FT" bench --config $CONFIG --gpus 1 --strategy ddp --batch 2 --seq 2048 --warmup 3 --steps 6 \
  --breakdown --json $OUT/ft-llama7b.json 2>&1 | grep -vE "^\[rank" | tail -4
export PYTHONPATH="$D/pylib${PYTHONPATH:+:$PYTHONPATH}"
for peer in ${PEERS:-compiled compiled-liger}; do
  case $peer in
    compiled) flags="--compile" ;;
    compiled-liger) flags="--compile --liger" ;;
  esac
  timeout ${LIMIT:-300} python3 bench/peers/hf_train_step.py --config $CONFIG --batch 2 --seq 2048 --warmup 2 --steps 5 \
    $flags --json $OUT/hf-$peer.json > $OUT/hf-$peer.log 2>&1 && tail -n 1 $OUT/hf-$peer.log \
    || { echo "peer failed: $peer"; grep -E "Error|error:" $OUT/hf-$peer.log | tail -3; }
done
