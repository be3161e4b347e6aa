#!/usr/bin/env bash
# Issue 26's single-GPU rows, each ft beside its peers in this one call:
# ROWS names the bench/gpu scripts to run (default: eval bert_qa bloom).
# Every script writes into /tmp/single-gpu/<script>; all of it comes back as
# one archive under $OUT (a call returns at most 8 files), traces over 4 MB left out.
set -uo pipefail
R=/tmp/single-gpu
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for row in ${ROWS:-eval bert_qa bloom}; do
  mkdir -p $R/$row
  echo "=== $row ($(date +%T))"
  # One row's overrun stops that row, not the archive.
  OUT=$R/$row timeout ${ROW_LIMIT:-300} bash "$(dirname "$0")/$row.sh" || echo "=== $row stopped: exit $?"
done
find $R -type f -size +4M -delete
tar czf $OUT/single-gpu-$(date +%H%M%S).tgz -C $R .
