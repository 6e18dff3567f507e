"""ETA of the load from bytes: remaining bytes / the rate observed over the last `window_s` seconds.

The rate is measured by the monitor from successive samples (not taken from the engine), so it works
for any byte counter: kdtree's status bytes, or the engine process's read bytes against the checkpoint
index's total_size for servers that report nothing.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, Optional, Tuple

MIN_SPAN_S = 0.25         # two samples this far apart give a rate (the second sample of a watch at 0.5 s or more)
MAX_ETA_S = 7 * 86400     # an ETA past a week says "the rate is ~0", not when the load ends: none is shown


class RateMeter:
    def __init__(self, window_s: float = 10.0):
        self.window_s = float(window_s)
        self.points: Deque[Tuple[float, float]] = deque()      # (seconds, bytes)

    def add(self, t: float, value: float) -> None:
        if self.points and value < self.points[-1][1]:          # a counter that went back: a new load
            self.points.clear()
        self.points.append((t, float(value)))
        while len(self.points) > 2 and t - self.points[1][0] >= self.window_s:
            self.points.popleft()

    def rate(self) -> Optional[float]:
        """bytes/s over the window (bursts of reads count over all of it, not per sample), None until two points
        at least MIN_SPAN_S apart."""
        if len(self.points) < 2:
            return None
        (t0, v0), (t1, v1) = self.points[0], self.points[-1]
        return (v1 - v0) / (t1 - t0) if t1 - t0 >= MIN_SPAN_S else None


def eta_seconds(done: float, total: float, rate: Optional[float]) -> Optional[float]:
    if not total or rate is None or rate <= 0:
        return None
    eta = max(0.0, (total - done) / rate)
    return eta if eta <= MAX_ETA_S else None


class LoadBytes:
    """The checkpoint bytes a process tree has loaded: its loaded counter less what it had read while idle before
    the load began (an interpreter's imports, config and tokenizer files: ~0.7 MB for a bare python, far more for a
    server). Counted in, those bytes put the ETA low by their size / the rate all along, so it never converged (issue
    37 row 18). While successive samples show no reads (< `min_move` bytes) and what was read is under `BASE_FRACTION`
    of the checkpoint, everything read so far is the base; once reads move, the base is kept. A watch that begins
    mid-load keeps 0: its first two samples move, or (a bursty load idle between two bursts) more than that fraction
    is in already."""

    BASE_FRACTION = 0.05

    def __init__(self, min_move: int = 64 * 1024):
        self.min_move, self.base, self.prev, self.started = int(min_move), 0, None, False

    def done(self, loaded: int, total: int) -> int:
        if loaded > self.BASE_FRACTION * total:
            self.started = True
        if not self.started and self.prev is not None:
            if loaded - self.prev >= self.min_move:
                self.started = True          # the load began (or was under way): the base stays
            else:
                self.base = loaded           # idle since the last sample: not load bytes
        self.prev = loaded
        return max(0, loaded - self.base)
