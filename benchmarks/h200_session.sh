# Sourced by the benchmarks/h200_*.sh session scripts: environment, output folder, log and
# the `run LIMIT_S CMD...` helper that appends CMD's output to the log under a time limit.
# Before sourcing set OUT_DEFAULT (the folder when OUT is unset) and LOG_NAME (the log's file name).
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-$OUT_DEFAULT}; mkdir -p "$OUT"
LOG=$OUT/$LOG_NAME
# RUN_RC: the exit status of the last run's command (124: the limit); run itself returns 0.
run() { local t=$1; shift; echo "=== $* (limit ${t}s)" | tee -a "$LOG"; timeout "$t" "$@" >>"$LOG" 2>&1; RUN_RC=$?; echo "=== rc=$RUN_RC" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
echo "commit ${COMMIT:-unknown}" | tee -a "$LOG"
