#!/usr/bin/env bash
# The GPU check (docs/reliability.md, "GPU check"): tests/test_reducer_cuda.py, then every adapter on
# 4 NCCL ranks (2 islands x 2), one line per case. Without CUDA: one SKIP line, exit 0.
# Uses .venv/bin/python (or $PYTHON: an interpreter whose torch has CUDA); extra arguments go to
# scripts/gpu_check.py (e.g. --cases megatron-ddp-hierarchical).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
if [ ! -x "$PYTHON" ]; then
  echo "gpu_check: no interpreter at $PYTHON; run scripts/setup_env.sh (with a CUDA build of torch), or set PYTHON" >&2
  exit 2
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
