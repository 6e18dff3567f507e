"""health_poll: watch this run's engine from the controller until it answers a completion (READY) or the
evidence says STALLED / CRASHED / UNREACHABLE (the stage fails with the verdict; health.json has the timeline).

Probes run through the same host connection that launched the engine, against its pid, log and
status.json, and `POST /v1/completions` on serve.host:serve.port as seen from that host.
"""
from __future__ import annotations

from kdtree.config.secrets import api_key
from kdtree.errors import ConfigError
from kdtree.hosts import connect
from kdtree.monitor.watcher import Target, history_for, watch

SIDE = "controller"
NEEDS_ENGINE = True


def _engine_key(serve_cfg) -> str:
    """The key this run's engine checks, when the controller can read it (env, or a key file here too)."""
    try:
        return api_key(serve_cfg)
    except ConfigError:                       # the file is on the engine's host only: probes see 401 = answering
        return ""


def engine_target(cfg, pid: int, run_dir: str, log: str) -> Target:
    """The engine process (pid, its run dir on its host, its log) as the monitor's target."""
    s, h = cfg.serve, cfg.health
    bind = "127.0.0.1" if s.host in ("0.0.0.0", "", "::") else s.host
    url = h.url or (f"http://{bind}:{s.port}" if int(s.port) else "")   # port 0: the status says which
    return Target(url=url, model=h.model or s.model_name or cfg.model.name, api_key=api_key(h, "health") or _engine_key(s),
                  pid=int(h.pid or pid or 0), pid_source="health.pid" if int(h.pid) else "",
                  status_path=f"{run_dir}/status.json",
                  log=h.log or log, unit=h.unit, unit_user=h.unit_user, disk=h.disk,
                  expected_bytes=int(h.expected_bytes))


def run(ctx) -> dict:
    engine = ctx.engine_process   # this run's engine process (EngineHandle), launched by the runner
    if engine is not None:
        host, target = engine.host, engine_target(ctx.cfg, engine.pid, engine.run_dir, engine.log)
    else:
        host, target = connect(ctx.cfg.host), engine_target(ctx.cfg, 0, str(ctx.run_dir), "")
    return watch(ctx.cfg, host, target, ctx.run_dir, history_for(ctx.cfg))
