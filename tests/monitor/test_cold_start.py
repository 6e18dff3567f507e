"""The monitor against real cold starts: kdtree's own engine through `python -m kdtree.run` (throttled load,
SIGSTOP, SIGKILL) and, with pipeline=watch, a server that is not kdtree — locally and through a real sshd."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def _env(cache, runs):
    return dict(os.environ, KDTREE_CACHE=str(cache), KDTREE_RUNS=str(runs))


HOST_KEYS = ("name", "kind", "address", "user", "port", "key_file", "known_hosts", "workdir", "python", "supervisor",
             "connect_timeout_s", "command_timeout_s")


@pytest.fixture(params=["local", "ssh"])
def host_cfg(request) -> dict:
    """Where the pipeline runs the engine: this machine, or the fixture sshd (engine under its session, every
    probe of health_poll through that ssh connection)."""
    if request.param == "local":
        return {"name": "local", "kind": "local"}
    return {k: v for k, v in request.getfixturevalue("sshd").items() if k in HOST_KEYS}


def waiting_then_progressing(verdicts) -> bool:
    """A watch says WAITING until something moved (its first sample: nothing to compare with), then PROGRESSING."""
    n = next((i for i, v in enumerate(verdicts) if v != "WAITING"), len(verdicts))
    return n >= 1 and n < len(verdicts) and set(verdicts[n:]) == {"PROGRESSING"}


def host_overrides(host_cfg: dict) -> list:
    return [] if host_cfg["kind"] == "local" else [f"host.{k}={v}" for k, v in host_cfg.items()]


def operator_signal(host_cfg: dict, pid: int, sig: signal.Signals) -> float:
    """`kill -SIG pid` as an operator would on that host (for ssh: a command through the host connection);
    the wall time just after it was delivered."""
    from kdtree.hosts import connect

    host = connect(host_cfg)
    try:
        assert host.signal(pid, sig, group=False), f"kill -{sig.name[3:]} {pid} on {host.label} failed"
        return time.time()
    finally:
        host.close()


def assert_ran_on(host_cfg: dict, run_dir: Path, health: dict) -> None:
    """The engine ran where host_cfg says, and the monitor probed it through that host."""
    from kdtree.pipeline.events import read_events

    start = next(e for e in read_events(run_dir) if e.get("kind") == "engine_start")
    if host_cfg["kind"] == "ssh":
        assert start["ssh"].split()[-1] == str(host_cfg["port"]), start      # the engine's sshd session
        assert health["host"] == f"{host_cfg['user']}@127.0.0.1:{host_cfg['port']}"
    else:
        assert start["ssh"] == os.environ.get("SSH_CONNECTION", ""), start      # no sshd in between
        assert health["host"] == "local"


def launch(cache, run_dir: Path, host_cfg: dict, *overrides: str) -> subprocess.Popen:
    """kdtree's serve pipeline (load -> warmup -> serve + health_poll) on `host_cfg`, returning when health_poll
    settles."""
    out = open(run_dir.parent / f"{run_dir.name}.out", "w")
    return subprocess.Popen([sys.executable, "-m", "kdtree.run", "load.progress=false", "tree=ar", "serve.port=0",
                             "serve.detach=true", "stop.timeout_s=1", f"hydra.run.dir={run_dir}",
                             *host_overrides(host_cfg), *overrides],
                            cwd=REPO, env=_env(cache, run_dir.parent), stdout=out, stderr=subprocess.STDOUT)


def wait_loading(run_dir: Path, min_bytes: int = 1, timeout: float = 60) -> int:
    """The engine pid, once its status shows checkpoint bytes loading."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            st = json.loads((run_dir / "status.json").read_text())
            if st.get("phase") == "loading" and st.get("bytes_done", 0) >= min_bytes:
                return int(st["pid"])
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    pytest.fail(f"no loading progress in {run_dir}/status.json within {timeout} s")


