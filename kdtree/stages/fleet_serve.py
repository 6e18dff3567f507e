"""fleet_serve: every replica of fleet.hosts started in parallel (each the serve pipeline on its host, serve.port + i),
watched together (one line per replica per sample, then the fleet summary), and sglang-router in front of the ready
ones on fleet.router_port. Fails when a replica does not become READY (the router still serves the others).

    python -m kdtree.run pipeline=fleet_serve 'fleet.hosts=[local,local,local]' serve.port=31000 fleet.router_port=30000
"""
from __future__ import annotations

import threading
from pathlib import Path

from kdtree import fleet as F
from kdtree.errors import PipelineError

SIDE = "controller"


def run(ctx) -> dict:
    cfg, run_dir = ctx.cfg, Path(ctx.run_dir)
    replicas = F.plan_replicas(cfg, run_dir)
    board = F.Board(replicas)
    overrides = F.user_overrides(run_dir)
    codes = {}

    def one(r):
        codes[r.index] = F.serve_replica(r, overrides, board.line)
        r.verdict = "READY" if codes[r.index] == 0 else (r.verdict if r.verdict != "READY" else "CRASHED")

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ready = [r for r in replicas if codes.get(r.index) == 0]
    print(f"[fleet] {board.summary()}", flush=True)
    if not ready:
        raise PipelineError(f"fleet_serve: no replica became READY ({board.summary()}); see {run_dir}/replica-*")
    pid = F.start_router(cfg, run_dir, [r.url(cfg) for r in ready])
    F.save(cfg, F.Fleet(int(cfg.fleet.router_port), pid, replicas))
    for r in ready:
        F.wait_worker(cfg, r.url(cfg), True)
    print(f"[fleet] router (sglang-router, pid {pid}) at {F.router_url(cfg)}/v1 -> {len(ready)} worker(s); stop with "
          f"pipeline=fleet_stop fleet.router_port={cfg.fleet.router_port}", flush=True)
    ctx.emit("fleet_ready", router=F.router_url(cfg), router_pid=pid, ready=len(ready), replicas=len(replicas))
    if len(ready) < len(replicas):
        raise PipelineError(f"fleet_serve: {len(replicas) - len(ready)} replica(s) did not become READY "
                            f"({board.summary()}); the router serves the {len(ready)} that did")
    return {"router": F.router_url(cfg), "router_pid": pid, "ready": len(ready), "replicas": len(replicas)}
