#!/usr/bin/env bash
# ft opens CUDA at start where there are GPUs (core/sys/src/cuda.rs) instead
# of linking it. On 2 GPUs, each call of the shim's CUDA half: NCCL groups
# and devices (full_shard on 2 GPUs), streams and exact pinned host memory
# (--offload cpu), the allocator's counters (every summary), CUDA graphs
# (GRPO's rollout, 1.5B row) — with the binary from before the change
# (OLD, xz-compressed) beside the offload row: equal losses and memory.
# Then the ft-sys unit tests (TESTS, xz) with the GPU ones, one at a time:
# a GPU test opens CUDA before libtorch is asked about it, which another
# test running beside it may do first.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
OLD=${OLD:-.device/ft-old.xz} TESTS=${TESTS:-.device/ft-sys-tests.xz}
xz -dc "$OLD" > /tmp/ft-old && chmod +x /tmp/ft-old
python3 -c 'import torch; print("== GPU:", torch.cuda.get_device_name(0), "x", torch.cuda.device_count())'
echo "== what each binary needs, and what ft opens at start"
for binary in "$FT" /tmp/ft-old; do echo "$binary: $(readelf -d $binary | grep -o 'libtorch_cuda.so\|libc10_cuda.so' | tr '\n' ' ')"; done
LD_DEBUG=files "$FT" --version 2>&1 | grep -oE "calling init: .*/lib(torch_cuda|c10_cuda|ft_cuda)[^ ]*|calling init: /proc/self/fd/[0-9]+" | sort -u
make_text
FT=/tmp/ft-old ft_run bloom-offload-old 2 bloom-560m 512 8 25 --strategy full_shard --offload cpu
ft_run bloom-offload-new 2 bloom-560m 512 8 25 --strategy full_shard --offload cpu
cmp <(grep -oE '"loss": ?[0-9.e+-]+' $OUT/bloom-offload-old/metrics.jsonl) <(grep -oE '"loss": ?[0-9.e+-]+' $OUT/bloom-offload-new/metrics.jsonl) \
  && echo "== the offloaded runs' losses are equal step for step" || echo "== the offloaded runs' losses differ"
RUNS=ft-1.5b LIMIT=240 bash "$(dirname "$0")/grpo_1gpu.sh"
xz -dc "$TESTS" > /tmp/ft-sys-tests && chmod +x /tmp/ft-sys-tests
/tmp/ft-sys-tests --include-ignored --test-threads 1 2>&1 | tail -12
