#!/usr/bin/env bash
# The test suite on the H200. The CPU CI runs it with Triton's interpreter on CPU tensors;
# here the Triton and CUDA paths run on the GPU, "auto" devices resolve to it, and a test
# that passes only on the CPU shows up (session 18: 26 failures and 30 errors of that kind at
# 6cb660a, none of them in the library: results/h200_tests/). The design (g) kernels are
# compiled at first use (nvcc and CUTLASS's headers, minutes each); MXMOE_CACHE_DIR (default
# .whl/cache, carried to the H200, filled on a machine with nvcc as h200_design_g.sh says)
# holds them built, else the tests that need them build them or fall back to design (a).
# The whole suite took 454 s on the H200; LIMIT_S (default 580) caps the run.
# Output: $OUT/tests.log (OUT default /tmp/h200_tests), started fresh on each run; the exit
# status is pytest's (124: the limit).
# Usage (repo root): COMMIT=<sha> OUT=<dir> bash benchmarks/h200_tests.sh [pytest arguments; default tests/]
set -u
if ! PYTHONPATH=src python3 -c "import torch" 2>/dev/null; then
  echo "python3 cannot import torch: activate the environment the project is installed in" >&2; exit 2
fi
if ! PYTHONPATH=src python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device: this script runs the tests on the H200 (on the CPU run .ci/run)" >&2; exit 2
fi
OUT_DEFAULT=/tmp/h200_tests LOG_NAME=tests.log
rm -f "${OUT:-$OUT_DEFAULT}/$LOG_NAME"  # a fresh log: the summary below reads this run only
. "$(dirname "$0")/h200_session.sh"
export MXMOE_CACHE_DIR=${MXMOE_CACHE_DIR:-.whl/cache}
if [ $# -eq 0 ]; then set -- tests/; fi
run "${LIMIT_S:-580}" python3 -m pytest -q -p no:cacheprovider -rfE --tb=short "$@"
grep -E "^(FAILED|ERROR) |^[0-9]+ (passed|failed)|^=== rc" "$LOG"
exit "$RUN_RC"