def wait_progressing(run_dir: Path, timeout: float = 60) -> None:
    """Until the monitor has said PROGRESSING once (health.jsonl): what an operator sees before acting. Without it a
    slow ssh probe can leave only the first sample (WAITING: nothing to compare with) before the signal lands."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            lines = (run_dir / "health.jsonl").read_text().splitlines()
            if any(json.loads(line)["verdict"] == "PROGRESSING" for line in lines if line.endswith("}")):
                return
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    pytest.fail(f"the monitor never said PROGRESSING in {run_dir}/health.jsonl within {timeout} s")


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float = 90) -> dict:
    try:
        proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        pid_file = run_dir / "engine.pid"
        if pid_file.exists():                        # never leave an engine behind (stopped or not)
            pid = int(pid_file.read_text())
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
    return json.loads((run_dir / "health.json").read_text())


def output(run_dir: Path) -> str:
    return (run_dir.parent / f"{run_dir.name}.out").read_text()


def test_throttled_load_is_progressing_with_rate_and_eta_then_ready_within_one_interval(tmp_path, kdtree_cache,
                                                                                         host_cfg):
    run_dir = tmp_path / "slow"
    proc = launch(kdtree_cache, run_dir, host_cfg, "load.throttle_mb_s=1", "health.interval_s=0.5",
                  "health.stall_window_s=10")
    health = finish(proc, run_dir)
    assert proc.returncode == 0, output(run_dir)[-3000:]
    assert health["verdict"] == "READY"
    assert_ran_on(host_cfg, run_dir, health)
    verdicts = [s["verdict"] for s in health["samples"]]
    assert waiting_then_progressing(verdicts[:-1]) and verdicts[-1] == "READY", verdicts
    loading = [s for s in health["samples"] if (s.get("status") or {}).get("phase") == "loading"
               and s["status"].get("bytes_total")]
    # 12.5 MB at 1 MB/s: a sample every 0.5 s locally; through ssh the probes take ~1 s (each one an ssh session
    # whose login shell reads its rc files), so samples run back to back: still >= 8 of them during the load
    assert len(loading) >= 8, [s["line"] for s in health["samples"]]
    assert any("MB/s" in s["line"] and "ETA" in s["line"] for s in loading)
    st = json.loads((run_dir / "status.json").read_text())
    load_end = st["phases"]["warmup"]["started_at"]  # loading left for warm-up (same clock: sshd is on this machine)
    # the ETA printed half-way through the load, against when the load actually finished
    total = loading[0]["status"]["bytes_total"]
    mid = [s for s in loading if s["eta"] and s["eta"]["eta_s"] is not None
           and 0.35 <= s["eta"]["bytes_done"] / total <= 0.65]
    assert mid, [s["line"] for s in loading]
    errors = sorted(abs(s["eta"]["eta_s"] - (load_end - s["at"])) / (load_end - s["at"]) for s in mid)
    assert errors[len(errors) // 2] <= 0.2, (errors, [s["line"] for s in mid])     # median over the middle third
    # READY: the first sample that started after the engine became ready says so
    ready_at = st["phases"]["ready"]["started_at"]
    assert all(s["verdict"] == "READY" for s in health["samples"] if s["started_at"] > ready_at)
    prev = health["samples"][-2]
    # one interval (0.5 s) after the previous sample ended, + scheduling slack on a shared 2-core machine
    assert health["samples"][-1]["started_at"] - ready_at <= 0.5 + (prev["at"] - prev["started_at"]) + 1.0
    # 503 with a clear body while it loaded
    msgs = [s["probes"]["completion"]["data"].get("message", "") for s in loading]
    assert any(m.startswith("model is not ready: loading") for m in msgs)


def test_frozen_engine_is_stalled_within_its_window(tmp_path, kdtree_cache, host_cfg):
    run_dir = tmp_path / "frozen"
    window = 4.0
    proc = launch(kdtree_cache, run_dir, host_cfg, "load.throttle_mb_s=0.5", "health.interval_s=0.5",
                  f"health.stall_window_s={window}", "health.probe_timeout_s=1.5")
    pid = wait_loading(run_dir, min_bytes=256 * 1024)
    wait_progressing(run_dir)
    t_stop = operator_signal(host_cfg, pid, signal.SIGSTOP)
    health = finish(proc, run_dir)
    assert proc.returncode == 3, output(run_dir)[-3000:]
    assert health["verdict"] == "STALLED", health["reason"]
    assert_ran_on(host_cfg, run_dir, health)
    before = [s for s in health["samples"] if s["at"] < t_stop]
    assert waiting_then_progressing([s["verdict"] for s in before]), [s["line"] for s in before]
    stalled = health["samples"][-1]
    # nothing moves after the stop: the last move is seen at the latest by the first sample that started after it,
    # the window counts from that sample's start, and STALLED comes with the first sample that ends past it
    first_after = next(s for s in health["samples"] if s["started_at"] >= t_stop)
    assert stalled["at"] - first_after["started_at"] <= window + 0.5 + (stalled["at"] - stalled["started_at"]) + 0.1
    # overall: the sample in flight at the stop + one interval, the window, then one sample (<= probe timeout); each
    # of the two samples + one host round trip (what a bare `cat /proc/diskstats` took there: ~0 locally, ~1 s ssh)
    rtt = max(s["probes"]["disk"]["seconds"] for s in health["samples"])
    assert stalled["at"] - t_stop <= window + 0.5 + 1.5 + 2.0 + 2 * rtt, (stalled["line"], rtt)
    assert f"pid {pid} T" in stalled["line"] and "nothing moved" in stalled["reason"]
    assert f"pid {pid} is stopped (state T" in stalled["reason"], stalled["reason"]          # issue 37 row 11
    assert not any("unreachable" in s["line"].lower() for s in health["samples"]), stalled["line"]
    assert "STALLED" in output(run_dir)


def test_killed_engine_is_crashed_at_the_next_sample(tmp_path, kdtree_cache, host_cfg):
    run_dir = tmp_path / "killed"
    proc = launch(kdtree_cache, run_dir, host_cfg, "load.throttle_mb_s=0.5", "health.interval_s=0.5",
                  "health.stall_window_s=30")
    pid = wait_loading(run_dir)
    wait_progressing(run_dir)
    t_kill = operator_signal(host_cfg, pid, signal.SIGKILL)
    health = finish(proc, run_dir)
    assert proc.returncode == 4, output(run_dir)[-3000:]
    assert health["verdict"] == "CRASHED" and f"engine pid {pid}" in health["reason"], health["reason"]
    assert_ran_on(host_cfg, run_dir, health)
    assert waiting_then_progressing([s["verdict"] for s in health["samples"] if s["at"] < t_kill])
    # the sample in flight at the kill (unless it read /proc just before the kill landed: then PROGRESSING), or
    # else the next one (<= one interval later), says CRASHED within 2 s
    after = [s for s in health["samples"] if s["at"] > t_kill]
    crashed = after[-1]
    assert crashed["verdict"] == "CRASHED" and crashed is health["samples"][-1]
    assert len(after) <= 2 and all(s["started_at"] < t_kill for s in after[:-1]), [s["line"] for s in after]
    assert "; log: " in crashed["reason"]
    assert crashed["at"] - max(crashed["started_at"], t_kill) <= 2.0


def start_stand_in(tmp_path: Path, port: int, seconds: float, go: Path = None):
    blob = tmp_path / "weights.bin"
    if not blob.exists():
        blob.write_bytes(os.urandom(16 << 20))
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 16 << 20}, "weight_map": {}}))
    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, str(HERE / "slow_start_server.py"), "--port", str(port),
                             "--read", str(blob), "--seconds", str(seconds), "--log", str(log)]
                            + (["--go", str(go)] if go else []))
    return proc, log


def test_watch_any_openai_server_and_compare_with_its_history(tmp_path, kdtree_cache, port):
    """pipeline=watch against a server without /status; the second start is compared with the first."""
    for attempt in (1, 2):
        go = tmp_path / f"go{attempt}"
        server, log = start_stand_in(tmp_path, port, seconds=3.0, go=go)
        run_dir = tmp_path / f"watch{attempt}"
        run_dir.mkdir()
        out = open(run_dir / "stdout", "w+")
        try:
            watch = subprocess.Popen([sys.executable, "-m", "kdtree.run", "pipeline=watch",
                                      f"health.url=http://127.0.0.1:{port}", f"health.pid={server.pid}",
                                      f"health.log={log}", "health.interval_s=0.5", "health.stall_window_s=10",
                                      f"model.path={tmp_path}", f"hydra.run.dir={run_dir}"],
                                     cwd=REPO, env=_env(kdtree_cache, tmp_path), stdout=out, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 60
            while not (run_dir / "health.jsonl").exists() and time.monotonic() < deadline:
                time.sleep(0.05)                     # the monitor is watching: start the cold start now
            go.write_text("")
            watch.wait(90)
        finally:
            server.kill()
            server.wait(10)
        out.seek(0)
        stdout = out.read()
        assert watch.returncode == 0, stdout[-3000:]
        health = json.loads((run_dir / "health.json").read_text())
        assert health["verdict"] == "READY"
        assert waiting_then_progressing([s["verdict"] for s in health["samples"][:-1]])
        assert any("port refused" in s["line"] and "log +" in s["line"] and "read" in s["line"]
                   for s in health["samples"])
        assert health["phases"]["port_closed"] > 2.0
        # ETA from the process's reads against the checkpoint index's total_size (model.path)
        assert any("/16.8 MB" in s["line"] and "ETA" in s["line"] for s in health["samples"])
    assert "matches the 1 earlier cold start" in stdout, stdout[-2000:]


def test_probes_through_ssh_and_an_unreachable_host(tmp_path, port, sshd):
    from kdtree.hosts import SshHost
    from kdtree.monitor.watcher import Target, Watcher

    go = tmp_path / "go"
    server, log = start_stand_in(tmp_path, port, seconds=4.0, go=go)
    host = SshHost.from_config({k: v for k, v in sshd.items() if k != "dir"})
    lines = []
    threading.Timer(1.0, go.write_text, ("",)).start()
    try:
        w = Watcher(host, Target(url=f"http://127.0.0.1:{port}", pid=server.pid, log=str(log)), interval_s=0.5,
                    stall_window_s=10, probe_timeout_s=5, out_dir=tmp_path / "ssh", echo=lines.append)
        summary = w.run()
    finally:
        server.kill()
        server.wait(10)
        host.close()
    assert summary["verdict"] == "READY", lines
    assert summary["host"] == host.label and f"on {host.label}" in lines[0]
    progressing = [ln for ln in lines if "PROGRESSING" in ln]       # evidence gathered over ssh
    assert any("port refused" in ln and " read " in ln and "log +" in ln for ln in progressing), lines
    dead = SshHost.from_config({**{k: v for k, v in sshd.items() if k != "dir"}, "port": port, "connect_timeout_s": 1})
    w = Watcher(dead, Target(url=f"http://127.0.0.1:{port}"), interval_s=0.2, stall_window_s=1.0, probe_timeout_s=2,
                out_dir=tmp_path / "dead", echo=lines.append)
    summary = w.run()
    dead.close()
    assert summary["verdict"] == "UNREACHABLE" and summary["exit_code"] == 5
    assert all(s["verdict"] == "UNREACHABLE" for s in summary["samples"])
