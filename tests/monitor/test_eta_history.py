"""ETA from an observed byte rate; cold-start history comparisons."""
from __future__ import annotations

import pytest

from kdtree.monitor.eta import RateMeter, eta_seconds
from kdtree.monitor.history import History, compare


def test_eta_uses_the_recent_rate():
    m = RateMeter(window_s=5)
    for t in range(0, 10):                       # 1 MB/s for 10 s, then 4 MB/s
        m.add(float(t), t * 1e6)
    for t in range(10, 20):
        m.add(float(t), 10e6 + (t - 10) * 4e6)
    assert m.rate() == pytest.approx(4e6)
    assert eta_seconds(46e6, 100e6, m.rate()) == pytest.approx(13.5)
    assert eta_seconds(1, 100, None) is None
    m.add(21.0, 0.0)                             # counter restarted: a new load, no stale rate
    assert m.rate() is None


def test_history_says_whether_this_start_matches_the_past(tmp_path):
    h = History(tmp_path, {"host": "local", "model": "tiny"})
    assert compare({"loading": 5.0}, 6.0, h.baseline())["matches"] is None
    for s in (10.0, 11.0, 12.0):
        h.record("READY", {"loading": s, "warmup": 1.0}, s + 1.0)
    h.record("STALLED", {"loading": 99.0}, None)                    # failures are kept, not averaged in
    base = h.baseline()
    assert base["starts"] == 3 and base["phases"]["loading"] == 11.0 and base["to_ready_s"] == 12.0
    same = compare({"loading": 11.5, "warmup": 1.2}, 12.7, base)
    assert same["matches"] is True and "matches the 3 earlier" in same["line"]
    slow = compare({"loading": 40.0, "warmup": 1.0}, 41.0, base)
    assert slow["matches"] is False and "loading 40.0 s (usually 11.0 s)" in slow["line"]
    other = History(tmp_path, {"host": "local", "model": "k26"})
    assert other.baseline()["starts"] == 0                          # another model is another history
