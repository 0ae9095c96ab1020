"""The test suite's interpreters only (scripts/test.sh puts this folder first on PYTHONPATH, and
every process the suite starts inherits it): ``torch.compile`` used as a decorator at import time
compiles at the function's first call instead of importing the compiler at once.

Why: DeepSpeed (its Muon optimizer) and megatron-core (``jit_fuser`` on the fused activations)
decorate functions with ``torch.compile`` when they are imported, which imports TorchDynamo and
Inductor: about 3.8 CPU seconds of every DeepSpeed process and 2.4 of every megatron-core one,
for functions the CPU tests mostly never call. The suite starts a few hundred such processes on
2 cores (docs/testing.md). A decorated function that is called is compiled then, with the same
arguments, so behaviour is unchanged; ``torch.compile`` on a module, or any other use, goes to
torch's own at once. Nothing of this reaches users: the folder is on no path outside the suite.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys


def _lazy(real):
    @functools.wraps(real)
    def compile(model=None, **kwargs):  # noqa: A001 - stands in for torch.compile
        if model is None:  # @torch.compile(mode=...): the decorator comes back, lazy too
            return lambda fn: compile(fn, **kwargs)
        import torch

        if isinstance(model, torch.nn.Module) or not callable(model):
            return real(model, **kwargs)
        compiled = []

        @functools.wraps(model)
        def first_call_compiles(*args, **kw):
            if not compiled:
                # Compiling disabled (the Megatron-LM runs set TORCH_COMPILE_DISABLE): torch's compile
                # would import TorchDynamo and Inductor (1.5 CPU s a rank) to run the function as it is.
                off = "1" in (os.environ.get("TORCH_COMPILE_DISABLE"), os.environ.get("TORCHDYNAMO_DISABLE"))
                compiled.append(model if off else real(model, **kwargs))
            return compiled[0](*args, **kw)

        return first_call_compiles

    return compile


class _PatchTorchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once: the real finder loads torch, this wraps its exec
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            module.compile = _lazy(module.compile)

        spec.loader.exec_module = exec_then_patch
        return spec


if "torch" not in sys.modules:
    sys.meta_path.insert(0, _PatchTorchAfterImport())
