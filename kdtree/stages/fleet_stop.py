"""fleet_stop: every replica of the fleet behind fleet.router_port stopped (pipeline=stop of each run: SIGTERM, it
drains, then SIGKILL after the grace), then its sglang-router.

    python -m kdtree.run pipeline=fleet_stop fleet.router_port=30000
"""
from __future__ import annotations

import threading

from kdtree import fleet as F

SIDE = "controller"


def run(ctx) -> dict:
    cfg = ctx.cfg
    fl = F.load(cfg)
    board = F.Board(fl.replicas)
    codes = {}

    def one(r):
        codes[r.index] = F.stop_replica(r, board.line)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in fl.replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    router = F.stop_router(fl.router_pid)
    print(f"[fleet] {len(fl.replicas)} replica(s) stopped; router pid {fl.router_pid}: {router}", flush=True)
    F.record_path(cfg).unlink(missing_ok=True)
    return {"replicas": len(fl.replicas), "router": router, "codes": codes}
