#!/usr/bin/env bash
# Regenerates tests/fixtures/'s models: tiny random models shaped like the
# real configs in ../shared (weights from `ft init-model`) and like the
# families users bring (weights from transformers itself, init_hf.py), with
# transformers' fp32 logits, loss, gradients and greedy tokens as the CPU
# tests' reference. Needs transformers in the venv (`.venv/bin/pip install
# transformers`); CI only reads the result.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/env.sh
cargo build --quiet
FT=target/debug/ft
CONFIGS=../shared/data/configs
OUT=tests/fixtures
MODELS=(bloom opt llama llama-gqa llama3 qwen2 mistral)
# Only the model fixtures: tests/fixtures/plan/ is not made here.
for name in "${MODELS[@]}"; do rm -rf "${OUT:?}/$name"; done
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
# From transformers' own random weights. Tied models repeat one token when
# decoding greedily, as BLOOM's does: at these sizes the blocks barely move
# the residual stream.
TINY='"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2'
# Llama 3.2's form (llama3 RoPE scaling, tied, head_dim apart from
# hidden/heads) in the hub's config keys (`rope_theta`, `rope_scaling`), with
# original_max_position_embeddings small enough that all three bands of the
# rescaling fall inside 40 positions, and weights drawn wider
# (initializer_range 0.1) so that attention, and with it RoPE, moves the
# logits: at 0.02 dropping the scaling changes them by under 1e-3, at 0.1 by
# 9%; wider still and bf16 leaves its 2e-2 bound.
python bench/parity/init_hf.py $OUT/llama3 --seed 7 --keep given --config "{\"model_type\": \"llama\", $TINY,
  \"head_dim\": 16, \"rope_theta\": 500000.0, \"rms_norm_eps\": 1e-05, \"max_position_embeddings\": 256,
  \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0,
  \"original_max_position_embeddings\": 64}, \"tie_word_embeddings\": true, \"initializer_range\": 0.1}"
# Qwen2 (tied, q/k/v biases) with its config as transformers 5 writes it
# (`rope_parameters`, `layer_types`).
python bench/parity/init_hf.py $OUT/qwen2 --seed 5 --keep saved --config "{\"model_type\": \"qwen2\", $TINY,
  \"tie_word_embeddings\": true, \"rope_theta\": 1000000.0, \"max_position_embeddings\": 128, \"use_sliding_window\": false,
  \"max_window_layers\": 2}"
# Mistral with a window of 5 keys, shorter than the 16-token rows and the 40
# positions of greedy decoding, in the hub's config keys.
python bench/parity/init_hf.py $OUT/mistral --seed 6 --keep given --config "{\"model_type\": \"mistral\", $TINY,
  \"rope_theta\": 10000.0, \"rms_norm_eps\": 1e-05, \"max_position_embeddings\": 128, \"sliding_window\": 5,
  \"tie_word_embeddings\": false}"
python bench/parity/parity.py --ft $FT --device cpu --batch 2 --seq 16 --write-fixtures \
  $OUT/bloom $OUT/opt $OUT/llama $OUT/llama-gqa $OUT/llama3 $OUT/qwen2 $OUT/mistral
