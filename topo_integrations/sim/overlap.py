"""Bucketing and overlap of gradient communication with backward compute.

Assumptions (docs/costmodel.md):
* gradients are produced at a uniform rate during backward, which takes ``backward_s``;
* a stream's buckets are cut in production order, each ``bucket_bytes`` (the last one smaller), and
  launched when full (overlap on) or all at the end of backward (overlap off);
* one stream's buckets are reduced one after another; a bucket of fraction x of the stream costs
  ``latency_s + x * bandwidth_s`` (the model is linear in bytes);
* the exposed communication is what is left after backward ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .model import SimError

__all__ = ["BucketTimeline", "bucket_timeline", "MAX_BUCKETS"]

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
    """Schedule one stream's buckets against backward (see module docstring).

    The last bucket ends at ``max_i (ready_i + sum_{j >= i} c_j)`` (a serial queue), which numpy
    evaluates in O(n) without a Python loop.
    """
    if not (math.isfinite(bucket_bytes) and bucket_bytes > 0):
        raise SimError(f"bucket size = {bucket_bytes!r} bytes; expected a positive number")
    if stream_bytes <= 0:
        return BucketTimeline(0, 0.0, 0.0, backward_s if overlap else 0.0, 0.0)
    n = math.ceil(stream_bytes / bucket_bytes)
    if n > MAX_BUCKETS:
        raise SimError(f"{n} buckets of {bucket_bytes:g} bytes; at most {MAX_BUCKETS} are modelled, use larger buckets")
    sizes = np.full(n, bucket_bytes, dtype=float)
    sizes[-1] = stream_bytes - bucket_bytes * (n - 1)
    cost = latency_s + sizes / stream_bytes * bandwidth_s
    busy = float(cost.sum())
    if not overlap:
        return BucketTimeline(n, float(cost[0]), busy, backward_s + busy, busy)
    ready = np.cumsum(sizes) / stream_bytes * backward_s
    suffix = np.cumsum(cost[::-1])[::-1]
    end = float((ready + suffix).max())
    return BucketTimeline(n, float(cost[0]), busy, end, max(0.0, end - backward_s))
