"""``python -m topo_integrations.megatron SCRIPT.py [ARGS...]``: run a stock Megatron-LM entry script
(e.g. ``pretrain_gpt.py``) with topo-align installed.

The script's directory goes first on ``sys.path`` (as ``python SCRIPT.py`` would do, so the
Megatron-LM checkout it lives in is importable), on a machine without CUDA the CPU compatibility
layer is applied (``cpu_compat.apply_training``; never on a GPU machine), `install()` patches
``megatron.training``, and the script runs as ``__main__`` with ``sys.argv = [SCRIPT.py, ARGS...]``.
Add ``--topo-align`` (and the other ``--topo-align*`` flags) to ARGS to turn the plugin on; without
it the run is stock Megatron.

The script's ``__main__`` module carries this module's import spec, so a process Megatron starts
with the ``spawn`` method (the ``torch_dist`` checkpoint writer's queue manager does) imports this
launcher as its ``__mp_main__`` (and so gets the CPU layer's import stand-ins) instead of re-running
the script.

Bad usage, or a Megatron-LM whose seams differ from what `install()` expects, prints one line and
exits with status 2.
"""

from __future__ import annotations

import builtins
import importlib.util
import os
import sys
import types

USAGE = "usage: python -m topo_integrations.megatron SCRIPT.py [MEGATRON ARGS...] [--topo-align ...]"
_SPEC_NAME = "topo_integrations.megatron.__main__"


def _run_script(script: str) -> None:
    """Run ``script`` as ``__main__`` (what ``runpy.run_path`` does, but see the module docstring)."""
    with open(script, "rb") as fh:
        code = compile(fh.read(), script, "exec")
    mod = types.ModuleType("__main__")
    mod.__file__ = script
    mod.__builtins__ = builtins  # type: ignore[attr-defined]
    mod.__spec__ = importlib.util.find_spec(_SPEC_NAME)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = mod
    try:
        exec(code, mod.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


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
    from . import cpu_compat
    from .compat import MegatronLMVersionError
    from .megatron_lm import install

    try:
        # Without CUDA: the CPU layer first, before Megatron-LM's initialize.py is imported (it
        # imports a triton-only module at import time). apply_training checks its seams itself.
        if not cpu_compat.cuda_available():
            cpu_compat.apply_training()
        install()
    except (ImportError, MegatronLMVersionError) as exc:
        print(str(exc).splitlines()[0], file=sys.stderr)
        return 2
    sys.argv = [script, *argv[1:]]
    _run_script(script)
    return 0


if __name__ == "__main__":
    sys.exit(main())
elif __name__ == "__mp_main__":
    # A spawn child of a script this launcher ran (see the module docstring): the import stand-ins
    # only; the child does not train.
    from . import cpu_compat as _cpu

    if not _cpu.cuda_available():
        _cpu.stub_absent_imports()
