#!/usr/bin/env bash
# Runs a command as it would run on a machine RATIO times slower than this
# one: a busy loop a core, in a cgroup of its own, takes 1 - 1/RATIO of the
# cores whenever the command keeps them all busy (CPU weights: the command's
# group 1, the loops' RATIO - 1), and the command sees every core (a CPU
# quota would make cargo and libtest count fewer). What README's test-time
# budget is measured with where the slow machine itself is not at hand:
#
#   scripts/slowed.sh 2.52 bash .ci/run
#
# Where the command leaves cores idle, the loops take more of what it does
# not use, so a one-thread stretch is slowed less than RATIO; yet a clean
# build was slowed more (2.7-3.1 times at 2.52, README's "Test time"): the
# result is an estimate, not a bound. Needs root and the cgroup cpu
# controller (v1 or v2).
set -euo pipefail
if [ $# -lt 2 ] || ! awk -v r="$1" 'BEGIN { exit !(r + 0 > 1) }'; then
    echo "usage: scripts/slowed.sh RATIO COMMAND [ARGS...]  (RATIO > 1, e.g. 1.32)" >&2
    exit 2
fi
ratio="$1"
shift
name="ft-slowed-$$"
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    root=/sys/fs/cgroup weight=cpu.weight unit=100
    grep -qw cpu "$root/cgroup.subtree_control" || echo +cpu > "$root/cgroup.subtree_control"
elif [ -d /sys/fs/cgroup/cpu ]; then
    root=/sys/fs/cgroup/cpu weight=cpu.shares unit=1024
else
    echo "scripts/slowed.sh: no cgroup cpu controller under /sys/fs/cgroup" >&2
    exit 1
fi
if [ ! -w "$root" ]; then
    echo "scripts/slowed.sh: cannot make cgroups under $root: run it as root" >&2
    exit 1
fi
finish() {
    kill "${loops[@]}" 2>/dev/null || true
    wait "${loops[@]}" 2>/dev/null || true
    # A process the command left behind may still be exiting: its group is removed once it is empty.
    for _ in $(seq 50); do
        for group in "$root/$name-command" "$root/$name-loops"; do
            [ ! -d "$group" ] || rmdir "$group" 2>/dev/null || true
        done
        [ -d "$root/$name-command" ] || [ -d "$root/$name-loops" ] || return 0
        sleep 0.1
    done
    echo "scripts/slowed.sh: $root/$name-command or $name-loops still holds processes: remove it with rmdir once they end" >&2
}
mkdir "$root/$name-command" "$root/$name-loops"
loops=()
trap finish EXIT
echo "$unit" > "$root/$name-command/$weight"
awk -v r="$ratio" -v u="$unit" 'BEGIN { printf "%d\n", u * (r - 1) + 0.5 }' > "$root/$name-loops/$weight"
for _ in $(seq "$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"); do
    (echo "$BASHPID" > "$root/$name-loops/cgroup.procs" && exec sh -c 'while :; do :; done') &
    loops+=("$!")
done
status=0
(echo "$BASHPID" > "$root/$name-command/cgroup.procs" && exec "$@") || status=$?
exit "$status"
