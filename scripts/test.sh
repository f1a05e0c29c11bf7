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
# flash-linear-attention's Triton kernels, the oracle of mtune's call into them (run by Triton's interpreter on the
# CPU, tests/mtune/modules/test_gated_deltanet.py), in a directory of their own: importable in the main environment,
# they would take over transformers' Qwen3.5 (its oracle) on the CPU, where they cannot run compiled.
export MTUNE_FLA_ORACLE_PATH="${MTUNE_FLA_ORACLE_PATH:-${TMPDIR:-/tmp}/mtune-fla-oracle}"
PYTHONPATH="$MTUNE_FLA_ORACLE_PATH" python3 -c "import fla, triton" 2>/dev/null || python3 -m pip install -q \
  --no-deps --upgrade --target "$MTUNE_FLA_ORACLE_PATH" "fla-core>=0.6,<0.7" "triton>=3.4,<3.8" "einops>=0.8,<1"
bash scripts/print_versions.sh
# One intra-op thread per process (unless set): two workers on two cores, and the runs they start, would otherwise
# each spin up a thread per core and contend (benchmarks/results/test_suite_time.txt: 802 s so, 469.50 s without).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/mtune-inductor-cache}"
# pytest exits 5 when it collected no test: that is a failure here too.
python3 -m pytest -q -n "${MTUNE_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder --durations=25 "$@"
