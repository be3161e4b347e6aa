#!/usr/bin/env bash
# GRPO on ONE GPU (issue 50's rows): ft's `--task grpo` — completions sampled
# by its own generator from the weights being trained — against TRL 1.16's
# GRPOTrainer without vLLM (transformers' `generate`) in the same call.
# Random weights: completions run to max_completion_length on both sides.
# Qwen2.5-1.5B's shape, full fine-tune (fp32 masters, bf16 compute), 4
# prompts x 8 generations and 8 x 8, 512 completion tokens, dapo (TRL's
# default), β 0; CodeLlama-7B's shape with LoRA r16 on every linear layer
# (a bf16 base; GPT-2's vocabulary). The rollout row is ft's sampling alone (its
# rollout/tokens_per_second) against the HBM roofline: the bytes of the
# weights and of the KV cache (at the rows' mean length) read per decode
# step over 4.8 TB/s. The 2gpu rows (not in the default set) need two GPUs.
# RUNS picks rows (default: all); LIMIT per run (s).
# TRL, datasets, dill and multiprocess travel in .whl (`pip download --no-deps`).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/trl-*.whl .whl/datasets-*.whl \
  .whl/dill-*.whl .whl/multiprocess-*.whl || { echo "FAILED install"; exit 1; }
python3 -c 'import torch; print("== GPU:", torch.cuda.get_device_name(0), "torch", torch.__version__)'
make_grpo_prompts
# CodeLlama-7B's blocks with GPT-2's vocabulary (the tokenizer both sides read).
QWEN=bench/configs/qwen2.5-1.5b.json LLAMA=bench/configs/llama-7b-gpt2-vocab.json
LORA="--lora-r 16 --lora-alpha 32 --lora-targets all-linear"

