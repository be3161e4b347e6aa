#!/usr/bin/env bash
# Decoding's attention kernel against ATen's path (`ft bench --breakdown`'s
# decode_attention check: 32 rows, a cache of 576 slots, 16 padding and 256
# unwritten) over the head layouts the kernel takes: 1, 2, 3, 6 and 8 query
# heads per key head, head sizes 64 and 128, bf16 and fp32. Two-layer models
# of Qwen2.5-1.5B's width; CHECKS picks layouts (default: all).
set -uo pipefail
source "$(dirname "$0")/env.sh"
check() {
  local name=$1 dtype=$2; shift 2
  "$FT" bench --config bench/configs/qwen2.5-1.5b.json --set num_hidden_layers=2 --set vocab_size=4096 "$@" --dtype $dtype \
    --batch 1 --seq 128 --warmup 1 --steps 2 --breakdown --json $OUT/check-$name-$dtype.json > $OUT/check-$name-$dtype.log 2>&1 \
    || { echo "FAILED $name $dtype"; tail -5 $OUT/check-$name-$dtype.log; return; }
  python3 -c "import json, sys; c = json.load(open(sys.argv[1]))[0]['kernel_check']['decode_attention']; print(sys.argv[2], c)" \
    $OUT/check-$name-$dtype.json "$name $dtype"
}
for layout in ${CHECKS:-g6-hd128-bf16 g6-hd128-fp32 g1-hd128-bf16 g2-hd128-bf16 g8-hd128-bf16 g3-hd64-bf16 g4-hd64-fp32 g8-hd64-bf16}; do
  dtype=${layout##*-}
  case ${layout%-*} in
    g6-hd128) check ${layout%-*} $dtype ;;
    g1-hd128) check ${layout%-*} $dtype --set num_key_value_heads=12 ;;
    g2-hd128) check ${layout%-*} $dtype --set num_key_value_heads=6 ;;
    g8-hd128) check ${layout%-*} $dtype --set hidden_size=2048 --set num_attention_heads=16 --set num_key_value_heads=2 ;;
    g3-hd64) check ${layout%-*} $dtype --set num_attention_heads=24 --set num_key_value_heads=8 ;;
    g4-hd64) check ${layout%-*} $dtype --set num_attention_heads=24 --set num_key_value_heads=6 ;;
    g8-hd64) check ${layout%-*} $dtype --set num_attention_heads=24 --set num_key_value_heads=3 ;;
  esac
done
