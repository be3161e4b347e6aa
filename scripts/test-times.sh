#!/usr/bin/env bash
# Where a test run's time went, from cargo test's output (a file): each test
# binary's wall seconds; for the integration tests (one binary, a module per
# tests/*.rs file) each file's tests' own seconds summed (they run two at a
# time, so these add up to about twice the binary's wall time); and the ten
# slowest tests (their `<N.NNNs>`, from libtest's --report-time). README's
# test-time budget is read against these.
set -euo pipefail
awk '
    function by_size(values, order,    n, i, j, t) {
        n = 0
        for (k in values) order[++n] = k
        for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (values[order[j]] + 0 > values[order[i]] + 0) { t = order[i]; order[i] = order[j]; order[j] = t }
        return n
    }
    /^     Running / && match($0, /\(target\/[^)]*\)/) {
        binary = substr($0, RSTART + 1, RLENGTH - 2)
        sub(/.*\//, "", binary)
        sub(/-[0-9a-f]+$/, "", binary)
    }
    /^test result:/ && match($0, /finished in [0-9.]+s/) {
        seconds[binary] += substr($0, RSTART + 12, RLENGTH - 13)
    }
    /^test .* <[0-9.]+s>$/ && match($0, /<[0-9.]+s>$/) {
        time = substr($0, RSTART + 1, RLENGTH - 3)
        tests[binary "::" $2] = time
        if (binary == "integration") { file = $2; sub(/::.*/, "", file); files[file] += time }
    }
    END {
        n = by_size(seconds, order)
        printf "wall seconds per test binary, slowest first (those under a second left out):"
        for (i = 1; i <= n; i++) { total += seconds[order[i]]; if (seconds[order[i]] >= 1) printf "%s %s %.0f", (i == 1 ? "" : ","), order[i], seconds[order[i]] }
        printf " (%.0f s in all)\n", total
        n = by_size(files, order)
        printf "the integration tests'"'"' seconds by file (summed over tests run several at a time):"
        for (i = 1; i <= n; i++) printf "%s %s %.0f", (i == 1 ? "" : ","), order[i], files[order[i]]
        printf "\n"
        m = by_size(tests, slow)
        print "the ten slowest tests:"
        for (i = 1; i <= m && i <= 10; i++) printf "  %7.1f s  %s\n", tests[slow[i]], slow[i]
    }' "$1"
