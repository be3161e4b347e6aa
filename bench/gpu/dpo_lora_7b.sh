#!/usr/bin/env bash
# DPO with LoRA on the Llama-7B shape (CodeLlama-7B config, random weights,
# bf16), ONE GPU, r=16 alpha=32 on every linear layer, the sigmoid loss, 4
# pairs a step, each sequence (prompt + completion) cut to 512 tokens: ft's
# `--task dpo` with the base (adapters off) as the reference each step
# (`task.precompute_ref=false`) and with the reference precomputed, beside
# TRL 1.16's DPOTrainer + peft (reference = adapters off), eager and under
# torch.compile, in the same call. The tokenizer: a 32,000-token BPE trained
# on the pairs (CodeLlama's vocabulary holds 32,016). TRL, datasets, dill and
# multiprocess travel in .whl (`pip download --no-deps`); peft is the image's.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/trl-*.whl .whl/datasets-*.whl \
  .whl/dill-*.whl .whl/multiprocess-*.whl || { echo "FAILED install"; exit 1; }
CONFIG=${CONFIG:-$D/configs/codellama-7b/config.json} BATCH=4 WARMUP=3 STEPS=8
LORA="--lora-r 16 --lora-alpha 32 --lora-targets q,k,v,o,gate,up,down"
make_pairs $((4 * 12))
python3 - <<'PY'
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
tokenizer = Tokenizer(models.BPE())
tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
tokenizer.train(["/tmp/prefs.jsonl", ".device/squad.json"], trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"]))
tokenizer.save("/tmp/tokenizer.json")
PY
for reference in base precomputed; do
  precompute=true; [ $reference = base ] && precompute=false
  timeout ${FT_LIMIT:-240} "$FT" train --task dpo --model $CONFIG --tokenizer /tmp/tokenizer.json --train-file /tmp/prefs.jsonl \
    --max-seq-len 512 --set data.truncate=true --batch-size $BATCH --epochs 1 --dtype bf16 --lr 1e-5 $LORA --set task.precompute_ref=$precompute \
    --report-to jsonl --set train.log_every=1 --output-dir $OUT/ft-dpo-$reference > $OUT/ft-dpo-$reference.log 2>&1 \
    || { echo "FAILED ft dpo $reference"; tail -20 $OUT/ft-dpo-$reference.log; }
  python3 - $OUT/ft-dpo-$reference $BATCH $WARMUP <<'PY'
import json, statistics, sys
d, batch, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"step_seconds"' in l]
s = json.load(open(f"{d}/summary.json"))
step = statistics.median(r["step_seconds"] for r in rows[warmup:])
tokens = statistics.median(r["tokens"] for r in rows[warmup:])
print(json.dumps({"ft": d.split("/")[-1], "steps": len(rows), "step_ms": step * 1e3, "pairs_per_s": batch / step, "tokens_per_s": tokens / step,
  "tokens_per_pair": tokens / batch, "peak_allocated_gb": s["memory_per_rank"][0]["peak"] / 1e9, "loss": s["final_train_loss"]}))
PY
  rm -rf $OUT/ft-dpo-$reference/final $OUT/ft-dpo-$reference/checkpoints
done
# TRL's settings, comma-separated (default: eager and compiled).
IFS=, read -ra SETTINGS <<< "${TRL_SETTINGS-,--compile}"
for peer in "${SETTINGS[@]}"; do
  name=trl-peft${peer// /}
  PYTHONPATH=/tmp/site timeout ${LIMIT:-300} python3 bench/peers/trl_dpo_step.py --config $CONFIG --tokenizer /tmp/tokenizer.json \
    --data /tmp/prefs.jsonl --batch $BATCH --max-length 512 --warmup $WARMUP --steps $STEPS --lora 16 $peer --json $OUT/$name.json > $OUT/$name.log 2>&1 \
    && tail -n 1 $OUT/$name.log || { echo "peer failed: $name"; grep -E "Error|error" $OUT/$name.log | tail -3; }
done
