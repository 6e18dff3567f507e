"""fleet_status: the fleet behind fleet.router_port as it is now -- every replica watched once more with its own
evidence (its engine's pid, status.json and log, the completion probe; in parallel), one line per replica per
sample, the fleet summary (N ready / loading / stalled / crashed), and what the router thinks of each worker
(healthy or not; a dead replica's worker goes unhealthy within fleet.health_interval_s x the router's failure
threshold and gets no requests). Fails when a replica is not READY, naming it and its evidence.

    python -m kdtree.run pipeline=fleet_status 'fleet.hosts=[local,local,local]' serve.port=31000 \
        fleet.router_port=30000
"""
from __future__ import annotations

import threading
from pathlib import Path

from kdtree import fleet as F
from kdtree.errors import PipelineError

SIDE = "controller"


def run(ctx) -> dict:
    cfg, run_dir = ctx.cfg, Path(ctx.run_dir)
    fl = F.load(cfg)
    board = F.Board(fl.replicas)
    overrides = F.user_overrides(run_dir)

    def one(r):
        F.status_replica(r, r.url(cfg), overrides, run_dir, board.line)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in fl.replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        health = {w.get("url"): bool(w.get("is_healthy", True)) for w in F.workers(cfg)}
    except (OSError, ValueError) as e:
        health = {}
        print(f"[fleet] router at {F.router_url(cfg)} does not answer ({e})", flush=True)
    for r in fl.replicas:
        seen = health.get(r.url(cfg))
        state = "absent" if seen is None else ("healthy" if seen else "unhealthy: gets no requests")
        print(f"[fleet] replica {r.index} {r.host}:{r.port}: {r.verdict}; router worker {r.url(cfg)} {state}"
              + ("" if r.verdict == "READY" else f"; evidence: {r.evidence or r.last.strip()}"), flush=True)
    print(f"[fleet] {board.summary()}", flush=True)
    bad = [r for r in fl.replicas if r.verdict != "READY"]
    if bad:
        raise PipelineError(f"fleet_status: {board.summary()}: " + "; ".join(
            f"replica {r.index} ({r.host}:{r.port}) {r.verdict}: {r.evidence or r.last.strip()}" for r in bad))
    return {"summary": board.summary(), "router_healthy": sum(health.values())}
