#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck and initcheck over every kernel on edge-shaped trees
# (ci/sanitize.py, which also checks every result). Run on a GPU machine after the build
# (pip install -e .); logs go to $OUT (or ./gpu-logs), one per tool; one summary line per
# tool. Exits 1 when a tool reports an error or the driver a wrong result.
#   SANITIZE_TOOLS="memcheck initcheck"  the tools to run (default: all three; racecheck, usually
#                                        the slowest, last; memcheck and initcheck took 96 and 81 s
#                                        on the H100)
#   SANITIZE_ARGS="--branches 256"       arguments of ci/sanitize.py
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUT"
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ ! -x "$sanitizer" ]; then
  echo "sanitize: compute-sanitizer not found (PATH, /usr/local/cuda/bin)"
  exit 2
fi
# One cudaMalloc per tensor instead of torch's cached segments: memcheck then sees a read past
# a tensor's end (inside a cached segment it would not), and initcheck sees fresh memory as
# uninitialised rather than as whatever a freed tensor left there.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONUNBUFFERED=1
status=0
for tool in ${SANITIZE_TOOLS:-memcheck initcheck racecheck}; do
  log="$OUT/sanitize_$tool.log"
  start=$SECONDS
  "$sanitizer" --tool "$tool" --error-exitcode 1 --print-limit 100 \
      python3 ci/sanitize.py ${SANITIZE_ARGS:-} >"$log" 2>&1
  rc=$?
  # memcheck/initcheck end with "ERROR SUMMARY: N errors", racecheck with
  # "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)".
  errors=$(grep -oE 'ERROR SUMMARY: [0-9]+|\([0-9]+ errors' "$log" | grep -oE '[0-9]+' | tail -1)
  checks=$(grep -E '^sanitize.py: ' "$log" | tail -1)
  echo "sanitize $tool: ${errors:-unknown} errors, exit code $rc, $((SECONDS - start)) s;" \
       "${checks:-the driver did not finish} (log: $log)"
  [ "$rc" = 0 ] && [ "${errors:-1}" = 0 ] || status=1
done
exit $status
