#!/usr/bin/env bash
# Packing (`--packing`) against padded batches on one GPU: prompt/completion
# data of skewed lengths (seven in eight examples of 20-170 words, the rest
# of 700-1400, words from the SQuAD file), max_seq_len 2048, bf16, 8 rows a
# step, the same 1024 examples either way; BLOOM-560m (ALiBi: an attention
# bias either way) and OPT-1.3B (plain causal attention when padded).
# Steady-state non-padding tokens/s: the steps' `tokens` over their
# `step_seconds` after 5 warm-up steps (metrics.jsonl).
# Carry .device/ with: ft, configs/, gpt2-tokenizer.json, squad.json.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 - > /tmp/skewed.jsonl <<'PY'
import json, random
random.seed(0)
words = [w for w in open(".device/squad.json").read().split() if w.isalpha()][:20000]
for i in range(1024):
    n = random.randint(700, 1400) if i % 8 == 7 else random.randint(20, 170)
    half = n // 2
    print(json.dumps({"prompt": " ".join(random.choice(words) for _ in range(half)),
                      "completion": " " + " ".join(random.choice(words) for _ in range(n - half))}))
PY
for model in bloom-560m opt-1.3b; do
  for mode in padded packed; do
    flags=(); [ $mode = packed ] && flags=(--packing)
    name=$model-$mode
    "$FT" train --model $D/configs/$model/config.json --tokenizer $D/gpt2-tokenizer.json --train-file /tmp/skewed.jsonl \
      --max-seq-len 2048 --batch-size 8 --epochs 1 --eval-samples 0 --dtype bf16 --lr 1e-5 --set train.log_every=1 \
      --report-to jsonl --output-dir $OUT/$name "${flags[@]}" > $OUT/$name.log 2>&1 || { echo "FAILED $name"; tail -15 $OUT/$name.log; continue; }
    grep -oE "packing: .*" $OUT/$name.log | head -1
    python3 - $OUT/$name <<'PY'
import json, sys
d = sys.argv[1]
rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"step_seconds"' in l][5:]
s = json.load(open(f"{d}/summary.json"))
tokens, seconds = sum(r["tokens"] for r in rows), sum(r["step_seconds"] for r in rows)
print(json.dumps({"run": d.split("/")[-1], "steps": len(rows) + 5, "tokens_per_s": tokens / seconds,
  "step_ms": 1e3 * seconds / len(rows), "peak_gb": s["memory_per_rank"][0]["peak"] / 1e9, "loss": s["final_train_loss"]}))
PY
    rm -rf $OUT/$name/final $OUT/$name/tensorboard $OUT/$name/checkpoints
  done
done
