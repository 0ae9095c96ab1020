"""``python -m topo_integrations.megatron SCRIPT.py [ARGS...]``: run a stock Megatron-LM entry script
(e.g. ``pretrain_gpt.py``) with topo-align installed.

The script's directory goes first on ``sys.path`` (as ``python SCRIPT.py`` would do, so the
Megatron-LM checkout it lives in is importable), `install()` patches ``megatron.training``, and the
script runs as ``__main__`` with ``sys.argv = [SCRIPT.py, ARGS...]``. Add ``--topo-align`` (and the
other ``--topo-align*`` flags) to ARGS to turn the plugin on; without it the run is stock Megatron.

Bad usage prints one line and exits with status 2.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m topo_integrations.megatron SCRIPT.py [MEGATRON ARGS...] [--topo-align ...]"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    script = argv[0]
    if not os.path.isfile(script):
        print(f"topo-align: {script}: no such file (expected a Megatron-LM entry script such as pretrain_gpt.py)",
              file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    from .megatron_lm import install

    try:
        install()
    except ImportError as exc:
        print(str(exc).splitlines()[0], file=sys.stderr)
        return 2
    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
