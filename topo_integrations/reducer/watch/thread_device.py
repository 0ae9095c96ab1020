"""Every helper thread of the reducer runs on the CUDA device and stream of the thread that started it.

PyTorch's current CUDA device and current stream are per thread: a fresh thread starts on ``cuda:0``
and its default stream, whatever ``torch.cuda.set_device`` the training thread called. A collective
issued from such a thread on NCCL (an object collective moves its bytes to the *current* device)
lands every rank's tensor on ``cuda:0``: an NCCL error or a hang. So the reducer starts its threads
(the bounded call, the dispatcher, the schedule's watcher, the stream double) only through
:func:`start_thread`, which captures the starter's device and stream (:func:`capture`, when CUDA is
initialised; nothing is touched in a CPU-only process) and enters them in the new thread before its
target runs. tests/test_device_placement.py checks that no other ``threading.Thread(`` exists in
reducer/. :func:`object_device` is the device an object collective should name explicitly where
``torch.distributed`` lets it (``broadcast_object_list(..., device=)``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["ThreadDevice", "capture", "start_thread", "object_device"]


@dataclass(frozen=True)
class ThreadDevice:
    """Where a thread runs: a CUDA device index and its current stream, or nowhere on CUDA (None)."""

    index: int | None = None
    stream: Any = None

    def enter(self) -> None:
        """Make them this thread's current device and stream (nothing when ``index`` is None)."""
        if self.index is None:
            return
        torch.cuda.set_device(self.index)
        if self.stream is not None:
            torch.cuda.set_stream(self.stream)


def capture() -> ThreadDevice:
    """This thread's current CUDA device and stream when CUDA is initialised in the process (a job
    that never touched CUDA is not made to: its helper threads need no device)."""
    if not torch.cuda.is_initialized():
        return ThreadDevice()
    index = torch.cuda.current_device()
    return ThreadDevice(index, torch.cuda.current_stream(index))


def start_thread(target: Callable[[], None], *, name: str, daemon: bool = True) -> threading.Thread:
    """Start ``target`` in a new thread that first enters the caller's device and stream (:func:`capture`)."""
    where = capture()

    def run() -> None:
        where.enter()
        target()

    th = threading.Thread(target=run, name=name, daemon=daemon)
    th.start()
    return th


def object_device(group=None) -> torch.device | None:
    """The device an object collective over ``group`` should name: this thread's CUDA device when
    the group's backend is NCCL (its object tensors must live on the rank's own GPU), else None
    (torch.distributed keeps them on the CPU)."""
    import torch.distributed as dist

    where = capture()
    if where.index is None or dist.get_backend(group) != "nccl":
        return None
    return torch.device("cuda", where.index)
