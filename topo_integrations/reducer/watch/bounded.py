"""A blocking collective bounded by ``fallback.timeout_s`` from a helper thread (:func:`bounded`).

Used where the reducer calls a collective on a group without a timeout of its own (the default group
during discovery, the plan broadcast) or outside the dispatcher's watch. The helper thread runs on
the caller's CUDA device and stream (thread_device.py): an object collective from it on NCCL puts
its bytes on this rank's GPU, not on ``cuda:0``.
"""

from __future__ import annotations

from .errors import CollectiveError
from .thread_device import start_thread

__all__ = ["bounded"]


def bounded(what: str, timeout_s: float | None, fn):
    """Run the blocking collective ``fn()`` (one on a group without a timeout of its own, e.g. the
    default group during discovery) and raise :class:`CollectiveError` naming ``what`` when it has
    not returned after ``timeout_s`` (``fallback.timeout_s``). The call keeps waiting in a daemon
    thread: the error is for the caller, who must end the process (the communicator is unusable)."""
    if not timeout_s:
        return fn()
    box: dict = {}

    def target():
        try:
            box["out"] = fn()
        except BaseException as exc:  # noqa: BLE001 - delivered to the caller
            box["err"] = exc

    th = start_thread(target, name="topo_align_bounded")
    th.join(timeout_s)
    if th.is_alive():
        raise CollectiveError(f"topo_align: {what} did not complete within fallback.timeout_s = {timeout_s:g}s "
                              "(a rank did not call it, or a link is down)")
    if "err" in box:
        raise box["err"]
    return box.get("out")
