"""Bucketing and overlap of gradient communication with backward compute.

Assumptions (docs/costmodel.md):
* gradients are produced at a uniform rate during backward, which takes ``backward_s``;
* a stream's buckets are cut in production order, each ``bucket_bytes`` (the last one smaller), and
  launched when full (overlap on) or all at the end of backward (overlap off);
* one stream's buckets are reduced one after another; a bucket of fraction x of the stream costs
  ``latency_s + x * bandwidth_s`` (the model is linear in bytes);
* several streams of one engine share its one issuing queue (the dispatcher's thread on gloo, its
  one communication stream on NCCL: reducer/schedule/dispatch.py), so their buckets are reduced one
  after another too, in the order they are released (:func:`serial_timeline`);
* the exposed communication is what is left after backward ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .model import SimError

__all__ = ["BucketTimeline", "bucket_timeline", "serial_timeline", "QueuedStream", "MAX_BUCKETS"]

MAX_BUCKETS = 50_000_000


@dataclass(frozen=True)
class BucketTimeline:
    n_buckets: int
    bucket_s: float
    """Time of one full bucket."""
    busy_s: float
    """Sum of all bucket times (the stream's link time)."""
    end_s: float
    """When the last bucket finishes, from the start of backward."""
    exposed_s: float
    """Communication left after backward: max(0, end - backward)."""


def bucket_timeline(stream_bytes: float, bucket_bytes: float, bandwidth_s: float, latency_s: float,
                    backward_s: float, overlap: bool) -> BucketTimeline:
    """Schedule one stream's buckets against backward (see module docstring): the last bucket ends at
    ``max_i (ready_i + sum_{j >= i} c_j)`` (a serial queue; :func:`serial_timeline` of one part)."""
    return serial_timeline([QueuedStream(stream_bytes, bandwidth_s, latency_s)], bucket_bytes, backward_s, overlap)


@dataclass(frozen=True)
class QueuedStream:
    """One stream's part of a shared issuing queue (:func:`serial_timeline`)."""

    stream_bytes: float
    bandwidth_s: float
    latency_s: float
    held_until: float = 0.0
    """Fraction of backward before which none of its buckets is released (the engine holds LOCAL
    buckets until the step's last SYNC bucket is submitted)."""


def serial_timeline(parts: list[QueuedStream], bucket_bytes: float, backward_s: float,
                    overlap: bool) -> BucketTimeline:
    """The buckets of several streams through one issuing queue. Each part's buckets are produced at
    a uniform rate during backward and released when full, none before ``held_until * backward_s``;
    the queue takes them in release order (an earlier part first on a tie), so the last bucket ends
    at ``max_i (release_i + sum_{j >= i} c_j)`` over the merged order (numpy, O(n log n) for the
    merge, no Python loop over buckets)."""
    if not (math.isfinite(bucket_bytes) and bucket_bytes > 0):
        raise SimError(f"bucket size = {bucket_bytes!r} bytes; expected a positive number")
    parts = [q for q in parts if q.stream_bytes > 0]
    if not parts:
        return BucketTimeline(0, 0.0, 0.0, backward_s if overlap else 0.0, 0.0)
    ready, cost, first = [], [], None
    for q in parts:
        n = math.ceil(q.stream_bytes / bucket_bytes)
        if n > MAX_BUCKETS:
            raise SimError(f"{n} buckets of {bucket_bytes:g} bytes; at most {MAX_BUCKETS} are modelled, "
                           "use larger buckets")
        sizes = np.full(n, bucket_bytes, dtype=float)
        sizes[-1] = q.stream_bytes - bucket_bytes * (n - 1)
        c = q.latency_s + sizes / q.stream_bytes * q.bandwidth_s
        first = float(c[0]) if first is None else first
        cost.append(c)
        ready.append(np.maximum(np.cumsum(sizes) / q.stream_bytes, q.held_until) * backward_s)
    c, r = np.concatenate(cost), np.concatenate(ready)
    busy = float(c.sum())
    n = len(c)
    if not overlap:
        return BucketTimeline(n, first, busy, backward_s + busy, busy)
    order = np.argsort(r, kind="stable")
    c, r = c[order], r[order]
    suffix = np.cumsum(c[::-1])[::-1]
    end = float((r + suffix).max())
    return BucketTimeline(n, first, busy, end, max(0.0, end - backward_s))