# ft_grpo NAME CONFIG PROMPTS [flags…]: a step a generation of PROMPTS x 8 completions (micro-batches of 8), 5 steps.
ft_grpo() {
  local name=$1 config=$2 prompts=$3; shift 3
  timeout ${LIMIT:-300} "$FT" train --task grpo --model $config --tokenizer $D/gpt2-tokenizer.json --train-file /tmp/prompts.jsonl \
    --reward /tmp/reward.py:ids_reward --batch-size 8 --grad-accum $prompts --max-steps 5 --dtype bf16 --lr 1e-6 --max-seq-len 640 \
    --set task.num_generations=8 --set task.max_completion_length=512 --set data.shuffle=false --set train.log_every=1 \
    --report-to jsonl --output-dir $OUT/$name "$@" > $OUT/$name.log 2>&1 || { echo "FAILED $name"; grep -v "^\[rank" $OUT/$name.log | tail -15; return; }
  python3 - $OUT/$name $config $((prompts * 8)) <<'PY'
import json, statistics, sys
d, config = sys.argv[1], json.load(open(sys.argv[2]))
rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"step_seconds"' in l][1:]
s = json.load(open(f"{d}/summary.json"))
step = statistics.median(r["step_seconds"] for r in rows)
rollout = statistics.median(r["rollout/seconds"] for r in rows)
sampled = statistics.median(r["rollout/tokens_per_second"] for r in rows)
length = statistics.mean(r["completions/mean_length"] for r in rows)
# The roofline: the weights (bf16; the embedding rows a step looks up aside) and the KV cache at the rows' mean context, read once a decode step.
h, layers, heads, inter, vocab = (config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"))
kv_heads = config.get("num_key_value_heads", heads)
head_dim = config.get("head_dim", h // heads)
weights = 2 * (vocab * h + layers * (2 * h * heads * head_dim + 2 * h * kv_heads * head_dim + 3 * h * inter))
kv_per_token = layers * 2 * kv_heads * head_dim * 2
rows_per_step = int(sys.argv[3])
context = 48 * 1.3 + length / 2
step_bytes = weights + rows_per_step * context * kv_per_token
roofline = rows_per_step / (step_bytes / 4.8e12)
print(json.dumps({"ft": d.split("/")[-1], "steps": len(rows) + 1, "step_ms": step * 1e3, "steps_per_s": 1 / step, "rollout_ms": rollout * 1e3,
  "rollout_share": rollout / step, "sampled_tokens_per_s": sampled, "roofline_tokens_per_s": roofline, "of_roofline": sampled / roofline,
  "mean_completion_length": length, "peak_allocated_gb": s["memory_per_rank"][0]["peak"] / 1e9, "reward": rows[-1].get("reward")}))
PY
  grep -m2 -iE "graph|warn" $OUT/$name.log
  rm -rf $OUT/$name/final $OUT/$name/checkpoints $OUT/$name/base-model
}

# profiled NAME CONFIG PROMPTS [flags…]: ft_grpo with step 3 profiled; its kernels' table and trace_gaps.py's summary.
profiled() {
  local name=$1; shift
  ft_grpo $name "$@" --profile-steps 3:3
  head -24 $OUT/$name/profile/*.kernels.tsv | cut -c1-160
  python3 bench/gpu/trace_gaps.py $OUT/$name/profile/*.trace.json | head -40 | cut -c1-160; rm -f $OUT/$name/profile/*.trace.json
}

trl_grpo() {
  local name=$1; shift
  PYTHONPATH=/tmp/site timeout ${LIMIT:-300} python3 bench/peers/trl_grpo_step.py --tokenizer $D/gpt2-tokenizer.json --data /tmp/prompts.jsonl \
    --generations 8 --completion 512 --json $OUT/$name.json "$@" > $OUT/$name.log 2>&1 \
    && tail -n 1 $OUT/$name.log || { echo "peer failed: $name"; grep -E "Error|error" $OUT/$name.log | tail -3; }
}

for run in ${RUNS:-ft-1.5b ft-1.5b-8x8 ft-7b-lora trl-1.5b trl-7b-lora}; do
  echo "== $run"
  case $run in
    ft-1.5b) ft_grpo $run $QWEN 4 ;;
    ft-1.5b-8x8) ft_grpo $run $QWEN 8 ;;
    ft-7b-lora) ft_grpo $run $LLAMA 4 $LORA ;;
    ft-7b-lora-8x8) ft_grpo $run $LLAMA 8 $LORA ;;
    # Step 3's GPU time per kernel (the rollout's 512 decoding steps and the update), and where the GPU idles.
    ft-1.5b-profile) profiled $run $QWEN 4 ;;
    ft-1.5b-8x8-profile) profiled $run $QWEN 8 ;;
    ft-7b-lora-profile) profiled $run $LLAMA 4 $LORA ;;
    # Two GPUs, full_shard: the rollouts from the policy held whole through the rollout, or gathered a unit at a time.
    ft-1.5b-2gpu-whole) ft_grpo $run $QWEN 4 --nproc-per-node 2 --strategy full_shard --set train.rollout_gather=whole ;;
    ft-1.5b-2gpu-per-unit) ft_grpo $run $QWEN 4 --nproc-per-node 2 --strategy full_shard --set train.rollout_gather=per_unit ;;
    trl-1.5b) trl_grpo $run --config $QWEN --prompts 4 ;;
    trl-1.5b-paged) trl_grpo $run --config $QWEN --prompts 4 --paged ;;
    trl-1.5b-8x8) trl_grpo $run --config $QWEN --prompts 8 ;;
    trl-7b-lora) trl_grpo $run --config $LLAMA --prompts 4 --lora 16 ;;
    # Without checkpointing TRL's 7B LoRA step of 4 x 8 x 512 ran out of the H200's memory (2026-11-28).
    trl-7b-lora-checkpointing) trl_grpo $run --config $LLAMA --prompts 4 --lora 16 --checkpointing --steps 2 ;;
  esac
done
