#!/usr/bin/env bash
# Llama-7B (CodeLlama-7B shape), full_shard on 2 GPUs, 2 x 2048 tokens per GPU,
# random weights, `--fp8 tensorwise` with float8 gathers (`--fp8-gathers true`)
# and with bf16 gathers (`--fp8-gathers false`), in one call. REDUCE=compute
# reduces the gradients in bf16 (`--reduce-dtype compute`); PROFILE=1 also
# writes each run's kernel table and Chrome trace to $OUT/profile. First
# (LOSSES=0 skips it): BLOOM-560m's losses over 12 steps at 2 GPUs with every
# block layer in float8, gathered as float8 and as bf16 (twice, the noise
# floor): a float8 gather sends the bytes the layer would cast, so they agree.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
if [ "${LOSSES:-1}" != 0 ]; then
  make_text
  for run in true false false-again; do
    ft_run bloom-fp8-gathers-$run 2 bloom-560m 512 8 12 --strategy full_shard --fp8 tensorwise --set train.fp8_layers=all \
      --set train.fp8_gathers=${run%-again} > /dev/null
  done
  python3 - $OUT <<'PY'
import json, sys
loss = lambda run: [json.loads(l)["loss"] for l in open(f"{sys.argv[1]}/bloom-fp8-gathers-{run}/metrics.jsonl") if '"step_seconds"' in l]
base = loss("false")
for run in ["true", "false-again"]:
    other = loss(run)
    worst = max(abs(a - b) / abs(b) for a, b in zip(other, base))
    print(f"BLOOM-560m fp8 losses, gathers {run} vs false: {len(other)} steps, identical {other == base}, largest relative difference {worst:.2e}")
PY
fi
CONFIG=$D/configs/codellama-7b/config.json
extra=()
[ -n "${REDUCE:-}" ] && extra+=(--reduce-dtype $REDUCE)
[ -n "${PROFILE:-}" ] && extra+=(--profile $OUT/profile)
for gathers in ${GATHERS:-true false}; do
  timeout ${FT_LIMIT:-170} "$FT" bench --config $CONFIG --gpus 2 --strategy full_shard --batch 2 --seq 2048 --warmup 3 --steps 5 \
    --fp8 tensorwise --fp8-gathers $gathers "${extra[@]}" --json $OUT/ft-fp8-gathers-$gathers.json > $OUT/ft-fp8-gathers-$gathers.log 2>&1 \
    || { echo "FAILED ft --fp8-gathers $gathers"; tail -20 $OUT/ft-fp8-gathers-$gathers.log; }
  grep -E "^\| llama|comm|gather" $OUT/ft-fp8-gathers-$gathers.log | head -8
  if [ -n "${PROFILE:-}" ]; then
    mkdir -p $OUT/profile-gathers-$gathers && mv $OUT/profile/* $OUT/profile-gathers-$gathers/ 2>/dev/null
    gzip -f $OUT/profile-gathers-$gathers/*.trace.json 2>/dev/null
  fi
done
