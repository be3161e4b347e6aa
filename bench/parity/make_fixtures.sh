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
MODELS=(bloom opt llama llama-gqa llama3 qwen2 mistral qwen3 gemma2 gemma3 phi3 phi4-mini)
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
# Qwen3 (tied, per-head q/k norms, head_dim 16 apart from hidden/heads) as
# transformers 5 writes it; weights drawn wider so that attention moves the logits.
python bench/parity/init_hf.py $OUT/qwen3 --seed 8 --keep saved --config "{\"model_type\": \"qwen3\", $TINY,
  \"head_dim\": 16, \"tie_word_embeddings\": true, \"rope_theta\": 1000000.0, \"max_position_embeddings\": 128,
  \"initializer_range\": 0.1}"
# Gemma 2: layer 0 slides over 4 keys, layer 1 is global; soft-caps small
# enough that they change the logits at these sizes; query_pre_attn_scalar
# apart from head_dim. Gemma's and Phi-3's pad_token_id is null here: their
# configs' ids lie outside this vocabulary, and transformers' embedding
# would zero the pad row's gradient (ft's trains every row).
python bench/parity/init_hf.py $OUT/gemma2 --seed 9 --keep saved --config "{\"model_type\": \"gemma2\", $TINY,
  \"head_dim\": 16, \"query_pre_attn_scalar\": 24, \"sliding_window\": 4, \"attn_logit_softcapping\": 2.0,
  \"final_logit_softcapping\": 3.0, \"max_position_embeddings\": 128, \"pad_token_id\": null, \"initializer_range\": 0.06}"
# Gemma 3 (text) in the hub's keys: 2 local layers (a window of 4 keys, base
# rope_local_base_freq) to 1 global (rope_theta, with Gemma 3 4B's linear
# scaling), as sliding_window_pattern 3 makes them.  Its bf16 row misses the 2e-2
# bound (about 3e-2 to 5e-2, by the seed): at these sizes transformers' own
# bf16 logits lie 4e-2 from its fp32 ones, eager or SDPA.
python bench/parity/init_hf.py $OUT/gemma3 --seed 10 --keep given --config "{\"model_type\": \"gemma3_text\", $TINY,
  \"num_hidden_layers\": 3, \"head_dim\": 16, \"query_pre_attn_scalar\": 24, \"sliding_window\": 4,
  \"sliding_window_pattern\": 3, \"rope_theta\": 1000000.0, \"rope_local_base_freq\": 10000.0,
  \"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 8.0}, \"final_logit_softcapping\": null,
  \"attn_logit_softcapping\": null, \"max_position_embeddings\": 128, \"pad_token_id\": null, \"initializer_range\": 0.06}"
# Phi-3 with LongRoPE in the hub's keys and an original length of 2, so that
# every sequence of the tests (the shortest packed example has 3 tokens)
# rotates with the long factors and the attention factor — transformers
# switches factor sets by the batch's longest position and recomputes its
# cache on the crossing, which ft's cache does not (phi3.rs) — and a window
# of 12 keys on every layer.
python bench/parity/init_hf.py $OUT/phi3 --seed 11 --keep given --config "{\"model_type\": \"phi3\", $TINY,
  \"rope_theta\": 10000.0, \"max_position_embeddings\": 64, \"original_max_position_embeddings\": 2,
  \"rope_scaling\": {\"type\": \"longrope\", \"short_factor\": [1.0, 1.5, 2.0, 3.0],
  \"long_factor\": [1.0, 4.0, 9.0, 16.0]}, \"sliding_window\": 12, \"tie_word_embeddings\": false,
  \"pad_token_id\": null, \"bos_token_id\": 1, \"eos_token_id\": 2,
  \"initializer_range\": 0.1}"
# Phi-4-mini's form (tied, partial_rotary_factor 0.75: 12 of a head's 16
# features rotate) as transformers 5 writes it.
python bench/parity/init_hf.py $OUT/phi4-mini --seed 12 --keep saved --config "{\"model_type\": \"phi3\",
  \"vocab_size\": 128, \"hidden_size\": 64, \"intermediate_size\": 64, \"num_hidden_layers\": 2,
  \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"partial_rotary_factor\": 0.75,
  \"rope_theta\": 10000.0, \"max_position_embeddings\": 64, \"original_max_position_embeddings\": 2,
  \"rope_scaling\": {\"type\": \"longrope\", \"short_factor\": [1.0, 1.0, 1.5, 2.0, 3.0, 4.0],
  \"long_factor\": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0]}, \"tie_word_embeddings\": true, \"initializer_range\": 0.06,
  \"pad_token_id\": null, \"bos_token_id\": 1, \"eos_token_id\": 2}"
python bench/parity/parity.py --ft $FT --device cpu --batch 2 --seq 16 --write-fixtures \
  $OUT/bloom $OUT/opt $OUT/llama $OUT/llama-gqa $OUT/llama3 $OUT/qwen2 $OUT/mistral \
  $OUT/qwen3 $OUT/gemma2 $OUT/gemma3 $OUT/phi3 $OUT/phi4-mini
