#!/usr/bin/env bash
# DPO on ONE GPU, BLOOM-560m (random weights, fp32 masters, bf16 compute), the
# sigmoid loss, 8 pairs a step, each sequence a prompt and a completion of ~270 tokens each, cut to 512
# (SQuAD's words in a seeded order): ft's `--task dpo`
# (padding-free pairs, each prompt run once — and, as FT_LAYOUTS says, twice —
# the reference precomputed) against TRL 1.16's
# DPOTrainer in the same call — its default (a reference model in memory),
# with precompute_ref_log_probs, and with that and torch.compile. TRL,
# datasets, dill and multiprocess travel in .whl (`pip download --no-deps`).
set -uo pipefail
source "$(dirname "$0")/lib.sh"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/trl-*.whl .whl/datasets-*.whl \
  .whl/dill-*.whl .whl/multiprocess-*.whl || { echo "FAILED install"; exit 1; }
CONFIG=$D/configs/bloom-560m/config.json BATCH=8 WARMUP=3 STEPS=10
make_pairs $((8 * 13))
# ft's layouts, comma-separated (default: both; the empty one is its default, each pair's prompt run once).
IFS=, read -ra FT_LAYOUTS <<< "${FT_LAYOUTS-,--set task.share_prompt=false}"
for layout in "${FT_LAYOUTS[@]}"; do
  name=ft-dpo${layout:+-unshared}
  timeout ${FT_LIMIT:-240} "$FT" train --task dpo --model $CONFIG --tokenizer $D/gpt2-tokenizer.json --train-file /tmp/prefs.jsonl \
    --max-seq-len 512 --set data.truncate=true --batch-size $BATCH --epochs 1 --dtype bf16 --lr 1e-6 --report-to jsonl \
    --set train.log_every=1 --output-dir $OUT/$name $layout > $OUT/$name.log 2>&1 || { echo "FAILED $name"; tail -20 $OUT/$name.log; }
  python3 - $OUT/$name $BATCH $WARMUP <<'PY'
import json, statistics, sys
d, batch, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"step_seconds"' in l]
s = json.load(open(f"{d}/summary.json"))
step = statistics.median(r["step_seconds"] for r in rows[warmup:])
tokens = statistics.median(r["tokens"] for r in rows[warmup:])
print(json.dumps({"ft": d.split("/")[-1], "steps": len(rows), "step_ms": step * 1e3, "pairs_per_s": batch / step, "tokens_per_s": tokens / step,
  "tokens_per_pair": tokens / batch, "peak_allocated_gb": s["memory_per_rank"][0]["peak"] / 1e9, "loss": s["final_train_loss"]}))
PY
  rm -rf $OUT/$name/final $OUT/$name/checkpoints $OUT/$name/tensorboard
done
# TRL's settings, comma-separated (default: all three; the empty one is its default).
IFS=, read -ra SETTINGS <<< "${TRL_SETTINGS-,--precompute,--precompute --compile}"
for peer in "${SETTINGS[@]}"; do
  name=trl${peer// /}
  PYTHONPATH=/tmp/site timeout ${LIMIT:-240} python3 bench/peers/trl_dpo_step.py --config $CONFIG --tokenizer $D/gpt2-tokenizer.json \
    --data /tmp/prefs.jsonl --batch $BATCH --max-length 512 --warmup $WARMUP --steps $STEPS $peer --json $OUT/$name.json > $OUT/$name.log 2>&1 \
    && tail -n 1 $OUT/$name.log || { echo "peer failed: $name"; grep -E "Error|error" $OUT/$name.log | tail -3; }
done
