"""serve: the HTTP server of the engine process. Its port opens at process start (status only, completions
503) so a ten-minute cold start is observable from its first second; `run` attaches the loaded engine,
marks it ready and serves until SIGTERM/SIGINT, then drains (finishes accepted requests) and returns.
"""
from __future__ import annotations

import gc
import signal
import threading
import time

from kdtree.config.secrets import api_key
from kdtree.engine import EngineState
from kdtree.errors import PipelineError
from kdtree.serve.app import ServeApp
from kdtree.serve.sd_notify import SdNotifier
from kdtree.serve.status import StatusFile, make_status

SIDE = "host"
FAILED_LINGER_S = 5.0            # a failed engine with its port open answers /health 503 + the error this long


def KEEPS_RUNNING(cfg) -> bool:  # serve.detach=true: the pipeline returns, the server keeps serving
    return bool(cfg.serve.detach)


def STOP_GRACE_S(cfg) -> float:  # SIGTERM drains accepted requests (serve.drain_timeout_s), then exits
    return float(cfg.serve.drain_timeout_s) + float(cfg.stop.timeout_s)


def PORT(cfg) -> int:            # recorded in the engine registry: `pipeline=stop serve.port=N` finds it
    return int(cfg.serve.port)


def _status(ctx) -> StatusFile:
    if ctx.status is None:
        ctx.status = make_status(ctx.run_dir)
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
                   max_connections=s.max_connections, keepalive_s=s.keepalive_s,
                   max_connections_per_client=s.max_connections_per_client,
                   request_read_timeout_s=s.request_read_timeout_s,
                   tool_call_parser=s.get("tool_call_parser", "kimi_k2"),
                   reasoning_parser=s.get("reasoning_parser", "auto")).start()
    EngineState.of(ctx).server = app
    ctx.emit("serve_listening", url=app.url, phase=status.phase)
    return app


def on_process_failed(ctx) -> None:
    """Keep an open port answering 'failed' (status, /health 503) for FAILED_LINGER_S, so a load balancer or
    the monitor polling it reads the error, not just a refused connection; a SIGTERM ends the wait."""
    app = EngineState.of(ctx).server
    if app is None or not app.listening or FAILED_LINGER_S <= 0:
        return
    ctx.emit("failed_linger", url=app.url, seconds=FAILED_LINGER_S)
    deadline = time.monotonic() + FAILED_LINGER_S
    while time.monotonic() < deadline:
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def _serving_threads(ctx) -> int:
    """backend=cpu: the native forward's threads while serving (backend.threads, or auto: one core fewer than a
    batch process takes, left to the HTTP front end). 0 for other backends."""
    if str(ctx.cfg.backend.name) != "cpu":
        return 0
    from kdtree.backends.native import auto_threads, load_library
    lib = load_library("cpu", str(ctx.cfg.backend.library or ""))       # the engine's (cached per path)
    return lib.set_threads(auto_threads(ctx.cfg.backend, int(ctx.cfg.tp.size), serving=True))


def run(ctx) -> dict:
    state = EngineState.of(ctx)
    app = state.server or on_process_start(ctx)
    engine = state.engine
    if engine is None:
        raise PipelineError("stage serve: no engine in this process; put `{stage: load, on: host}` before serve")
    threads = _serving_threads(ctx)
    app.attach(engine)
    # what is loaded by now (the engine, its modules, the configs: hundreds of thousands of objects) lives as long
    # as the process: frozen out of the collector's sight, so that a full collection (a connect flood's allocations
    # set one off) walks only what came after, not the whole heap (~250 ms of a stalled event loop per flood)
    gc.collect()
    gc.freeze()
    app.mark_ready()
    ctx.emit("ready", url=app.url, model=app.model_name, **({"threads": threads} if threads else {}))
    print(f"serving {app.model_name} at {app.url}/v1 (completions, chat/completions; SIGTERM or Ctrl-C to stop)"
          + (f"; native forward on {threads} thread(s) (backend.threads)" if threads else ""), flush=True)

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
