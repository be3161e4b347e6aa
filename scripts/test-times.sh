#!/usr/bin/env bash
# Where a test run's time went, from cargo test's output (a file): each test
# binary's seconds, slowest first, and the ten slowest tests (their
# `<N.NNNs>`, from libtest's --report-time). README's test-time budget is
# read against these.
set -euo pipefail
awk '
    /^     Running / && match($0, /\(target\/[^)]*\)/) {
        binary = substr($0, RSTART + 1, RLENGTH - 2)
        sub(/.*\//, "", binary)
        sub(/-[0-9a-f]+$/, "", binary)
    }
    /^test result:/ && match($0, /finished in [0-9.]+s/) {
        seconds[binary] += substr($0, RSTART + 12, RLENGTH - 13)
    }
    /^test .* <[0-9.]+s>$/ && match($0, /<[0-9.]+s>$/) {
        name = $2
        tests[binary "::" name] = substr($0, RSTART + 1, RLENGTH - 3)
    }
    END {
        printf "seconds per test binary, slowest first:"
        for (b in seconds) line[b] = seconds[b]
        n = 0
        for (b in line) order[++n] = b
        for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (line[order[j]] > line[order[i]]) { t = order[i]; order[i] = order[j]; order[j] = t }
        for (i = 1; i <= n; i++) { total += line[order[i]]; printf "%s %s %.0f", (i == 1 ? "" : ","), order[i], line[order[i]] }
        printf " (%.0f s in all)\n", total
        m = 0
        for (t in tests) slow[++m] = t
        for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (tests[slow[j]] + 0 > tests[slow[i]] + 0) { t = slow[i]; slow[i] = slow[j]; slow[j] = t }
        print "the ten slowest tests:"
        for (i = 1; i <= m && i <= 10; i++) printf "  %7.1f s  %s\n", tests[slow[i]], slow[i]
    }' "$1"
