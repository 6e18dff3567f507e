"""Progress while loading: the callback reaches the total; the terminal line shows bytes, MB/s, shards, ETA."""
from __future__ import annotations

import io
import time

import pytest

from kdtree.checkpoint.loader import load_checkpoint
from kdtree.checkpoint.progress import ProgressReporter


def test_callback_is_monotonic_and_reaches_the_total(write, cfg, fp32):
    calls = []
    _, stats = load_checkpoint(write(), cfg, fp32, progress=lambda *a: calls.append(a), chunk_mb=0.5, threads=3)
    assert calls[0] == (0, stats.bytes_read, 0, 4)
    assert calls[-1] == (stats.bytes_read, stats.bytes_read, 4, 4)
    assert len(calls) >= 1 + stats.bytes_read // 2 ** 19    # the start, then one call per 0.5 MiB chunk
    for (b0, _, s0, _), (b1, _, s1, _) in zip(calls, calls[1:]):
        assert b1 >= b0 and s1 >= s0


def test_mmap_progress_reaches_the_total(write, cfg, fp32):
    calls = []
    _, stats = load_checkpoint(write(), cfg, fp32, strategy="mmap", progress=lambda *a: calls.append(a))
    assert calls[-1] == (stats.bytes_read, stats.bytes_read, 4, 4)


@pytest.mark.parametrize("strategy", ["mmap", "eager"])
def test_throttle_caps_the_rate(write, cfg, fp32, strategy):
    d = write()
    _, stats = load_checkpoint(d, cfg, fp32, throttle_mb_s=40, strategy=strategy)  # 12.5 MB at 40 MB/s: >= ~0.3 s
    assert stats.seconds >= 0.9 * stats.bytes_read / 40e6
    assert stats.bytes_read == stats.bytes_total


@pytest.mark.parametrize("strategy", ["mmap", "eager"])
def test_eta_printed_after_a_quarter_is_within_15_percent_on_a_steady_disk(write, cfg, fp32, strategy):
    out = io.StringIO()
    reporter = ProgressReporter(out, tty=False, interval_s=0.0)
    seen = []

    def progress(*args):
        reporter(*args)
        seen.append((time.monotonic(), args[0], args[1], reporter.eta(), reporter.last_line))

    load_checkpoint(write(), cfg, fp32, throttle_mb_s=6, strategy=strategy, progress=progress)  # ~2 s
    end = time.monotonic()
    at, done, total, eta, line = next(s for s in seen if s[1] >= s[2] / 4)
    assert "ETA" in line and line in out.getvalue()
    print(f"ETA at {done / total:.0%}: {eta:.3f} s, took {end - at:.3f} s")
    assert abs(eta - (end - at)) <= 0.15 * (end - at), (eta, end - at, done / total)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_plain_lines_every_interval_with_rate_and_eta():
    out, clock = io.StringIO(), Clock()
    r = ProgressReporter(out, interval_s=5.0, tty=False, clock=clock)
    r(0, 300_000_000, 0, 3)
    clock.t = 1.0
    r(100_000_000, 300_000_000, 1, 3)            # within the interval: silent
    clock.t = 6.0
    r(150_000_000, 300_000_000, 1, 3)            # 25 MB/s observed, 150 MB left -> 6 s
    clock.t = 12.0
    r(300_000_000, 300_000_000, 3, 3)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[1] == "loading 0.15/0.30 GB  25.0 MB/s  shards 1/3  ETA 0:06"
    assert lines[2].startswith("loading 0.30/0.30 GB  25.0 MB/s  shards 3/3  ETA 0:00")


def test_tty_rewrites_one_line_and_ends_it():
    out, clock = io.StringIO(), Clock()
    r = ProgressReporter(out, tty=True, clock=clock)
    for i in range(5):
        clock.t = i * 1.0
        r(i * 10_000_000, 40_000_000, i, 4)
    text = out.getvalue()
    assert text.count("\r") == 5 and text.count("\n") == 1 and text.endswith("shards 4/4  ETA 0:00\n")
    assert "ETA --:--" in text.split("\r")[1]     # nothing moved yet: no ETA
