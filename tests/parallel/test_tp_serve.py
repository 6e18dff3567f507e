"""The serve pipeline at tp=8 (rank 0 = the engine process, 7 gloo worker processes): `python -m kdtree.run
pipeline=serve tp=8 serve.detach=true` returns READY, /v1/completions answers the same text as a tp=1 engine,
`pipeline=stop` stops it cleanly (exit 0) and no worker is left behind.

Run: .venv/bin/python -m pytest -q tests/parallel/test_tp_serve.py      (~2-3 min on 2 busy cores)
"""
from __future__ import annotations

import json
import os
import signal
import sys
import urllib.request
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kdtree.pipeline.registry import register_schema as register
from kdtree.engine import Engine

REPO = Path(__file__).resolve().parents[2]
register()
sys.path.insert(0, str(REPO / "tests" / "serve"))
from served_engine import TREE, alive, kdtree_run  # noqa: E402  (the serve tests' pipeline helpers)
from tests.procs import wait_gone  # noqa: E402


def worker_pids(engine_pid: int) -> list:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
        if ppid == engine_pid and b"kdtree.parallel.worker" in cmd:
            out.append(int(d.name))
    return sorted(out)


@pytest.mark.slow
def test_serve_pipeline_at_tp8_answers_like_tp1_and_stops_cleanly(tmp_path, kdtree_cache):
    runs = tmp_path / "runs"
    run_dir = runs / "serve"
    r = kdtree_run(["serve.port=0", "serve.detach=true", "health.interval_s=0.5", f"hydra.run.dir={run_dir}",
                    *TREE, "tp=8"], kdtree_cache, runs, timeout=540)
    pid_file = run_dir / "engine.pid"
    pid = int(pid_file.read_text()) if pid_file.exists() else None
    try:
        assert r.returncode == 0, f"kdtree.run exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}"
        workers = worker_pids(pid)
        assert len(workers) == 7
        url = json.loads((run_dir / "status.json").read_text())["url"]
        body = json.dumps({"prompt": "2+2=", "max_tokens": 6, "temperature": 0}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", body, {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            text = json.loads(resp.read())["choices"][0]["text"]
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[f"cache_dir={kdtree_cache}", *TREE])
        assert text == Engine.from_config(cfg).complete("2+2=", 6)[0]

        s = kdtree_run(["pipeline=stop", f"stop.run_dir={run_dir}"], kdtree_cache, runs, timeout=120)
        assert s.returncode == 0, s.stdout[-2000:] + s.stderr[-2000:]
        assert wait_gone([pid, *workers], 30.0) == []
        assert (run_dir / "engine.exit").read_text().strip() == "0"      # drained and exited, not killed
    finally:
        if pid is not None and alive(pid):
            os.killpg(pid, signal.SIGKILL)
