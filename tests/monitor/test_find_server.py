"""Issue 37 row 14: the README's first `watch` example, a URL only (or URL + log), on a live SGLang-shaped cold start
(tests/monitor/slow_start_server.py: the port shut while two mmap workers in their own sessions page the weights in,
the log silent until ready). Without health.pid the monitor finds the server's process by its port — here by the
command line naming `--port N`, the port being shut — says which process it found and how, watches its tree
(PROGRESSING on its page-ins) and ends READY, where main said UNREACHABLE at the stall window.

Run: .venv/bin/python -m pytest -q tests/monitor/test_find_server.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.monitor.test_cold_start import waiting_then_progressing

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
WINDOW, LOAD_S = 4.0, 9.0


@pytest.mark.parametrize("with_log", [False, True], ids=["url", "url+log"])
def test_url_only_cold_start_with_the_port_shut_is_found_by_its_command_line_and_ends_ready(tmp_path, kdtree_cache,
                                                                                           port, with_log):
    blob = tmp_path / "weights.bin"
    blob.write_bytes(os.urandom(16 << 20))
    log, go = tmp_path / "server.log", tmp_path / "go"
    server = subprocess.Popen([sys.executable, str(HERE / "slow_start_server.py"), "--port", str(port), "--read",
                               str(blob), "--seconds", str(LOAD_S), "--log", str(log), "--workers", "2",
                               "--go", str(go)])
    run_dir = tmp_path / "watch"
    env = dict(os.environ, KDTREE_CACHE=str(kdtree_cache), KDTREE_RUNS=str(tmp_path))
    args = [sys.executable, "-m", "kdtree.run", "pipeline=watch", f"hydra.run.dir={run_dir}",
            f"health.url=http://127.0.0.1:{port}", "health.interval_s=0.5", f"health.stall_window_s={WINDOW:g}"]
    watch = subprocess.Popen(args + ([f"health.log={log}"] if with_log else []), cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "health.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        t_go = time.monotonic()
        go.write_text("")                        # the monitor watches: the cold start begins (port shut ~9 s)
        out = watch.communicate(timeout=120)[0]
    finally:
        if watch.poll() is None:
            watch.kill()
        server.kill()
        server.wait(10)
    health = json.loads((run_dir / "health.json").read_text())
    lines = [s["line"] for s in health["samples"]]
    assert watch.returncode == 0 and health["verdict"] == "READY", out[-3000:]
    assert time.monotonic() - t_go >= LOAD_S                # it waited for the load, longer than the window
    # said once, which process and how: the stand-in's pid, by its command line naming the (shut) port
    found = [ln for ln in out.splitlines() if ln.startswith("found the server's process")]
    assert len(found) == 1, out[-3000:]
    assert f"pid {server.pid} " in found[0] and f"its command line names port {port}" in found[0], found
    assert "slow_start_server.py" in found[0]
    verdicts = [s["verdict"] for s in health["samples"]]
    assert verdicts[-1] == "READY" and waiting_then_progressing(verdicts[:-1]), lines
    assert "UNREACHABLE" not in verdicts and "STALLED" not in verdicts
    # PROGRESSING with evidence: the tree (main + 2 workers) paging the weights in while the port is shut
    shut = [s for s in health["samples"] if "port refused" in s["line"] and s["verdict"] == "PROGRESSING"]
    assert len(shut) >= 6, lines
    assert any(f"pid {server.pid} " in s["line"] and "(3 procs)" in s["line"] for s in shut), lines
    assert any(set(s["moved"]) & {"process.read_bytes", "process.faults"} for s in shut), lines
