#!/usr/bin/env bash
# The README's test command: install mtune with its test extras (editable) and run the whole suite, slow tests
# included, on two worker processes (MTUNE_TEST_WORKERS; each test still writes only in its own temporary
# directory), printing the 25 slowest. Each worker takes one module at a time (--dist loadscope), in the order
# tests/conftest.py sets (the heaviest directories first), so a module's fixtures are built once. Extra arguments go
# to pytest. CI (.ci/run) runs it after checking the README's install without extras (scripts/smoke_install.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[dev]'
bash scripts/print_versions.sh
# One intra-op thread per process (unless set): two workers on two cores, and the runs they start, would otherwise
# each spin up a thread per core and contend (benchmarks/results/test_suite_time.txt: 802 s so, 469.50 s without).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/mtune-inductor-cache}"
# pytest exits 5 when it collected no test: that is a failure here too.
python3 -m pytest -q -n "${MTUNE_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder --durations=25 "$@"
