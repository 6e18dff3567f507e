"""The monitor under an operator's real faults, with real processes: a server whose loader workers live outside its
process group and read with mmap; a URL where nothing listens while something else reads the disk; the remote
sshd frozen mid-load; a tensor-parallel rank killed mid-load; bad health/serve settings."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.monitor.test_cold_start import (HOST_KEYS, REPO, HERE, _env, finish, host_overrides, launch, output,
                                           wait_loading, waiting_then_progressing)


def _kdtree_watch(tmp_path, cache, run_dir, *overrides):
    out = open(run_dir.parent / f"{run_dir.name}.out", "w")
    return subprocess.Popen([sys.executable, "-m", "kdtree.run", "pipeline=watch", f"hydra.run.dir={run_dir}",
                             *overrides], cwd=REPO, env=_env(cache, tmp_path), stdout=out, stderr=subprocess.STDOUT)


def test_workers_outside_the_process_group_reading_with_mmap_are_progress_then_ready(tmp_path, kdtree_cache, port):
    """The main process reads nothing; two workers in their own sessions page 16 MB in through mmap for ~8 s with
    the port closed. A 3 s stall window: only the process TREE's read_bytes can keep it PROGRESSING."""
    blob = tmp_path / "weights.bin"
    blob.write_bytes(os.urandom(16 << 20))
    log, go = tmp_path / "server.log", tmp_path / "go"
    server = subprocess.Popen([sys.executable, str(HERE / "slow_start_server.py"), "--port", str(port), "--read",
                               str(blob), "--seconds", "8", "--log", str(log), "--workers", "2", "--go", str(go)])
    run_dir = tmp_path / "watch"
    try:
        watch = _kdtree_watch(tmp_path, kdtree_cache, run_dir, f"health.url=http://127.0.0.1:{port}",
                              f"health.pid={server.pid}", "health.interval_s=0.5", "health.stall_window_s=3",
                              f"health.expected_bytes={16 << 20}")
        deadline = time.monotonic() + 60
        while not (run_dir / "health.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.05)                     # the monitor is watching: start the cold start now
        go.write_text("")
        watch.wait(120)
    finally:
        server.kill()
        server.wait(10)
    assert watch.returncode == 0, output(run_dir)[-3000:]
    health = json.loads((run_dir / "health.json").read_text())
    verdicts = [s["verdict"] for s in health["samples"]]
    assert verdicts[-1] == "READY" and waiting_then_progressing(verdicts[:-1]), verdicts
    lines = [s["line"] for s in health["samples"]]
    # the workers are seen (3 processes), their page-ins are the moves, and the ETA runs on them
    loading = [s for s in health["samples"] if "(3 procs)" in s["line"] and "port refused" in s["line"]]
    assert len(loading) >= 6, lines
    assert any("process.read_bytes" in s["moved"] for s in loading), lines
    assert any("/16.8 MB" in s["line"] and "ETA" in s["line"] for s in loading), lines
    assert "evidence: process tree of pid" in output(run_dir)
    # no sample said that a process left with a negative rate
    assert not any("-" in ln.split("cpu ")[1].split("%")[0] for ln in lines if "cpu " in ln), lines


def test_nothing_listening_is_unreachable_while_another_process_reads_the_disk(tmp_path, port):
    """No server at the URL, no pid, and an unrelated process reading the disk all the time: UNREACHABLE with the
    reason within the stall window + 2 intervals, never PROGRESSING on somebody else's reads."""
    from kdtree.hosts import connect
    from kdtree.monitor.watcher import Target, Watcher

    blob = tmp_path / "other.bin"
    blob.write_bytes(os.urandom(8 << 20))
    reader = subprocess.Popen([sys.executable, "-c", (
        "import os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY); os.fsync(fd)\n"
        "while True:\n"
        "    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.pread(fd, 8 << 20, 0)\n"), str(blob)])
    window, interval = 2.0, 0.5
    try:
        for url, reason in ((f"http://127.0.0.1:{port}", "connection refused"),
                            ("http://no-such-host.invalid:30001", "host name not resolved")):
            lines = []
            t0 = time.monotonic()
            summary = Watcher(connect({"kind": "local"}), Target(url=url), interval_s=interval,
                              stall_window_s=window, probe_timeout_s=2, echo=lines.append).run()
            took = time.monotonic() - t0
            assert summary["verdict"] == "UNREACHABLE" and summary["exit_code"] == 5, lines
            assert reason in summary["reason"] and "nothing listening" in summary["reason"], summary["reason"]
            assert "nothing attributable to the server" in lines[0], lines[0]
            assert "PROGRESSING" not in "".join(ln for ln in lines if "moved:" in ln), lines
            assert took <= window + 2 * interval + 1.0, (took, lines)   # + one sample's own time on 2 busy cores
    finally:
        reader.kill()
        reader.wait(10)


def _descendants(root: int) -> list:
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                parent[int(d)] = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [q for q, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def test_frozen_sshd_mid_load_is_host_unreachable_and_the_run_exits(tmp_path, kdtree_cache, sshd):
    """SIGSTOP of the remote sshd (the listener and every session) while the engine loads through it: "host
    unreachable" within 2 intervals, a verdict within the stall window + 5 s, and the foreground run exits within
    its stop timeout with the command that stops the engine later."""
    host_cfg = {**{k: v for k, v in sshd.items() if k in HOST_KEYS}, "connect_timeout_s": 1}
    interval, window, stop_s = 2.0, 6.0, 1.0
    run_dir = tmp_path / "frozen-sshd"
    out = open(run_dir.parent / f"{run_dir.name}.out", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kdtree.run", "load.progress=false", "tree=ar", "serve.port=0",
                             "load.throttle_mb_s=0.3", f"health.interval_s={interval}",
                             f"health.stall_window_s={window}", "health.probe_timeout_s=1", f"stop.timeout_s={stop_s}",
                             f"hydra.run.dir={run_dir}", *host_overrides(host_cfg)],
                            cwd=REPO, env=_env(kdtree_cache, run_dir.parent), stdout=out, stderr=subprocess.STDOUT)
    master = int(Path(sshd["dir"], "sshd.pid").read_text())
    frozen = []
    try:
        engine = wait_loading(run_dir, min_bytes=64 * 1024)
        time.sleep(interval)                                  # a couple of samples over the live connection
        frozen = [master] + _descendants(master)
        assert engine not in frozen                           # the engine is detached from the sshd session
        for p in frozen:
            os.kill(p, signal.SIGSTOP)
        t_stop = time.time()
        proc.wait(60)
        t_exit = time.time()
    finally:
        for p in frozen:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass
    health = finish(proc, run_dir)
    assert proc.returncode == 5, output(run_dir)[-3000:]
    after = [s for s in health["samples"] if s["at"] > t_stop]
    first = next(s for s in after if "host not answering" in s["reason"] or "host unreachable" in s["reason"])
    assert first["at"] - t_stop <= 2 * interval + 0.5, [s["line"] for s in after]
    assert health["verdict"] == "UNREACHABLE" and "host unreachable" in health["reason"], health["reason"]
    verdict_at = health["samples"][-1]["at"]
    assert verdict_at - t_stop <= window + 5.0, [s["line"] for s in after]
    # stop over the dead transport: gives up after its budget (stop.timeout_s + 2 s) and says how to stop it later
    assert t_exit - verdict_at <= stop_s + 2.0 + 3.0, (t_exit - verdict_at)
    text = output(run_dir)
    assert f"pipeline=stop stop.run_dir={run_dir}" in text and "could not stop engine" in text, text[-2000:]
    assert "Traceback" not in text and "paramiko" not in text, text[-3000:]


def test_killed_tp_rank_mid_load_is_crashed_within_2_s_naming_the_rank(tmp_path, kdtree_cache):
    run_dir = tmp_path / "rank"
    proc = launch(kdtree_cache, run_dir, {"name": "local", "kind": "local"}, "tp=2", "load.throttle_mb_s=0.5",
                  "health.interval_s=0.5", "health.stall_window_s=30")
    try:
        engine = wait_loading(run_dir, min_bytes=64 * 1024)
        ranks = [q for q in _descendants(engine)
                 if b"kdtree.parallel.worker" in open(f"/proc/{q}/cmdline", "rb").read()]
        assert len(ranks) == 1, ranks
        os.kill(ranks[0], signal.SIGKILL)
        t_kill = time.time()
    except BaseException:
        proc.kill()
        raise
    health = finish(proc, run_dir)
    assert proc.returncode == 4, output(run_dir)[-3000:]
    assert health["verdict"] == "CRASHED", health["reason"]
    assert "tp rank 1/2" in health["reason"] and "SIGKILL" in health["reason"], health["reason"]
    assert health["samples"][-1]["at"] - t_kill <= 2.0, [s["line"] for s in health["samples"][-4:]]
    st = json.loads((run_dir / "status.json").read_text())
    assert st["phase"] == "failed" and "tp rank 1/2" in st["error"], st
    # serve.detach=true: the run stopped the engine whose health poll failed instead of leaving it behind
    from kdtree.pipeline.events import read_events
    stops = [e for e in read_events(run_dir) if e.get("kind") == "engine_stop"]
    assert stops and stops[-1]["why"] == "stage 'health_poll' failed", stops
    assert not Path(f"/proc/{engine}").exists() or open(f"/proc/{engine}/stat").read().split(") ")[1][0] in "ZX"


BAD_SETTINGS = [
    ("health.stall_window_s=-5", "health.stall_window_s=-5.0 must be a positive"),
    ("health.deadline_s=-1", "health.deadline_s=-1.0 must be a positive"),
    ("health.probe_timeout_s=0", "health.probe_timeout_s=0.0 must be a positive"),
    ("health.interval_s=0", "health.interval_s=0.0 must be a positive"),
    ("health.url=not-a-url", "health.url=not-a-url is not an http(s) URL"),
    ("health.url=http://h:99999", "health.url=http://h:99999 has a bad port"),
    ("health.url=http://h:8000/v1", "give the server's base URL"),
    ("health.pid=-3", "health.pid=-3 must be a process id"),
    ("health.disk=/dev/sda", "health.disk='/dev/sda' must be a device name"),
    ("health.expected_bytes=-1", "health.expected_bytes=-1 must be >= 0"),
    ("serve.port=70000", "serve.port=70000 is not a TCP port"),
    ("serve.host=http://0.0.0.0", "serve.host='http://0.0.0.0' must be an address"),
    ("serve.max_queue=0", "serve.max_queue=0 must be >= 1"),
]


@pytest.mark.parametrize("arg,want", BAD_SETTINGS, ids=[a for a, _ in BAD_SETTINGS])
def test_every_bad_health_or_serve_setting_is_one_config_error(compose_cfg, arg, want):
    from kdtree.config.validate import validate
    from kdtree.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        validate(compose_cfg("pipeline=watch", "health.url=http://127.0.0.1:30001", arg))
    assert want in str(e.value) and "\n" not in str(e.value)


def test_bad_settings_and_a_yaml_syntax_error_are_one_line_from_the_command_before_anything_starts(tmp_path,
                                                                                                  kdtree_cache):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("name: bad\nstages:\n  - {stage: load, on: host\n  - {stage: serve, on: host}\n")
    cases = [("health.stall_window_s=-5", "health.stall_window_s=-5.0 must be a positive"),
             ("serve.port=70000", "serve.port=70000 is not a TCP port"),
             (f"pipeline={bad_yaml}", f"{bad_yaml}:4:")]
    procs = [subprocess.Popen([sys.executable, "-m", "kdtree.run", arg, f"hydra.run.dir={tmp_path / str(i)}"],
                              cwd=REPO, env=_env(kdtree_cache, tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i, (arg, _) in enumerate(cases)]
    for i, ((arg, want), p) in enumerate(zip(cases, procs)):
        text = p.communicate(timeout=120)[0]
        lines = [ln for ln in text.splitlines() if ln.strip()]
        assert p.returncode == 2 and len(lines) == 1, (arg, text)
        assert lines[0].startswith("kdtree: error: ") and want in lines[0], (arg, lines[0])
        assert not (tmp_path / str(i) / "events.jsonl").exists()          # nothing started


NOT_OPENAI_SERVER = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Authorization") != "Bearer " + sys.argv[2]:
            return self._send(401, {"detail": "bad key"})
        self._send(404, {"detail": "no such route: this is a TGI-style server"})

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_server_that_is_not_an_openai_completions_server_is_its_own_verdict(tmp_path, port):
    """A server that answers POST /v1/completions with 404 (the key, sent through the probe's stdin, is right:
    a wrong one would be 401): NOT_OPENAI with the status and the start of the body, not "nothing moved"."""
    from kdtree.hosts import connect
    from kdtree.monitor.watcher import Target, Watcher

    key = "sk-test-0123456789"
    server = subprocess.Popen([sys.executable, "-c", NOT_OPENAI_SERVER, str(port), key])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if subprocess.run(["curl", "-s", "-o", "/dev/null", f"http://127.0.0.1:{port}/"]).returncode == 0:
                break
            time.sleep(0.1)
        lines = []
        summary = Watcher(connect({"kind": "local"}), Target(url=f"http://127.0.0.1:{port}", api_key=key),
                          interval_s=0.3, stall_window_s=30, probe_timeout_s=2, out_dir=tmp_path,
                          echo=lines.append).run()
    finally:
        server.kill()
        server.wait(10)
    assert summary["verdict"] == "NOT_OPENAI" and summary["exit_code"] == 6, lines
    assert "not as an OpenAI completions server" in summary["reason"] and "HTTP 404" in summary["reason"]
    assert "this is a TGI-style server" in summary["reason"] and summary["seconds"] < 5, lines
    assert key not in (tmp_path / "health.json").read_text()


def test_url_only_server_listening_early_is_watched_through_the_ports_owner(tmp_path, port):
    """No pid given, but the server listens from its first second (503 while loading): the process that owns the
    port is found on the host and its tree (mmap workers in their own sessions) keeps a 3 s window PROGRESSING."""
    from kdtree.hosts import connect
    from kdtree.monitor.watcher import Target, Watcher

    blob = tmp_path / "weights.bin"
    blob.write_bytes(os.urandom(16 << 20))
    server = subprocess.Popen([sys.executable, str(HERE / "slow_start_server.py"), "--port", str(port), "--read",
                               str(blob), "--seconds", "6", "--log", str(tmp_path / "log"), "--workers", "2",
                               "--early-port"])
    lines = []
    try:
        summary = Watcher(connect({"kind": "local"}), Target(url=f"http://127.0.0.1:{port}"), interval_s=0.5,
                          stall_window_s=3, probe_timeout_s=2, echo=lines.append).run()
    finally:
        server.kill()
        server.wait(10)
    assert summary["verdict"] == "READY", lines
    assert waiting_then_progressing([s["verdict"] for s in summary["samples"][:-1]]), lines
    assert "until the server's process is found by its port" in lines[0], lines[0]
    assert any(f"pid {server.pid} " in ln and "(3 procs)" in ln and "http 503" in ln for ln in lines), lines
