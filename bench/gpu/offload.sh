#!/usr/bin/env bash
# CPU offload side by side (one call): BLOOM-560m, 2 GPUs, full_shard,
# 8 x 512 tokens per GPU, bf16 — ft with and without --offload cpu, PyTorch
# FSDP2 with and without CPUOffloadPolicy; then Llama-7B shape (CodeLlama)
# full_shard + offload on 1 GPU. ft reads packed text (every sequence 512
# tokens); the peer uses random 512-token batches. Steady-state figures:
# ft's median step time after 5 warm-up steps, the peer's mean over 10 steps
# after 3.
set -uo pipefail
source "$(dirname "$0")/env.sh"
D=.device
python3 - > /tmp/words.txt <<'PY'
import random
random.seed(0)
words = [w.strip() for w in open(".device/squad.json").read().split() if w.isalpha()][:20000]
for _ in range(12000):
    print(" ".join(random.choice(words) for _ in range(60)))
PY
ft_run() {  # name gpus model seq batch steps extra...
  local name=$1 gpus=$2 model=$3 seq=$4 batch=$5 steps=$6; shift 6
  "$FT" train --model $D/configs/$model/config.json --tokenizer $D/gpt2-tokenizer.json --train-file /tmp/words.txt \
    --max-seq-len $seq --batch-size $batch --epochs 1 --train-samples $((batch * gpus * steps)) --eval-samples 0 \
    --dtype bf16 --lr 1e-5 --nproc-per-node $gpus --output-dir $OUT/$name "$@" > $OUT/$name.log 2>&1 \
    || { echo "FAILED $name"; tail -15 $OUT/$name.log; }
  python3 - $OUT/$name $gpus $batch $seq <<'PY'
import json, statistics, sys
d, gpus, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"step_seconds"' in l]
s = json.load(open(f"{d}/summary.json"))
step = statistics.median(r["step_seconds"] for r in rows[5:])
cpu = [r.get("offload_cpu_step_seconds") for r in rows[5:] if "offload_cpu_step_seconds" in r]
wait = [r.get("offload_wait_seconds") for r in rows[5:] if "offload_wait_seconds" in r]
print(json.dumps({"ft": d.split("/")[-1], "gpus": gpus, "step_ms": step * 1e3, "tokens_per_s_per_gpu": batch * seq / step,
  "peak_allocated_gb": s["memory_per_rank"][0]["peak"] / 1e9, "host_peak_gb": s["host_peak_per_rank"][0] / 1e9,
  "cpu_step_ms": statistics.median(cpu) * 1e3 if cpu else None, "wait_ms": statistics.median(wait) * 1e3 if wait else None, "state": s["state_per_rank"][0], "loss": s["final_train_loss"]}))
PY
}
peer() { torchrun --nproc-per-node $1 bench/peers/fsdp2_train_step.py --config $D/configs/$2/config.json "${@:3}" 2>&1 | grep -E '^\{|Error|error' | tail -3; }
ft_run bloom-zero3-offload 2 bloom-560m 512 8 25 --strategy full_shard --offload cpu
ft_run bloom-zero3 2 bloom-560m 512 8 25 --strategy full_shard
peer 2 bloom-560m --mode fsdp2 --offload --steps 6 --warmup 2
peer 2 bloom-560m --mode fsdp2
# CodeLlama-7B's shape with GPT-2's vocabulary (the tokenizer we carry): 50304 rows instead of 32016.
mkdir -p /tmp/llama7b && python3 -c "import json; c = json.load(open('$D/configs/codellama-7b/config.json')); c['vocab_size'] = 50304; json.dump(c, open('/tmp/llama7b/config.json', 'w'))"
mkdir -p $D/configs/llama7b-gpt2vocab && cp /tmp/llama7b/config.json $D/configs/llama7b-gpt2vocab/
ft_run llama7b-offload-1gpu 1 llama7b-gpt2vocab 2048 2 8 --strategy full_shard --offload cpu
rm -rf $OUT/*/final $OUT/*/tensorboard $OUT/*/metrics.csv $OUT/*/predictions*.json
