"""load: read the checkpoint into the engine process, with progress (bytes, MB/s, shards, ETA)
on the terminal and in the engine status from the first byte."""
from __future__ import annotations

import time

from kdtree.checkpoint.progress import ProgressReporter
from kdtree.engine import Engine, EngineState
from kdtree.serve.status import make_status  # noqa: F401  (declared: the engine process's status.json)

SIDE = "host"


def progress_sink(ctx):
    """progress(bytes_done, bytes_total, shards_done, shards_total) -> status.json + a terminal line."""
    reporter = None
    if ctx.cfg.load.progress:
        reporter = ProgressReporter(label="load")
    t0 = time.monotonic()

    def progress(bytes_done: int, bytes_total: int, shards_done: int, shards_total: int) -> None:
        elapsed = max(time.monotonic() - t0, 1e-6)
        rate = bytes_done / elapsed                                   # bytes/s
        eta = (bytes_total - bytes_done) / rate if rate > 0 else None
        if ctx.status is not None:
            ctx.status.update(phase="loading", bytes_done=bytes_done, bytes_total=bytes_total,
                              shards_done=shards_done, shards_total=shards_total,
                              rate_mb_s=round(rate / 1e6, 2), eta_s=None if eta is None else round(eta, 1))
        if reporter is not None:
            reporter(bytes_done, bytes_total, shards_done, shards_total)

    return progress


def run(ctx) -> dict:
    engine = Engine.from_config(ctx.cfg, status=ctx.status, progress=progress_sink(ctx))
    EngineState.of(ctx).engine = engine
    r = engine.load_report
    ctx.emit("loaded", checkpoint=r.checkpoint, bytes=r.bytes_read, seconds=round(r.seconds, 3),
             mb_s=round(r.mb_s, 1))
    off = engine.model.off_line_bytes() if hasattr(engine.model, "off_line_bytes") else 0
    if off:
        ctx.emit("weights_off_lines", mb=round(off / 1e6, 1),
                 hint="these weights start off a 64-byte line in the checkpoint's files (safetensors aligns "
                      "nothing): multi-row forwards read them up to 1.3x slower; load.strategy=eager copies them "
                      "onto lines (anonymous memory instead of the page cache)")
    return {"checkpoint": r.checkpoint, "bytes": r.bytes_read, "seconds": r.seconds, "mb_s": r.mb_s}
