#!/usr/bin/env bash
# The test suite (what `make test` and CI run): every crate's unit tests,
# the integration tests and the benches in test mode, then one total line.
# Tests that read the project's shared test data (tests/shared-files.txt,
# under ../shared or FT_SHARED_DIR) are skipped without it: one line before
# the tests says which files are missing and where they were looked for,
# and the skipped tests are listed after them. FT_REQUIRE_SHARED=1 (CI)
# stops at once instead when a file is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

# One absolute location for every test binary, whatever its working directory.
export FT_SHARED_DIR="$(realpath -m "${FT_SHARED_DIR:-../shared}")"
missing=()
while read -r file; do
    case "$file" in '' | '#'*) continue ;; esac
    [ -f "$FT_SHARED_DIR/$file" ] || missing+=("$file")
done < tests/shared-files.txt
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "${FT_REQUIRE_SHARED:-}" = 1 ]; then
        echo "FT_REQUIRE_SHARED=1 but the shared test data is missing under $FT_SHARED_DIR: ${missing[*]}" >&2
        exit 1
    fi
    echo "shared test data: ${missing[*]} not under $FT_SHARED_DIR (set FT_SHARED_DIR to where it is): the tests that read them are skipped and listed at the end"
fi

# Two tests run at once, many of them start several ranks, and each process's
# OpenMP threads (libtorch's, in ft and in the reference pythons) spin while
# they wait for one another: on a machine with fewer cores than busy threads
# the spinning takes the cores the others need (a one-rank run beside
# another took 5 to 7 times the CPU time). Sleeping waiters cost nothing here.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
# The tests' tensors of a few to a hundred MB (logits over GPT-2's 50,257
# tokens) are mapped afresh at every step, and the kernel faulted them in 4 KiB
# at a time; in transparent huge pages, malloc's mappings cost a third less
# system time.
export GLIBC_TUNABLES="${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}"

# One thread a process (ATen's and MKL's, in ft and in the reference
# pythons; a run's ranks already share the cores): the tests' models are too
# small for a second thread to pay. A one-rank epoch of the demo took 24.6 s
# of CPU and 24.6 s of wall time with one, 34.5 s and 25.9 s with two.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Three tests at once on two cores (libtest's default is one a core): a test
# leaves its core idle part of the time (its processes starting, its Python
# references importing, its ranks waiting on one another). The integration
# binary with two kept 1.67 cores busy and took 1,086 s; with three, 1.71 and
# 1,029 s (2026-11-30, the EPYC of bench/results/test-suite-times.md).
# (nproc counts cores unless OMP_NUM_THREADS is set, which it then prints.)
cores="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-$(( cores * 3 / 2 ))}"
# fsync returns at once (eatmydata, which set-up installs): ft syncs every
# checkpoint file it writes, the tests' runs save hundreds of checkpoints,
# and each sync waited on the disk with the core idle (the integration
# binary: 990 s against 1,029). A test's crash is a process's, which loses
# nothing the page cache holds, so what the tests prove is unchanged.
nosync=()
if command -v eatmydata >/dev/null; then
    nosync=(eatmydata)
fi

# The Python references' modules are compiled to bytecode by their first
# import, into .venv, once (set-up compiles none of them). Where the
# environment asks Python not to write bytecode, every reference process
# would compile all it imports again: 45 s of CPU for the libraries one
# reference imports, where reading the bytecode takes 19 s.
unset PYTHONDONTWRITEBYTECODE

log="$(mktemp)"
# Each skipped test appends a line (tests/common/shared.rs).
export FT_TEST_SKIPS="$(mktemp)"
# The plug-in tests load the workspace's cdylibs, which `cargo test` does not
# build. With the tests in the same build, the libraries are compiled once,
# with the features the tests' dev-dependencies add: a build of the libraries
# alone resolves other features, and `cargo test` compiled ft-core, the
# plug-ins and ft a second time.
cargo build --workspace --all-targets 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if [ "$status" -eq 0 ]; then
    # Every test binary runs even after one fails, so one run shows every
    # failure. libtest's --report-time (unstable: RUSTC_BOOTSTRAP, given to
    # the test processes alone by the runner, so nothing is rebuilt) puts
    # each test's seconds on its line, for the times below; the criterion
    # benches (`--bench '*'`: `--benches` would run the libraries' unit
    # tests again), run once each in test mode, take no libtest flags. They
    # run first: the plug-in template's test builds in this target directory
    # with features of its own, and a cargo run after it would rebuild.
    "${nosync[@]}" cargo test --workspace --bench '*' --no-fail-fast 2>&1 | tee -a "$log"
    status=${PIPESTATUS[0]}
    runner="CARGO_TARGET_$(rustc -vV | sed -n 's/^host: //p' | tr 'a-z-' 'A-Z_')_RUNNER"
    export "$runner=env RUSTC_BOOTSTRAP=1"
    # The other crates' tests run beside ft's own (the integration binary):
    # their binaries kept one or two cores busy for ~50 s (NVRTC compiling
    # the kernels, the SQuAD references), and the integration binary leaves
    # about a tenth of the cores idle while its tests wait on processes they
    # start. Their output follows ft's. The integration binary starts once
    # the others' cargo has checked the build and runs its tests, so the two
    # never wait on the target directory's lock for long. (`--tests` takes
    # every target whose tests are on; `--bins` would also build ft's, which
    # has none: Cargo.toml turns them off.) The others run in a process group
    # of their own, stopped with this script: a command started in the
    # background ignores Ctrl-C.
    flags=(--tests --examples --no-fail-fast -- -Z unstable-options --report-time)
    others="$(mktemp)"
    "${nosync[@]}" setsid cargo test --workspace --exclude ft --lib "${flags[@]}" > "$others" 2>&1 &
    others_pid=$!
    trap 'kill -TERM -- "-$others_pid" 2>/dev/null' EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    until grep -q '^     Running ' "$others" || ! kill -0 "$others_pid" 2>/dev/null; do sleep 0.2; done
    "${nosync[@]}" cargo test -p ft "${flags[@]}" 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    wait "$others_pid" || status=1
    trap - EXIT INT TERM
    tee -a "$log" < "$others"
    rm -f "$others"
    unset "$runner"
    scripts/test-times.sh "$log"
fi
# A skipped test passed as far as cargo knows: it is counted as skipped, not passed.
skipped="$(sort -u "$FT_TEST_SKIPS" | grep -c .)"
if [ "$skipped" -gt 0 ]; then
    echo "skipped ($skipped: shared test data missing, or a reference that cannot run on this machine):"
    sort -u "$FT_TEST_SKIPS" | sed 's/^/  /'
fi
awk -v skipped="$skipped" '/^test result:/ { passed += $4; failed += $6 }
    END { printf "tests: %d passed, %d failed, %d skipped\n", passed - skipped, failed, skipped }' "$log"
rm -f "$log" "$FT_TEST_SKIPS"
exit "$status"
