#!/usr/bin/env bash
# `make test`'s suite: the tests marked serial (they measure wall-clock time: a fault seen
# within its timeout, a silence) at the CPU's normal priority, and beside them the rest in two
# processes (pytest-xdist) at the lowest (nice 19), whose children inherit it. The serial tests
# mostly wait on timeouts; whenever one of their processes wants the CPU it gets it at once,
# so their clocks read as on an idle machine while their waits no longer add to the suite's
# time. Their report follows the others'. Arguments go to both pytest runs (PYTEST_ARGS).
# Exit status: 0 when neither run failed (5, "no test selected", counts as none failed).
set -uo pipefail
python=${PYTHON:-python3}
# A run writes about 6 GiB of temporary files (2026-11-30): on a fuller disk every test would
# error at its setup, so the suite says so in one line instead.
tmp=${TMPDIR:-/tmp}
free_gib=$(( $(df -Pk "$tmp" | awk 'NR == 2 {print $4}') / 1048576 ))
if [ "$free_gib" -lt 8 ]; then
    echo "error: the suite writes about 6 GiB under $tmp and $free_gib GiB are free: free at least 8 GiB there, or set TMPDIR to a disk with room" >&2
    exit 1
fi
log=$(mktemp "${TMPDIR:-/tmp}/serial-tests.XXXXXX")
"$python" -m pytest tests -m serial "$@" >"$log" 2>&1 &
serial=$!
trap 'kill "$serial" 2>/dev/null; rm -f "$log"' EXIT
# One thread per process there (unless OMP_NUM_THREADS says otherwise): two workers share two
# cores, and the threads of one would only wait on each other (a doc test's commands took 18 %
# less time at one thread than at two, two workers at once, 2026-11-29).
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} nice -n 19 "$python" -m pytest tests -n 2 -m "not serial" "$@"
rest=$?
wait "$serial"
alone=$?
echo "============ the tests marked serial, run beside the others at normal priority ============"
cat "$log"
status=0
for code in "$rest" "$alone"; do
    if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then
        status=1
    fi
done
exit "$status"
