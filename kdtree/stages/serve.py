"""serve: the HTTP server of the engine process. Its port opens at process start (status only, completions
503) so a ten-minute cold start is observable from its first second; `run` attaches the loaded engine,
marks it ready and serves until SIGTERM/SIGINT, then drains (finishes accepted requests) and returns.
"""
from __future__ import annotations

import signal
import threading

from kdtree.config.secrets import api_key
from kdtree.errors import PipelineError
from kdtree.serve.app import ServeApp
from kdtree.serve.sd_notify import SdNotifier
from kdtree.serve.status import StatusFile

SIDE = "host"
PARAMS = {}


def _status(ctx) -> StatusFile:
    if ctx.status is None:
        ctx.status = StatusFile(ctx.run_dir / "status.json")
    return ctx.status


def on_process_start(ctx) -> ServeApp:
    """Open the port before the load: /health, /ready, /status and /metrics answer; completions 503."""
    status = _status(ctx)
    notifier = SdNotifier(extend_s=max(60.0, 2 * float(ctx.cfg.health.stall_window_s)))
    if notifier.enabled:
        status.subscribe(notifier.on_status)
        notifier.on_status(status.snapshot())
    s = ctx.cfg.serve
    app = ServeApp(status, host=s.host, port=s.port, model_name=s.model_name or ctx.cfg.model.name,
                   api_key=api_key(s), max_queue=s.max_queue, cors_origins=tuple(s.get("cors_origins") or ()),
                   max_body_bytes=s.max_body_bytes, max_header_bytes=s.max_header_bytes,
                   max_connections=s.max_connections, keepalive_s=s.keepalive_s).start()
    ctx.state["serve_app"] = app
    ctx.emit("serve_listening", url=app.url, phase=status.phase)
    return app


def run(ctx) -> dict:
    app = ctx.state.get("serve_app") or on_process_start(ctx)
    engine = ctx.state.get("model_engine")
    if engine is None:
        raise PipelineError("stage serve: no engine in this process; put `{stage: load, on: host}` before serve")
    app.attach(engine)
    app.mark_ready()
    ctx.emit("ready", url=app.url, model=app.model_name)
    print(f"serving {app.model_name} at {app.url}/v1 (completions, chat/completions; SIGTERM or Ctrl-C to stop)",
          flush=True)

    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda signum, frame: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    ctx.emit("draining", url=app.url, queue_depth=app.worker.depth, in_flight=app.worker.in_flight)
    outcome = app.drain(float(ctx.cfg.serve.drain_timeout_s))
    m = app.metrics
    print(f"drained {outcome['drained']} request(s), cut {outcome['cut']}", flush=True)
    ctx.emit("stopped", completions=m.completions, generated_tokens=m.generated_tokens, **outcome)
    return {"url": app.url, "completions": m.completions, "generated_tokens": m.generated_tokens, **outcome}
