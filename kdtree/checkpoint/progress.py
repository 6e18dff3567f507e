"""A terminal progress line for checkpoint loads: bytes, MB/s, shards n/N, ETA.

    reporter = ProgressReporter()                 # stderr by default
    load_checkpoint(path, cfg, quant, progress=reporter); reporter.close()

On a TTY the line is rewritten in place (at most `tty_interval_s` apart); elsewhere (logs, journald)
a plain line is printed every `interval_s` seconds and once at the end. ETA = remaining bytes divided
by the rate observed since the first call. MB = 10^6 bytes.
"""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


def format_eta(seconds: Optional[float]) -> str:
    if seconds is None:
        return "--:--"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60:d}:{rem % 60:02d}"


class ProgressReporter:
    """Callable as `progress(bytes_done, bytes_total, shards_done, shards_total)`."""

    def __init__(self, stream: Optional[TextIO] = None, label: str = "loading", interval_s: float = 5.0,
                 tty_interval_s: float = 0.2, tty: Optional[bool] = None, clock=time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        self.label = label
        self.tty = tty if tty is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = tty_interval_s if self.tty else interval_s
        self.clock = clock
        self.t0: Optional[float] = None
        self.last_print = -float("inf")
        self.last_line = ""
        self.state = (0, 0, 0, 0)

    def rate(self) -> float:
        """Observed bytes/s since the first call (0 before any bytes moved)."""
        if self.t0 is None:
            return 0.0
        dt = self.clock() - self.t0
        return self.state[0] / dt if dt > 0 else 0.0

    def eta(self) -> Optional[float]:
        done, total = self.state[0], self.state[1]
        r = self.rate()
        if done >= total:
            return 0.0
        return (total - done) / r if r > 0 else None

    def line(self) -> str:
        done, total, sd, st = self.state
        return (f"{self.label} {done / 1e9:.2f}/{total / 1e9:.2f} GB  {self.rate() / 1e6:.1f} MB/s  "
                f"shards {sd}/{st}  ETA {format_eta(self.eta())}")

    def __call__(self, bytes_done: int, bytes_total: int, shards_done: int, shards_total: int) -> None:
        now = self.clock()
        if self.t0 is None:
            self.t0 = now
        self.state = (bytes_done, bytes_total, shards_done, shards_total)
        finished = bytes_done >= bytes_total
        if not finished and now - self.last_print < self.interval:
            return
        self.last_print = now
        self.last_line = self.line()
        if self.tty:
            self.stream.write("\r\x1b[K" + self.last_line + ("\n" if finished else ""))
        else:
            self.stream.write(self.last_line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Nothing to do when the load finished; ends a TTY line left mid-way by an error."""
        if self.tty and self.last_line and self.state[0] < self.state[1]:
            self.stream.write("\n")
            self.stream.flush()
