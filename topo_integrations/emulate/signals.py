"""Stop signals as an exception, so that every ``finally`` of an emulated run (killing the ranks,
removing the namespaces, restoring the qdiscs) also runs on SIGTERM and SIGHUP, not only on Ctrl-C."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator

__all__ = ["Stopped", "stop_signals_raise"]

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived; ``signum`` says which. A BaseException, like
    KeyboardInterrupt, so that ``except Exception`` blocks on the way out do not swallow it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Inside the block the first stop signal raises :class:`Stopped`; later ones are ignored, so a
    second Ctrl-C cannot abort the cleanup the first one started. The previous handlers come back
    on exit. Call from the main thread (Python delivers signals there)."""
    stopping: dict[str, int] = {}

    def on_signal(signum, _frame):
        if stopping:
            return
        stopping["signum"] = signum
        raise Stopped(signum)

    previous = {s: signal.signal(s, on_signal) for s in HANDLED}
    try:
        yield
    finally:
        stopping.setdefault("signum", 0)  # from here on, further signals are ignored until restored
        for s, h in previous.items():
            signal.signal(s, h)
