"""fleet_restart: a rolling restart of the fleet behind fleet.router_port, one replica at a time: out of the router,
drained and stopped (pipeline=stop: accepted requests finish), started again (the serve pipeline), watched to READY,
back into the router. Never fewer than N-1 replicas serve; a replica that does not come back stops the roll and says
why (the others keep serving).

    python -m kdtree.run pipeline=fleet_restart 'fleet.hosts=[local,local,local]' serve.port=31000 fleet.router_port=30000
"""
from __future__ import annotations

import time
from pathlib import Path

from kdtree import fleet as F
from kdtree.errors import PipelineError

SIDE = "controller"


def run(ctx) -> dict:
    cfg, run_dir = ctx.cfg, Path(ctx.run_dir)
    fl = F.load(cfg)
    board = F.Board(fl.replicas)
    overrides = F.user_overrides(run_dir)
    done = []
    for r in fl.replicas:
        url, t0 = r.url(cfg), time.monotonic()
        F.set_worker(cfg, url, False)                       # nothing new goes to it
        F.wait_worker(cfg, url, False)
        F.stop_replica(r, board.line)                       # its accepted requests finish (drain), then it exits
        r.run_dir = str(run_dir / f"replica-{r.index}")
        r.verdict = "STARTING"
        code = F.serve_replica(r, overrides, board.line)
        F.save(cfg, fl)
        if code != 0:
            raise PipelineError(f"fleet_restart: replica {r.index} ({r.host}:{r.port}) did not come back (exit {code}, "
                                f"last: {r.last!r}); the roll stopped after {len(done)} of {len(fl.replicas)}; the "
                                f"router serves the others; see {r.run_dir}")
        F.set_worker(cfg, url, True)
        F.wait_worker(cfg, url, True)
        seconds = round(time.monotonic() - t0, 2)
        done.append(seconds)
        print(f"[fleet] replica {r.index} restarted in {seconds} s and back in the router; {board.summary()}", flush=True)
        ctx.emit("replica_restarted", replica=r.index, port=r.port, seconds=seconds)
    return {"restarted": len(done), "seconds": done}
