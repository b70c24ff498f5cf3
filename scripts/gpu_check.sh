#!/usr/bin/env bash
# The GPU path checked in one run of at most 8 minutes (docs/performance.md, "GPU check"):
#   scripts/gpu_check.sh [--dry-run] [--out DIR]
# writes docs/results/gpu/<gpu name>.md and .json (--dry-run: tiny, on the CPU, into a temporary
# folder or DIR). The script stops its own parts by 440 s; `timeout` is the backstop. A dry run is
# never stopped on the clock: it records its times, and a busy machine only makes it slower.
# Without network, carry .gpu_wheels/ (scripts/gpu_wheels.sh): scripts/gpu_env.sh installs it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then exec "$python" scripts/gpu_check.py "$@"; fi
done
exec timeout --kill-after=15 "${GPU_CHECK_TIMEOUT:-470}" "$python" scripts/gpu_check.py "$@"
