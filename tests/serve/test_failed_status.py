"""A stage failing inside the engine process: status.json says phase "failed" with the error, /health answers
503, /status and the completions' 503 carry the error, and the monitor (health_poll) calls it CRASHED with that
error — a real engine process whose host stage fails after the serve hook opened the port."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

from served_engine import REPO, TREE, alive, stop

PIPELINE = """name: failing
stages:
  - {stage: load,        on: host}
  - {stage: fail,        on: host, params: {message: "weights rejected by the checker", delay_s: 0.5}}
  - {stage: serve,       on: host}
  - {stage: health_poll, on: controller}
"""


def http(url: str, path: str, body=None):
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_failed_stage_is_reported_by_status_health_and_the_monitor(tmp_path, kdtree_cache):
    (tmp_path / "failing.yaml").write_text(PIPELINE)
    runs = tmp_path / "runs"
    run_dir = runs / "failing"
    env = dict(os.environ, KDTREE_CACHE=str(kdtree_cache), KDTREE_RUNS=str(runs))
    proc = subprocess.Popen([sys.executable, "-m", "kdtree.run", "load.progress=false",
                             f"pipeline={tmp_path / 'failing.yaml'}", "serve.port=0", "serve.detach=true",
                             "health.interval_s=0.5", f"hydra.run.dir={run_dir}", *TREE],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = None
    try:
        deadline, st = time.monotonic() + 120, {}
        while time.monotonic() < deadline:
            try:
                st = json.loads((run_dir / "status.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                st = {}
            if st.get("phase") == "failed" or proc.poll() is not None:
                break
            time.sleep(0.05)
        pid = int((run_dir / "engine.pid").read_text())
        assert st.get("phase") == "failed", st
        assert st["error"] == "PipelineError: weights rejected by the checker"
        assert st["error_type"] == "PipelineError" and st["failed_stage"] == "fail"
        # the port opened by serve's hook still answers, and says why
        code, health = http(st["url"], "/health")
        assert code == 503 and health["status"] == "failed" and health["phase"] == "failed"
        code, status = http(st["url"], "/status")
        assert code == 200 and status["phase"] == "failed" and "weights rejected" in status["error"]
        assert http(st["url"], "/ready")[0] == 503
        code, err = http(st["url"], "/v1/completions", {"prompt": "2+2=", "max_tokens": 2})
        assert code == 503 and "failed, PipelineError: weights rejected by the checker" in err["error"]["message"]

        out, errout = proc.communicate(timeout=120)
        assert proc.returncode == 4, out[-2000:] + errout[-2000:]
        health = json.loads((run_dir / "health.json").read_text())
        assert health["verdict"] == "CRASHED", health
        assert "engine status failed: PipelineError: weights rejected by the checker" in health["reason"]
        assert "CRASHED" in errout or "weights rejected" in errout, errout[-2000:]
        # then the engine exits by itself: exit status 1, the status stays failed
        deadline = time.monotonic() + 30
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid)
        assert (run_dir / "engine.exit").read_text().strip() == "1"
        final = json.loads((run_dir / "status.json").read_text())
        assert final["phase"] == "failed" and final["failed_stage"] == "fail"
        kinds = [json.loads(line)["kind"] for line in (run_dir / "events.jsonl").read_text().splitlines()]
        assert "stage_fail" in kinds and "failed_linger" in kinds and "serve_listening" in kinds
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if pid is not None and alive(pid):
            stop(pid)
