#!/usr/bin/env bash
# Create .venv with everything the tests, the launch scripts and the benchmarks need, pinned by
# constraints.txt. Idempotent: a stamp records the constraints it installed, so a second call is instant.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${TOPO_ALIGN_VENV:-.venv}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "topo-align needs Python >= 3.11 (found $("$PY" --version 2>&1))" >&2
  exit 2
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.topo-align-stamp"
want="$(cat constraints.txt setup.py | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
  # torch first and alone: the pinned 2.13.0 resolves to the local CPU wheel; an unpinned torch
  # requirement (e.g. from deepspeed) would otherwise pull a multi-GB CUDA build.
  pip install -c constraints.txt "torch==2.13.0"
  pip install -c constraints.txt -e ".[all]" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import torch, deepspeed, megatron.core, pydantic, pytest, xdist, transformers, accelerate" >/dev/null 2>&1 || {
    echo "setup_env: install failed (see pip output above)" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
