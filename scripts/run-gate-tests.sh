#!/usr/bin/env bash
# The fast gate's tests (`make unit`, in `make check`): the unit tier and the simulation
# tier as two pytest runs at once, one per core of the 2-core CI machine (they share no
# port, file or process: the simulators run in process). The sim run's log comes after
# the unit run's; exits non-zero when either failed.
#
#   scripts/run-gate-tests.sh [PYTEST]
set -uo pipefail
cd "$(dirname "$0")/.."
pytest_bin=${1:-.venv/bin/pytest}
out=$(mktemp -d -t kvdir-gate-XXXXXX)
start=$SECONDS
"$pytest_bin" -q -p no:cacheprovider tests/sim >"$out/sim.log" 2>&1 &
sim_pid=$!
# A stop reaches both runs (a background job starts with SIGINT ignored, which
# tests/conftest.py undoes; SIGTERM is passed on and handled as SIGINT there).
trap 'kill -TERM "$sim_pid" 2>/dev/null; wait; exit 130' INT
trap 'kill -TERM "$sim_pid" 2>/dev/null; wait; exit 143' TERM
"$pytest_bin" -q -p no:cacheprovider tests/unit
unit_rc=$?
unit_s=$((SECONDS - start))
wait "$sim_pid"
sim_rc=$?
trap - INT TERM
cat "$out/sim.log"
echo "==> unit: exit $unit_rc after ${unit_s} s; sim: exit $sim_rc after $((SECONDS - start)) s"
rm -rf "$out"
((unit_rc == 0 && sim_rc == 0))
