#!/usr/bin/env bash
# The README's test command: installs what the tests need into .venv, then runs the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k planner`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# DeepSpeed on CPU: never JIT-build the shm_comm op at start (docs/deepspeed.md).
export DS_ACCELERATOR=cpu
exec .venv/bin/python -m pytest "$@"
