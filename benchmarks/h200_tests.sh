#!/usr/bin/env bash
# The test suite on the H200. The CPU CI runs it with Triton's interpreter on CPU tensors;
# here the Triton and CUDA paths run on the GPU, "auto" devices resolve to it, and a test
# that passes only on the CPU shows up (session 18: 26 failures and 30 errors of that kind at
# 6cb660a, none of them in the library: results/h200_tests/). The design (g) builds come from
# MXMOE_CACHE_DIR (default .whl/cache, carried; see h200_design_g.sh), else the tests that
# need them build them (nvcc) or skip.
# Usage (repo root): COMMIT=<sha> OUT=<dir> bash benchmarks/h200_tests.sh [pytest arguments; default tests/]
set -u
if ! PYTHONPATH=src python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "no CUDA device: this script runs the tests on the H200 (on the CPU run .ci/run)" >&2; exit 2
fi
OUT_DEFAULT=/tmp/h200_tests LOG_NAME=tests.log
. "$(dirname "$0")/h200_session.sh"
export MXMOE_CACHE_DIR=${MXMOE_CACHE_DIR:-.whl/cache}
if [ $# -eq 0 ]; then set -- tests/; fi
run 580 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short "$@"
grep -E "^(FAILED|ERROR)|passed|failed" "$LOG" | tail -40
