#!/usr/bin/env bash
# ft's 4-bit dequantization kernel (core/sys/src/kernels/nf4.cu) on one GPU.
# First ft-core's GPU test, carried as .device/nf4/ft_core_tests (`cargo test
# --release -p ft-core --lib --no-run`): the kernel against ATen's ops
# (nf4.rs) bit for bit — NF4 and FP4, double quantization on and off,
# fp32/bf16/fp16 weights into fp32/bf16/fp16, sizes off the block, an odd
# count, packed bytes and output at offsets — and both paths' bandwidth on
# Llama-7B's 4096×11008 and Llama-2-70B's 8192×28672 bf16 weights. Then
# `ft bench --breakdown` (.device/nf4/ft) on a 2-layer model of Llama-7B's
# width, whose kernel line includes "NF4 dequantization".
set -uo pipefail
source "$(dirname "$0")/env.sh"
D=.device/nf4
$D/ft_core_tests --ignored --nocapture --test-threads 1 nf4::tests 2>&1 | tee $OUT/nf4-test.log | grep -E "NF4|test result|panicked|differ"
python3 - > /tmp/llama7b-2layers.json <<'PY'
import json
print(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096,
  "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 2,
  "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
  "vocab_size": 32016, "torch_dtype": "bfloat16"}))
PY
[ -x $D/ft ] && timeout ${FT_LIMIT:-180} $D/ft bench --config /tmp/llama7b-2layers.json --gpus 1 --strategy ddp --batch 1 --seq 2048 \
  --warmup 2 --steps 3 --breakdown --json $OUT/ft-breakdown.json 2>&1 | grep -vE "^\[rank" | tail -3 | tee $OUT/ft-breakdown.log
