#!/usr/bin/env bash
# The test suite (what `make test` and CI run): every crate's unit tests,
# the integration tests and the benches in test mode, then one total line.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
log="$(mktemp)"
# The plug-in tests load the workspace's cdylibs, which `cargo test` does not build.
cargo build --workspace 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if [ "$status" -eq 0 ]; then
    # Every test binary runs even after one fails, so one run shows every failure.
    cargo test --workspace --all-targets --no-fail-fast 2>&1 | tee -a "$log"
    status=${PIPESTATUS[0]}
fi
awk '/^test result:/ { passed += $4; failed += $6 } END { printf "tests: %d passed, %d failed\n", passed, failed }' "$log"
rm -f "$log"
exit "$status"
