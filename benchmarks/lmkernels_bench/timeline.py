"""Allocated memory over time from a CUDA caching-allocator trace (the e2e benchmark's memory
timeline)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def allocated_timeline(
    events: Sequence[dict[str, Any]], base_bytes: int, max_points: int = 4000
) -> dict[str, Any]:
    """Allocated memory (MiB) after each event of a CUDA caching-allocator trace
    (torch.cuda.memory._snapshot()["device_traces"][i], recorded with _record_memory_history),
    starting from base_bytes; downsampled to about max_points, keeping each bucket's maximum
    so that peaks survive. x: ms from the first event, or the event index where the trace has
    no timestamps."""
    timed = bool(events) and "time_us" in events[0]
    xs, values, allocated = [], [], base_bytes
    for i, ev in enumerate(events):
        if ev["action"] == "alloc":
            allocated += ev["size"]
        elif ev["action"] == "free_completed":
            allocated -= ev["size"]
        else:  # free_requested (not yet reusable), segment_* (reserved memory), snapshot, oom
            continue
        xs.append(ev["time_us"] / 1e3 if timed else i)
        values.append(allocated / 2**20)
    x0 = xs[0] if xs else 0
    stride = max(1, math.ceil(len(xs) / max_points))
    return {
        "x": [x - x0 for x in xs[::stride]],
        "mib": [max(values[i : i + stride]) for i in range(0, len(values), stride)],
        "x_label": "time in the step (ms)" if timed else "allocator event",
        "base_mib": base_bytes / 2**20,
    }
