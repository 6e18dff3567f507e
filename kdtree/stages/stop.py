"""stop: stop the engine process of a run — SIGTERM its process group, wait for its drain (drain_s: the
engine finishes the requests it accepted, refusing new ones with 503) plus grace_s, then SIGKILL. Prints
how many requests the drain finished and how many it cut (from the engine's status.json).

    python -m kdtree.run pipeline=stop stop.run_dir=runs/2026-11-30/08-00-00-serve
    python -m kdtree.run pipeline=stop serve.port=30001      # the most recent engine serving on that port

The engine is found in the registry of launched engines (<cache_dir>/engines.jsonl, written by the runner),
which also says through which host it was launched, so a remote engine is stopped through the same host
connection. The run's files are left as they are (an engine_stop event is appended to its events.jsonl).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict

from omegaconf import OmegaConf

from kdtree.config.paths import cache_dir
from kdtree.errors import PipelineError
from kdtree.hosts import connect
from kdtree.pipeline import engine_process as ep
from kdtree.pipeline.events import EVENTS_FILE, EventLog

SIDE = "controller"


@dataclass
class StopConfig:
    run_dir: str = ""  # the run whose engine to stop; empty = the most recent engine serving on serve.port
    timeout_s: float = 10.0  # SIGTERM, wait serve.drain_timeout_s + this long (the drain, then the exit), then SIGKILL


CONFIG = StopConfig  # cfg.stop: this stage's options (kdtree/pipeline/registry.py)


def _entry_for_run_dir(cfg, run_dir: Path) -> Dict[str, Any]:
    entries = [e for e in ep.registry_entries(cfg) if Path(e.get("run_dir", "")).resolve() == run_dir]
    if entries:
        return entries[-1]
    pidfile, config = run_dir / ep.PIDFILE, run_dir / ep.CONFIG
    if not pidfile.exists():
        raise PipelineError(f"stop.run_dir={run_dir}: no engine.pid there and no entry in "
                            f"{cache_dir(cfg) / ep.REGISTRY}; give the run dir of a pipeline that started an engine")
    host = OmegaConf.to_container(OmegaConf.load(config).host) if config.exists() else {"kind": "local"}
    return {"run_dir": str(run_dir), "host_run_dir": str(run_dir), "pid": int(pidfile.read_text().strip()),
            "host": host}


def _entry_for_port(cfg, port: int) -> Dict[str, Any]:
    entries = [e for e in ep.registry_entries(cfg) if e.get("port") == port]
    for e in reversed(entries):  # most recent first; skip engines that already ended
        host = connect(e.get("host") or {"kind": "local"})
        try:
            if host.is_alive(int(e["pid"])):
                return e
        finally:
            host.close()
    raise PipelineError(f"serve.port={port}: no running engine of {len(entries)} launched on that port in "
                        f"{cache_dir(cfg) / ep.REGISTRY}; give stop.run_dir=<the run dir>")


def _drain_report(host, entry: Dict[str, Any]) -> Dict[str, Any]:
    """drained/cut as the engine wrote them into its status.json when it stopped ({} when it did not)."""
    raw = host.read_file(f"{entry.get('host_run_dir') or entry['run_dir']}/status.json")
    try:
        snap = json.loads(raw.decode()) if raw else {}
    except ValueError:
        return {}
    return {k: snap[k] for k in ("drained", "cut") if k in snap} if snap.get("phase") == "stopped" else {}


def run(ctx, conf: StopConfig) -> dict:
    run_dir, grace_s = conf.run_dir, conf.timeout_s
    port, drain_s = int(ctx.cfg.serve.port), float(ctx.cfg.serve.drain_timeout_s)  # the engine's serve section
    if run_dir:
        entry = _entry_for_run_dir(ctx.cfg, Path(run_dir).expanduser().resolve())
    elif port:
        entry = _entry_for_port(ctx.cfg, int(port))
    else:
        raise PipelineError("stop: nothing to stop; give stop.run_dir=<run dir> or serve.port=<port>")
    host = connect(entry.get("host") or {"kind": "local"})
    pid = int(entry["pid"])
    try:
        result = ep.stop_engine(host, pid, grace_s=float(drain_s) + float(grace_s))
        report = _drain_report(host, entry) if result == "terminated" else {}
    finally:
        host.close()
    target = Path(entry["run_dir"])
    drained = (f"; drained {report['drained']} request(s), cut {report['cut']}" if "drained" in report else "")
    print(f"stop: engine {pid} of {target} on {host.label}: {result}{drained}", flush=True)
    if (target / EVENTS_FILE).exists() and target.resolve() != Path(ctx.run_dir).resolve():
        EventLog(target / EVENTS_FILE, where="stop", console=None).emit(
            "engine_stop", pid=pid, outcome=result, by=str(ctx.run_dir), **report)
    return {"run_dir": str(target), "pid": pid, "host": host.label, "result": result, **report}
