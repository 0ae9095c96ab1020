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
# Two pytest-xdist workers, a test file at a time each, heaviest first (tests/_lanes.py): one run in a
# single process left a quarter of the two cores idle while modules waited on links and timeouts.
# TOPO_ALIGN_TEST_WORKERS=0 runs it in one process (pytest -s then shows the modules' prints).
exec .venv/bin/python -m pytest -n "${TOPO_ALIGN_TEST_WORKERS:-2}" --dist loadfile "$@"
