#!/usr/bin/env bash
# The GPU path checked in one run of at most 8 minutes (docs/performance.md, "GPU check"):
#   scripts/gpu_check.sh [--dry-run] [--out DIR]
# writes docs/results/gpu/<gpu name>.md and .json (--dry-run: tiny, on the CPU, into a temporary
# folder or DIR). The script stops its own parts by 440 s; `timeout` is the backstop. A dry run is
# never stopped on the clock: it records its times, and a busy machine only makes it slower.
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then exec "${PYTHON:-python}" scripts/gpu_check.py "$@"; fi
done
exec timeout --kill-after=15 "${GPU_CHECK_TIMEOUT:-470}" "${PYTHON:-python}" scripts/gpu_check.py "$@"
