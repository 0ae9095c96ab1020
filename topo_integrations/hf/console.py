"""The lines users see: the ``topo_align`` logger made visible on rank 0 (docs/hf.md, "What you see").

The library logs to ``logging.getLogger("topo_align")`` and installs no handler (a library must not);
with nothing configured Python prints only warnings, so the start line and the statistics lines
were invisible. :func:`ensure_console` (``install()`` calls it unless ``console=False``) makes them
visible without doubling anything: when the root logger has handlers of the user's, only the
logger's level is raised to INFO (if unset) and the lines go to those handlers; otherwise one
stderr handler is added to ``topo_align`` that prints rank 0's lines (``RANK`` or the process group).
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["ensure_console", "rank", "say", "LOGGER"]

LOGGER = "topo_align"


def rank() -> int:
    """This process's global rank (the process group's, else ``RANK``), 0 without either."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - a broken torch.distributed is not this module's to report
        pass
    return int(os.environ.get("RANK", "0") or 0)


class _RankZero(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return rank() == 0


class _Handler(logging.StreamHandler):
    """The handler :func:`ensure_console` adds (recognised on a second call)."""


def ensure_console() -> None:
    lg = logging.getLogger(LOGGER)
    if lg.level == logging.NOTSET:
        lg.setLevel(logging.INFO)
    if lg.handlers or logging.getLogger().handlers:
        return
    h = _Handler(sys.stderr)
    h.setFormatter(logging.Formatter("%(message)s"))
    h.addFilter(_RankZero())
    lg.addHandler(h)


def say(message: str, *, warning: bool = False) -> None:
    """Log ``message`` once, from rank 0 (warnings at WARNING, the rest at INFO)."""
    if rank() != 0:
        return
    lg = logging.getLogger(LOGGER)
    (lg.warning if warning else lg.info)(message)
