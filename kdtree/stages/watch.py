"""watch: the cold-start monitor against ANY OpenAI-compatible server (kdtree, SGLang, vLLM) at health.url.

    python -m kdtree.run pipeline=watch health.url=http://127.0.0.1:30001 [host=ct200] [health.pid=1234]
        [health.log=/var/log/sglang.log | health.unit=sglang] [model.path=/ckpt for a bytes ETA]

Probes run on `host` (local by default), so the URL is as seen from that host. Exit 0 on READY; the
stage fails with the verdict otherwise (health.json in the run dir holds every sample).
"""
from __future__ import annotations

from kdtree.errors import ConfigError
from kdtree.hosts import connect
from kdtree.monitor.watcher import Target, history_for, watch

SIDE = "controller"
PARAMS = {}


def run(ctx) -> dict:
    h = ctx.cfg.health
    if not h.url:
        raise ConfigError("health.url is empty; give the server to watch, e.g. health.url=http://127.0.0.1:30001")
    host = connect(ctx.cfg.host)
    target = Target(url=h.url, model=h.model, api_key=h.api_key, pid=int(h.pid), status_path=h.status_path,
                    log=h.log, unit=h.unit, unit_user=h.unit_user, checkpoint=ctx.cfg.model.path)
    try:
        return watch(ctx.cfg, host, target, ctx.run_dir, history_for(ctx.cfg, url=h.url))
    finally:
        host.close()
