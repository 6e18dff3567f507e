"""`python -m kdtree.run pipeline=watch` as an operator runs it (issue 37 rows 6, 11, 12, 13, 15, 16), against a real
kdtree server (keyed), a URL where nothing listens, and real processes killed or stopped (SIGKILL, SIGSTOP):

* the key of a keyed server comes from KDTREE_API_KEY or health.api_key_file; health.api_key= is refused (it would be
  in `ps`), before anything starts;
* the exit code is the verdict's, as the README says: 0 READY, 3 STALLED, 4 CRASHED, 5 UNREACHABLE, 6 NOT_OPENAI;
* a stopped server (state T) is STALLED at the window, the reason says it is stopped; a local host is never
  "unreachable";
* the first lines, before anything moved, say WAITING, not PROGRESSING;
* health.pid naming no process is an error at start, not a CRASHED verdict;
* a missing log file, a unit without systemd and an unknown disk are said once, with why, and never claimed.

Run: .venv/bin/python -m pytest -q tests/monitor/test_watch_cli.py
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.serve.served_engine import alive, start_served, stop

REPO = Path(__file__).resolve().parents[2]
KEY = "watch-test-key-7f3a"


def watch(tmp_path: Path, cache: Path, name: str, *overrides: str, env=None, timeout: float = 120, started=None):
    """pipeline=watch in its own run dir; (CompletedProcess, health.json or None). `started(run_dir)` is called
    once the monitor writes its first sample (the test's fault goes in then)."""
    run_dir = tmp_path / name
    e = {k: v for k, v in os.environ.items() if k != "KDTREE_API_KEY"}
    e.update(KDTREE_CACHE=str(cache), KDTREE_RUNS=str(tmp_path), **(env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "kdtree.run", "pipeline=watch", f"hydra.run.dir={run_dir}",
                             "health.interval_s=0.5", *overrides], cwd=REPO, env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        if started is not None:
            deadline = time.monotonic() + 60
            jsonl = run_dir / "health.jsonl"
            while time.monotonic() < deadline and proc.poll() is None and \
                    not (jsonl.exists() and jsonl.read_text().strip()):
                time.sleep(0.05)
            started(run_dir)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    path = run_dir / "health.json"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, ""), \
        (json.loads(path.read_text()) if path.exists() else None)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, kdtree_cache):
    s = start_served(tmp_path_factory, kdtree_cache, extra_env={"KDTREE_API_KEY": KEY})
    yield s
    if alive(s.pid):
        stop(s.pid, signal.SIGKILL)


def test_the_key_of_a_keyed_server_comes_from_the_environment_or_a_file_never_argv(tmp_path, kdtree_cache, keyed):
    r, health = watch(tmp_path, kdtree_cache, "env", f"health.url={keyed.url}", env={"KDTREE_API_KEY": KEY})
    assert r.returncode == 0 and health["verdict"] == "READY", r.stdout[-2000:]
    key_file = tmp_path / "watch.key"
    key_file.write_text(KEY + "\n")
    r, health = watch(tmp_path, kdtree_cache, "file", f"health.url={keyed.url}", f"health.api_key_file={key_file}")
    assert r.returncode == 0 and health["verdict"] == "READY", r.stdout[-2000:]
    assert KEY not in "".join(p.read_text() for p in (tmp_path / "file").rglob("*") if p.is_file())
    # on the command line: refused before anything starts, with the two ways that work
    r, health = watch(tmp_path, kdtree_cache, "argv", f"health.url={keyed.url}", f"health.api_key={KEY}")
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and health is None, r.stdout
    assert "health.api_key is not taken" in lines[0] and "KDTREE_API_KEY" in lines[0] and \
        "health.api_key_file" in lines[0] and KEY not in lines[0], lines[0]
    # no key at all: the server answers 401, which is NOT_OPENAI, exit 6
    r, health = watch(tmp_path, kdtree_cache, "nokey", f"health.url={keyed.url}")
    assert r.returncode == 6 and health["verdict"] == "NOT_OPENAI" and "401" in health["reason"], r.stdout[-2000:]


