"""Run a function once a module has been imported (``install()`` patches ``transformers.Trainer``
without importing transformers: 3-4 s of CPU per process that a plain accelerate script never needs)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable

__all__ = ["when_imported"]


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, fn: Callable):
        self.name, self.fn = name, fn

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # find the real spec below, and run once
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, fn = spec.loader, self.fn

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                fn(module)

        spec.loader = _Loader()
        return spec


def when_imported(name: str, fn: Callable) -> None:
    """``fn(module)`` now if ``name`` is imported already, else right after its import."""
    if name in sys.modules:
        fn(sys.modules[name])
        return
    if not any(isinstance(f, _Finder) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(name, fn))
