#!/usr/bin/env bash
# The GPU check (docs/reliability.md, "GPU check"): what this machine's GPUs can check, one row per
# case (scripts/gpu_check.py; `--list` prints the cases). Without a GPU it says so and exits 3.
# Uses .venv/bin/python (or $PYTHON: an interpreter whose torch has CUDA); extra arguments go to
# scripts/gpu_check.py (e.g. --out docs/data/gpu-check.json, --cases streams@nccl1,abort@nccl1).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
if [ ! -x "$PYTHON" ]; then
  echo "gpu_check: no interpreter at $PYTHON; run scripts/setup_env.sh (with a CUDA build of torch), or set PYTHON" >&2
  exit 2
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
