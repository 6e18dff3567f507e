"""watch: the cold-start monitor against ANY OpenAI-compatible server (kdtree, SGLang, vLLM) at health.url.

    python -m kdtree.run pipeline=watch health.url=http://127.0.0.1:30001 [host=ct200] [health.pid=1234]
        [health.log=/var/log/sglang.log | health.unit=sglang] [health.disk=nvme0n1]
        [model.path=/ckpt | health.expected_bytes=N for a bytes ETA]
        [KDTREE_API_KEY=<key> in the environment | health.api_key_file=<file>: a keyed server's Bearer key]

Evidence is scoped to the server: the process tree of health.pid (or the unit's MainPID), reads of health.disk,
its log. With only a URL nothing else on the machine can hide a hang: nothing listening for the stall window is
UNREACHABLE.

Probes run on `host` (local by default), so the URL is as seen from that host. Exit 0 on READY; the
stage fails with the verdict otherwise (health.json in the run dir holds every sample).
"""
from __future__ import annotations

from kdtree.config.secrets import api_key
from kdtree.errors import ConfigError
from kdtree.hosts import connect
from kdtree.monitor.watcher import Target, history_for, watch

SIDE = "controller"


def run(ctx) -> dict:
    h = ctx.cfg.health
    if not h.url:   # also checked before the run (kdtree/config/validate.py); kept for direct callers
        raise ConfigError("health.url is empty; give the server to watch, e.g. health.url=http://127.0.0.1:30001")
    host = connect(ctx.cfg.host)
    target = Target(url=h.url, model=h.model, api_key=api_key(h, "health"), pid=int(h.pid),
                    pid_source="health.pid" if int(h.pid) and not h.get("pid_ran", False) else "", status_path=h.status_path,
                    log=h.log, unit=h.unit, unit_user=h.unit_user, checkpoint=ctx.cfg.model.path,
                    expected_bytes=int(h.expected_bytes), disk=h.disk)
    try:
        return watch(ctx.cfg, host, target, ctx.run_dir, history_for(ctx.cfg, url=h.url))
    finally:
        host.close()
