"""Issue 37 row 17 (rest): a steady slow load whose reads arrive in bursts (mmap page-ins of a loader: ~17 MB at
1.3 MB/s per worker, a burst every ~13 s; here scaled to 8 MiB every 6 s, 1.4 MB/s, against a 10 s stall window) is
never near STALLED: once the load's cadence is known (two regular gaps), "quiet" counts past its usual gap and
never reaches half the window; the watch is PROGRESSING throughout. On main "quiet" reached the whole gap (6 s of
10 s) after every burst.

Run: .venv/bin/python -m pytest -q tests/monitor/test_bursty_load.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BURST, EVERY_S, BURSTS, WINDOW = 8 << 20, 6.0, 5, 10.0

READER = r"""
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
burst, every, n = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
while not os.path.exists(sys.argv[5]):
    time.sleep(0.02)
t0 = time.monotonic()
for i in range(n):
    time.sleep(max(0.0, t0 + i * every - time.monotonic()))
    os.pread(fd, burst, i * burst)
    open(sys.argv[6], "a").write(repr(time.time()) + "\n")
time.sleep(600)
"""


def test_a_steady_bursty_load_is_never_near_stalled(tmp_path, kdtree_cache, port):
    blob = tmp_path / "weights.bin"
    blob.write_bytes(os.urandom(BURST * BURSTS))
    go, bursts = tmp_path / "go", tmp_path / "bursts"
    reader = subprocess.Popen([sys.executable, "-c", READER, str(blob), str(BURST), str(EVERY_S), str(BURSTS),
                               str(go), str(bursts)])
    run_dir = tmp_path / "watch"
    env = dict(os.environ, KDTREE_CACHE=str(kdtree_cache), KDTREE_RUNS=str(tmp_path))
    watch = subprocess.Popen([sys.executable, "-m", "kdtree.run", "pipeline=watch", f"hydra.run.dir={run_dir}",
                              f"health.url=http://127.0.0.1:{port}", f"health.pid={reader.pid}",
                              "health.interval_s=0.5", f"health.stall_window_s={WINDOW:g}"],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        jsonl = run_dir / "health.jsonl"
        while time.monotonic() < deadline and not (jsonl.exists() and jsonl.read_text().strip()):
            time.sleep(0.05)
        go.write_text("")                                    # after the monitor's first sample: the load starts
        time.sleep(EVERY_S * (BURSTS - 1) + 2.0)            # the last burst, and 2 s after it
    finally:
        reader.kill()
        reader.wait()
        out = watch.communicate(timeout=120)[0]
    at = [float(x) for x in bursts.read_text().split()]
    assert len(at) == BURSTS, out[-2000:]
    health = json.loads((run_dir / "health.json").read_text())
    samples = [s for s in health["samples"] if not s["interim"] and at[0] < s["started_at"] < at[-1] + 1.0]
    show = "\n".join(f"{s['verdict']} quiet {s['quiet_s']:.1f} {s['reason']}" for s in samples)
    assert len(samples) >= 30, out[-3000:]
    assert all(s["verdict"] == "PROGRESSING" for s in samples), show
    # the cadence is known after the third burst: from then on "quiet" stays under half the window
    steady = [s for s in samples if s["started_at"] > at[2] + 1.0]
    assert steady and max(s["quiet_s"] for s in steady) < WINDOW / 2, show
    assert max(s["quiet_s"] for s in samples) < WINDOW, show                 # before it too: never STALLED
    assert any("past the load's usual 6 s between moves" in s["reason"] for s in steady), show
