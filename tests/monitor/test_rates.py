"""Issue 37 rows 17 and 18 with a real process and `pipeline=watch`: a load that reads in bursts (2 MB every 1.5 s,
as mmap page-ins of a loader arrive) at a steady ~1.3 MB/s. Rates are over the rate window, not per sample: no line
says `read 0.0 MB/s` between bursts, the read rate and the ETA come from the second sample on, an ETA is never absurd
(a week or more) and a line carries one ETA.

Run: .venv/bin/python -m pytest -q tests/monitor/test_rates.py
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BURST, EVERY_S, BURSTS = 2 << 20, 1.5, 8

READER = r"""
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
burst, every, n = int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
while not os.path.exists(sys.argv[5]):
    time.sleep(0.02)
for i in range(n):
    os.pread(fd, burst, i * burst)
    time.sleep(every)
time.sleep(600)
"""


def test_a_bursty_steady_load_reads_at_its_window_rate_with_one_sane_eta(tmp_path, kdtree_cache, port):
    blob = tmp_path / "weights.bin"
    blob.write_bytes(os.urandom(BURST * BURSTS))
    go = tmp_path / "go"
    reader = subprocess.Popen([sys.executable, "-c", READER, str(blob), str(BURST), str(EVERY_S), str(BURSTS), str(go)])
    run_dir = tmp_path / "watch"
    env = dict(os.environ, KDTREE_CACHE=str(kdtree_cache), KDTREE_RUNS=str(tmp_path))
    watch = subprocess.Popen([sys.executable, "-m", "kdtree.run", "pipeline=watch", f"hydra.run.dir={run_dir}",
                              f"health.url=http://127.0.0.1:{port}", f"health.pid={reader.pid}",
                              "health.interval_s=0.5", "health.stall_window_s=5",
                              f"health.expected_bytes={BURST * BURSTS}"],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        jsonl = run_dir / "health.jsonl"
        while time.monotonic() < deadline and not (jsonl.exists() and jsonl.read_text().strip()):
            time.sleep(0.05)
        go.write_text("")     # after the monitor's first sample (not before it: two idle samples would read 0.0 MB/s)
        time.sleep(EVERY_S * BURSTS + 1.0)
    finally:
        reader.kill()
        reader.wait()
        out = watch.communicate(timeout=120)[0]
    health = json.loads((run_dir / "health.json").read_text())
    samples = [s for s in health["samples"] if not s["interim"]]
    loading = [s for s in samples if s["eta"] and s["eta"]["bytes_done"] < BURST * BURSTS]
    assert len(loading) >= 12, out[-3000:]
    lines = [s["line"] for s in loading]
    # from the second sample on: a read rate and an ETA on every line while it loads, never 0.0 between bursts
    for s in loading[1:]:
        rate = re.search(r"\bread (\d+\.\d) MB/s", s["line"])
        assert rate and float(rate.group(1)) > 0.0, lines
        assert s["eta"]["eta_s"] is not None and "ETA" in s["line"], lines
    # the window rate is the steady rate (2 MB / 1.5 s = 1.4 MB/s), not a burst's, once the window is full
    late = [float(re.search(r"\bread (\d+\.\d) MB/s", s["line"]).group(1)) for s in loading if s["t"] > 6.0]
    assert late and all(0.7 <= r <= 2.8 for r in late), lines
    for s in health["samples"]:
        etas = re.findall(r"\bETA (\d+) s", s["line"])
        assert len(etas) <= 1 and all(int(e) < 7 * 86400 for e in etas), s["line"]
    # a steady load never reads as a stall
    assert not any(s["verdict"] == "STALLED" for s in samples[:-1]), lines
    assert all(s["verdict"] == "PROGRESSING" for s in loading[1:]), lines
