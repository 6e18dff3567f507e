"""Run one stage in this process: its timeout, and its stage_start / stage_end / stage_fail events.
Used by the runner (controller stages) and the engine process (host stages)."""
from __future__ import annotations

import signal
import threading
import time
from typing import Callable, Optional

from kdtree.errors import PipelineError
from kdtree.pipeline import registry
from kdtree.pipeline.context import StageContext
from kdtree.pipeline.events import EventLog
from kdtree.pipeline.spec import StageSpec

HARD_TIMEOUT_GRACE_S = 10.0  # engine only: a stage stuck in C code past timeout_s + this ends the process


class StageTimeout(PipelineError):
    """A stage ran past its timeout_s."""


def execute_stage(ctx: StageContext, spec: StageSpec, events: EventLog,
                  hard_exit: Optional[Callable[[], None]] = None) -> bool:
    """Run one stage in this process with its timeout; record start/end/fail events. True when it ended.
    hard_exit (engine process): called, and expected to end the process, when the stage is still running
    HARD_TIMEOUT_GRACE_S after its timeout (blocked in C code, where the alarm cannot interrupt it)."""
    module = registry.load_stage(spec.stage)
    base = dict(stage=spec.stage, index=spec.index)
    ctx.emit = lambda kind, **f: events.emit(kind, **{**base, **f})
    events.emit("stage_start", side=spec.on, params=spec.params, timeout_s=spec.timeout_s, **base)
    t0 = time.monotonic()
    in_main = threading.current_thread() is threading.main_thread()
    old_handler, watchdog = None, None
    if spec.timeout_s and in_main:
        def on_alarm(signum, frame):
            raise StageTimeout(f"stage {spec.stage!r} exceeded timeout_s={spec.timeout_s:g}")
        old_handler = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, spec.timeout_s)
    if spec.timeout_s and hard_exit is not None:
        def hard():  # the alarm could not interrupt the stage: leave a record, then end the process
            events.emit("stage_fail", side=spec.on, seconds=round(time.monotonic() - t0, 3),
                        error_type="StageTimeout", error=f"stage {spec.stage!r} exceeded timeout_s={spec.timeout_s:g} "
                        f"and did not stop within {HARD_TIMEOUT_GRACE_S:g} s", **base)
            hard_exit()
        watchdog = threading.Timer(spec.timeout_s + HARD_TIMEOUT_GRACE_S, hard)
        watchdog.daemon = True
        watchdog.start()
    try:
        result = registry.call_stage(module, ctx, spec.params)
    except Exception as e:
        seconds = round(time.monotonic() - t0, 3)
        _disarm(old_handler, in_main and bool(spec.timeout_s), watchdog)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        code = getattr(e, "exit_code", None)       # a monitor verdict's own exit code (watcher.HealthError)
        extra = {"exit_code": code} if isinstance(code, int) and 0 < code < 126 else {}
        events.emit("stage_fail", side=spec.on, seconds=seconds, error_type=type(e).__name__, error=msg, **extra,
                    **base)
        return False
    finally:
        _disarm(old_handler, in_main and bool(spec.timeout_s), watchdog)
    seconds = round(time.monotonic() - t0, 3)
    if result is not None:
        ctx.results[spec.stage] = result
    events.emit("stage_end", side=spec.on, seconds=seconds, result=result, **base)
    return True


def _disarm(old_handler, had_alarm: bool, watchdog) -> None:
    if had_alarm:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if old_handler is not None:
            signal.signal(signal.SIGALRM, old_handler)
    if watchdog is not None:
        watchdog.cancel()