def test_exit_codes_are_the_verdicts(tmp_path, kdtree_cache, port):
    r, health = watch(tmp_path, kdtree_cache, "nothing", f"health.url=http://127.0.0.1:{port}",
                      "health.stall_window_s=2")
    assert r.returncode == 5 and health["verdict"] == "UNREACHABLE", r.stdout[-2000:]
    victim = subprocess.Popen(["sleep", "600"])
    try:
        r, health = watch(tmp_path, kdtree_cache, "killed", f"health.url=http://127.0.0.1:{port}",
                          f"health.pid={victim.pid}", "health.stall_window_s=30",
                          started=lambda _: (victim.kill(), victim.wait()))
    finally:
        victim.kill()
        victim.wait()
    assert r.returncode == 4 and health["verdict"] == "CRASHED", r.stdout[-2000:]
    assert f"engine pid {victim.pid} is gone" in health["reason"]


def test_a_stopped_server_is_stalled_at_the_window_naming_state_t_never_unreachable(tmp_path, kdtree_cache, port):
    victim = subprocess.Popen(["sleep", "600"])
    window = 3.0
    try:
        t0 = time.monotonic()
        r, health = watch(tmp_path, kdtree_cache, "stopped", f"health.url=http://127.0.0.1:{port}",
                          f"health.pid={victim.pid}", f"health.stall_window_s={window}",
                          started=lambda _: os.kill(victim.pid, signal.SIGSTOP))
    finally:
        victim.kill()
        victim.wait()
    assert r.returncode == 3 and health["verdict"] == "STALLED", r.stdout[-2000:]
    assert f"pid {victim.pid} is stopped (state T" in health["reason"], health["reason"]
    assert not any("unreachable" in s["line"].lower() for s in health["samples"]), r.stdout[-3000:]
    last = health["samples"][-1]
    assert last["t"] <= window + 2.0, r.stdout[-2000:]         # at the window (+ one interval and a sample)
    # nothing ever moved: no line claims progress
    assert {s["verdict"] for s in health["samples"][:-1]} == {"WAITING"}, r.stdout[-2000:]
    assert "nothing moved yet" in health["samples"][0]["line"]
    del t0


def test_a_pid_that_names_no_process_is_an_error_at_start_not_a_crash(tmp_path, kdtree_cache, port):
    r, health = watch(tmp_path, kdtree_cache, "typo", f"health.url=http://127.0.0.1:{port}", "health.pid=999999")
    assert r.returncode not in (0, 4) and "no process 999999 (health.pid)" in r.stdout, r.stdout[-2000:]
    assert "CRASHED" not in r.stdout and health is None, r.stdout[-2000:]


def test_missing_evidence_is_said_once_with_why_and_never_claimed(tmp_path, kdtree_cache, port):
    missing_log = tmp_path / "no-such.log"
    r, health = watch(tmp_path, kdtree_cache, "missing", f"health.url=http://127.0.0.1:{port}",
                      f"health.log={missing_log}", "health.disk=nosuchdev", "health.stall_window_s=1.5")
    out = r.stdout
    assert r.returncode == 5, out[-2000:]
    first = next(ln for ln in out.splitlines() if ln.startswith("watching "))
    assert "+ log" not in first and "and the log" not in first, first
    assert f"health.log={missing_log}: no such file" in first, first
    assert "health.disk=nosuchdev: not in /proc/diskstats" in first, first
    assert out.count("no such file") == 1 and out.count("nosuchdev") == 1, out[-3000:]
    assert "disk nosuchdev" not in out and " ?" not in "".join(s["line"] for s in health["samples"]), out[-3000:]
    # a unit on a host without systemd (or without that unit)
    r, health = watch(tmp_path, kdtree_cache, "unit", f"health.url=http://127.0.0.1:{port}",
                      "health.unit=kdtree-no-such-unit", "health.stall_window_s=1.5")
    out = r.stdout
    first = next(ln for ln in out.splitlines() if ln.startswith("watching "))
    assert "health.unit=kdtree-no-such-unit: " in first and ("no systemd" in first or "no such unit" in first
                                                             or "systemctl says" in first), first
    assert "None/None" not in out and "+ log" not in first and "unit kdtree-no-such-unit's" not in first, out[-3000:]
