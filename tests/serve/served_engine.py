"""A real engine process serving the tiny model, started through the real pipeline (`python -m kdtree.run`
serve.detach=true returns once health_poll says READY). The `served` fixture (tests/serve/conftest.py)
shares one per test module."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.procs import alive  # noqa: F401  (re-exported: the serve tests import it from here)

REPO = Path(__file__).resolve().parents[2]
# ddtree with a small tree: real speculative decoding, ~20 ms per verify round on the tiny model
TREE = ["tree=ddtree", "tree.budget=4", "tree.depth=3", "tree.width=2"]


@dataclass
class Served:
    url: str
    run_dir: Path
    pid: int
    stdout: str

    def status(self) -> dict:
        return json.loads((self.run_dir / "status.json").read_text())


def kdtree_run(args, cache: Path, runs: Path, timeout: float = 120, extra_env=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, KDTREE_CACHE=str(cache), KDTREE_RUNS=str(runs), **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "kdtree.run", "load.progress=false", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def stop(pid: int, sig=signal.SIGTERM, timeout: float = 30.0) -> bool:
    """Signal the engine and wait until it is gone; True when it went away by itself."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return False


def start_served(tmp_path_factory, cache: Path, *overrides: str, extra_env=None) -> Served:
    runs = tmp_path_factory.mktemp("runs")
    run_dir = runs / "serve"
    r = kdtree_run(["serve.port=0", "serve.detach=true", "health.interval_s=0.5", f"hydra.run.dir={run_dir}",
                    *TREE, *overrides], cache, runs, extra_env=extra_env)
    pid_file = run_dir / "engine.pid"
    if r.returncode != 0:
        if pid_file.exists():
            stop(int(pid_file.read_text()), signal.SIGKILL)
        pytest.fail(f"kdtree.run exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}")
    status = json.loads((run_dir / "status.json").read_text())
    return Served(status["url"], run_dir, int(pid_file.read_text()), r.stdout)
