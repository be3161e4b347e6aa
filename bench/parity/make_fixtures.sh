#!/usr/bin/env bash
# Regenerates tests/fixtures/: tiny random models shaped like the real configs
# in ../shared, with transformers' fp32 logits, loss, gradients and greedy
# tokens as the CPU tests' reference. Needs transformers in the venv
# (`.venv/bin/pip install transformers`); CI only reads the result.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/env.sh
cargo build --quiet
FT=target/debug/ft
CONFIGS=../shared/data/configs
OUT=tests/fixtures
rm -rf "$OUT" && mkdir -p "$OUT"
TINY_VOCAB=(--set vocab_size=128)
$FT init-model --config $CONFIGS/bloom-560m/config.json --out $OUT/bloom --seed 1 "${TINY_VOCAB[@]}" \
  --set n_layer=2 --set hidden_size=32 --set n_head=4
$FT init-model --config $CONFIGS/opt-1.3b/config.json --out $OUT/opt --seed 2 "${TINY_VOCAB[@]}" \
  --set num_hidden_layers=2 --set hidden_size=32 --set num_attention_heads=4 --set ffn_dim=64 \
  --set word_embed_proj_dim=16 --set max_position_embeddings=64
$FT init-model --config $CONFIGS/codellama-7b/config.json --out $OUT/llama --seed 3 "${TINY_VOCAB[@]}" \
  --set num_hidden_layers=2 --set hidden_size=32 --set num_attention_heads=4 --set num_key_value_heads=4 \
  --set intermediate_size=64
$FT init-model --config $CONFIGS/codellama-7b/config.json --out $OUT/llama-gqa --seed 4 "${TINY_VOCAB[@]}" \
  --set num_hidden_layers=2 --set hidden_size=32 --set num_attention_heads=4 --set num_key_value_heads=2 \
  --set intermediate_size=64
python bench/parity/parity.py --ft $FT --device cpu --batch 2 --seq 16 --write-fixtures \
  $OUT/bloom $OUT/opt $OUT/llama $OUT/llama-gqa
