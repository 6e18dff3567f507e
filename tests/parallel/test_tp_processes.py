"""Tensor-parallel worker processes never outlive rank 0: SIGTERM / SIGKILL of the engine process (rank 0 alone,
not its group) leaves no worker; workers share the engine's process group (killpg stops all); a dead worker
makes the next forward fail fast with a TPError naming it, and close() still cleans up.

Run: .venv/bin/python -m pytest -q tests/parallel/test_tp_processes.py      (~1-2 min on 2 busy cores)
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from kdtree.pipeline.registry import register_schema as register
from tests.procs import alive, wait_gone
from kdtree.engine import Engine
from kdtree.parallel.model import TPError

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"
register()

ENGINE_SCRIPT = f"""
import sys, time
from hydra import compose, initialize_config_dir
from kdtree.pipeline.registry import register_schema as register
from kdtree.engine import Engine
register()
with initialize_config_dir(config_dir={str(CONF)!r}, version_base="1.3"):
    cfg = compose(config_name="config", overrides=sys.argv[1:])
engine = Engine.from_config(cfg)
print("READY", *[w.proc.pid for w in engine.model.workers], flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("sig,tp", [(signal.SIGTERM, 2), (signal.SIGKILL, 4)], ids=["sigterm-tp2", "sigkill-tp4"])
def test_workers_die_with_rank0(tmp_path, sig, tp):
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, f"cache_dir={tmp_path}", f"tp='{tp}'", "tree=ar"],
                            stdout=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True)
    pids = []
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 240)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("READY"), f"engine did not start within 240 s (exit {proc.poll()})"
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == tp - 1 and all(alive(p) for p in pids)
        assert {os.getpgid(p) for p in pids} == {os.getpgid(proc.pid)}   # killpg of the engine reaches them
        os.kill(proc.pid, sig)                                            # rank 0 only
        proc.wait(timeout=30)
        assert wait_gone(pids) == [], f"workers {pids} outlived rank 0 ({signal.Signals(sig).name})"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)                           # never leave anything behind
        proc.wait(timeout=30)
        proc.stdout.close()


def test_a_dead_worker_fails_the_next_forward_fast_and_close_still_cleans_up(tmp_path):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"cache_dir={tmp_path}", "tp='2'", "tree=ar"])
    engine = Engine.from_config(cfg)
    pids = [w.proc.pid for w in engine.model.workers]
    try:
        os.kill(pids[0], signal.SIGKILL)
        assert wait_gone(pids, 10.0) == []
        ids = np.asarray(engine.tokenizer.encode("2+2="), np.int32)
        t0 = time.monotonic()
        with pytest.raises(TPError, match=r"tp=2.*rank 1"):
            engine.model.forward(ids, np.arange(len(ids), dtype=np.int32), engine.model.new_cache(8))
        assert time.monotonic() - t0 < 30                # not the 300 s collective timeout
        with pytest.raises(TPError, match="restart the engine"):
            engine.generate(list(ids), 2)
    finally:
        engine.close()
    assert wait_gone(pids) == []
    engine2 = Engine.from_config(cfg)                    # the process left the group: a new engine can start
    engine2.close()
