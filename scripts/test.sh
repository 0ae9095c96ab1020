#!/usr/bin/env bash
# The README's test command: installs what the tests need into .venv, then runs the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k planner`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# DeepSpeed on CPU: never JIT-build the shm_comm op at start (docs/deepspeed.md).
export DS_ACCELERATOR=cpu
# tests/site/sitecustomize.py, in every interpreter the suite starts: torch.compile decorators compile
# at first call, not at import (3 to 4 CPU seconds less per DeepSpeed or megatron-core process).
export PYTHONPATH="$PWD/tests/site${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python -m pytest "$@"
