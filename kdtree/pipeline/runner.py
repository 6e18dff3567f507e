"""Run a pipeline: plan it (every check before any work), then its stages, controller and host side.

    run_pipeline(cfg, run_dir) -> exit code     (0 ok, 1 a stage failed, 2 the plan is invalid, 130 Ctrl-C; a failed
                                                 watch/health_poll: its verdict's 3 STALLED, 4 CRASHED, 5 UNREACHABLE,
                                                 6 NOT_OPENAI)

Consecutive `on: host` stages run in ONE engine process launched through the host connection (detached,
run_dir/engine.{pid,log,exit}); controller stages run here. A controller stage that follows a host group
runs while the engine runs (health_poll watches it); with none following, the controller waits for the
engine, tails its log and propagates its failure. After the last stage an engine still running is waited
for (foreground, Ctrl-C stops it) or, when one of its stages declares KEEPS_RUNNING (serve with serve.detach=true)
and the pipeline ends with a controller stage, left running. The runner knows no stage by name: what it needs
from a stage module it reads from the module's declarations (pipeline/registry.py).
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from kdtree.config.secrets import redact, secrets
from kdtree.errors import KdtreeError
from kdtree.hosts import connect
from kdtree.pipeline import engine_process as ep
from kdtree.pipeline import registry
from kdtree.pipeline.context import StageContext
from kdtree.pipeline.events import EVENTS_FILE, EventLog, read_events
from kdtree.pipeline.execute import execute_stage
from kdtree.pipeline.spec import PipelineSpec, StageSpec, load_pipeline

EXIT_OK, EXIT_STAGE_FAILED, EXIT_BAD_PLAN, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL wait for an engine whose stages declare no STOP_GRACE_S


def save_config(cfg, run_dir: Path) -> Path:
    """run_dir/config.yaml: the composed config with interpolations resolved (what the engine process reads)."""
    try:
        text = OmegaConf.to_yaml(cfg, resolve=True)
    except Exception:  # an interpolation to a missing value: keep it unresolved rather than fail here
        text = OmegaConf.to_yaml(cfg, resolve=False)
    path = run_dir / ep.CONFIG
    path.write_text(redact(text, secrets(cfg)))     # the engine reads its key from the environment or a file
    return path


def plan_pipeline(cfg) -> PipelineSpec:
    """The checked spec of cfg.pipeline; raises PipelineError (one line) when it cannot run."""
    return load_pipeline(str(cfg.pipeline), cfg)


def _last_failure(run_dir: Path, where: Optional[str] = None) -> Optional[Dict[str, Any]]:
    fails = [e for e in read_events(run_dir) if e.get("kind") in ("stage_fail", "engine_error")
             and (where is None or e.get("where") == where)]
    return fails[-1] if fails else None


def _fail_line(event: Dict[str, Any], spec: PipelineSpec) -> str:
    if event.get("kind") == "engine_error":
        return f"engine process failed before its stages: {event.get('error_type')}: {event.get('error')}"
    side = event.get("side", "?")
    return (f"pipeline {spec.name}: stage {event.get('stage')!r} (#{event.get('index')}, {side}) failed: "
            f"{event.get('error_type')}: {event.get('error')}")


class _LogFollower(threading.Thread):
    """Prints the engine's log live while controller stages (health_poll) run, so load progress, warm-up and
    the demo appear as they happen. Local hosts only: a remote log is tailed by wait_engine's own polling."""

    def __init__(self, engine: "ep.EngineHandle", out):
        super().__init__(name="engine-log", daemon=True)
        self.engine, self.out, self.halt = engine, out, threading.Event()

    def run(self) -> None:
        while not self.halt.wait(ep.POLL_S):
            try:
                ep.tail_log(self.engine, self.out)
            except OSError:
                return

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=5)


class _Run:
    """One pipeline run: the spec, its context, the events, and the engine process if one was started."""

    def __init__(self, cfg, run_dir: Path, spec: PipelineSpec, events: EventLog, out):
        self.cfg, self.run_dir, self.spec, self.events, self.out = cfg, run_dir, spec, events, out
        self.ctx = StageContext(cfg=cfg, run_dir=run_dir, emit=events.emit)
        self.host = None
        self.engine: Optional[ep.EngineHandle] = None
        self.engine_modules: List[Any] = []  # the stage modules the running engine process runs
        self.follower: Optional[_LogFollower] = None

    def error(self, line: str) -> None:
        print(f"error: {line}", file=sys.stderr, flush=True)

    def declared(self, attr: str) -> List[Any]:
        """What the running engine's stages declare as `attr` (pipeline/registry.py), those that do."""
        values = (registry.declared(m, attr, self.cfg) for m in self.engine_modules)
        return [v for v in values if v is not None]

    def keeps_running(self) -> bool:
        return any(self.declared("KEEPS_RUNNING"))

    def launch(self, stages: List[StageSpec]) -> None:
        if self.host is None:
            self.host = connect(self.cfg.host)
        self.engine = ep.launch_engine(self.host, self.run_dir, stages)
        self.engine_modules = [registry.load_stage(s.stage) for s in stages]
        self.ctx.engine_process = self.engine
        ports = self.declared("PORT")
        port = int(ports[0]) if ports else None
        host_cfg = OmegaConf.to_container(self.cfg.host, resolve=True) if "host" in self.cfg else {"kind": "local"}
        ep.record_engine(self.cfg, self.engine, host_cfg, port)
        self.events.emit("engine_launch", pid=self.engine.pid, host=self.host.label, stages=self.engine.stages,
                         host_run_dir=self.engine.run_dir, log=self.engine.log)
        if self.host.kind == "local":
            self.follower = _LogFollower(self.engine, self.out)
            self.follower.start()

    def stop_following(self) -> None:
        if self.follower is not None:
            self.follower.stop()
            self.follower = None

    def finish_engine(self) -> int:
        """Wait for the engine (tailing its log), fetch its files, and turn its exit into ours."""
        engine = self.engine
        self.stop_following()
        code = ep.wait_engine(engine, tail=True, out=self.out)
        ep.fetch_back(engine)
        self.engine = None
        if code == ep.EXIT_OK:
            return EXIT_OK
        failure = _last_failure(self.run_dir, "engine")
        if code is None:
            self.events.emit("engine_lost", pid=engine.pid, log=engine.log)
            self.error(f"pipeline {self.spec.name}: engine process {engine.pid} on {engine.host.label} ended without "
                       f"an exit status (killed?); see {engine.log}")
        elif failure is not None:
            self.error(_fail_line(failure, self.spec))
        else:
            self.error(f"pipeline {self.spec.name}: engine process exited {code} (stages {','.join(engine.stages)}); "
                       f"see {engine.log}")
        return EXIT_STAGE_FAILED

    def stop_engine(self, why: str, drain: bool = False) -> None:
        """drain: the user stopped a working engine (Ctrl-C, SIGTERM, SIGHUP): wait the grace its stages declare
        (STOP_GRACE_S; serve's covers finishing the accepted requests) before any SIGKILL. After a failure the
        engine is not serving anyone: DEFAULT_STOP_GRACE_S. A host that does not answer gets the exact command to
        stop it later (ep.stop_engine gives up after its grace + 2 s)."""
        self.stop_following()
        if self.engine is None:
            return
        declared = [float(g) for g in self.declared("STOP_GRACE_S")]
        grace = max(declared) if drain and declared else DEFAULT_STOP_GRACE_S
        engine, self.engine = self.engine, None
        try:
            how = ep.stop_engine(engine.host, engine.pid, grace_s=grace)
        except ep.StopUnreachable as e:
            cmd = f"python -m kdtree.run pipeline=stop stop.run_dir={self.run_dir}"
            self.events.emit("engine_stop", pid=engine.pid, why=why, outcome="unreachable", error=str(e), stop=cmd)
            self.error(f"{e}; it may still be running: stop it with `{cmd}`")
            return
        self.events.emit("engine_stop", pid=engine.pid, why=why, outcome=how)
        ep.tail_log(engine, self.out)
        ep.fetch_back(engine)

    def run(self) -> int:
        groups = self.spec.groups()
        for gi, (side, stages) in enumerate(groups):
            if side == "host":
                if self.engine is not None:  # an earlier host group: its process must end first
                    code = self.finish_engine()
                    if code:
                        return code
                self.launch(stages)
                continue
            if not execute_stage(self.ctx, stages[0], self.events):
                failure = _last_failure(self.run_dir, "controller") or {}
                self.error(_fail_line(failure, self.spec))
                # KEEPS_RUNNING (serve.detach=true) leaves a READY engine running; one whose health poll failed
                # is stopped (or the stop command printed, when its host does not answer)
                self.stop_engine(f"stage {stages[0].stage!r} failed")
                return int(failure.get("exit_code") or EXIT_STAGE_FAILED)   # a verdict's: 3/4/5/6 (README)
        if self.engine is None:
            return EXIT_OK
        last_side = groups[-1][0]
        if last_side == "controller" and self.keeps_running():
            if ep.engine_running(self.engine):
                self.stop_following()
                ep.tail_log(self.engine, self.out)
                self.events.emit("engine_detached", pid=self.engine.pid, host=self.engine.host.label,
                                 log=self.engine.log, stop=f"python -m kdtree.run pipeline=stop stop.run_dir={self.run_dir}")
                return EXIT_OK
        return self.finish_engine()


def run_pipeline(cfg, run_dir, out=None) -> int:
    """Plan and run cfg.pipeline in run_dir; the process exit code (0 ok, 1 stage failed, 2 bad plan, 130 Ctrl-C,
    3-6 a monitor verdict)."""
    out = out if out is not None else sys.stdout  # looked up now: tests and callers may have replaced it
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    events = EventLog(run_dir / EVENTS_FILE, where="controller", console=out)
    save_config(cfg, run_dir)
    try:
        spec = plan_pipeline(cfg)
    except KdtreeError as e:
        events.emit("plan_error", error_type=type(e).__name__, error=str(e))
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_PLAN
    (run_dir / ep.PIPELINE).write_text(json.dumps(spec.to_dict(), indent=1, default=str))
    events.emit("pipeline_start", pipeline=spec.name, spec=str(spec.path), run_dir=str(run_dir),
                stages=[f"{s.stage}@{s.on}" for s in spec.stages])
    t0 = time.monotonic()
    run = _Run(cfg, run_dir, spec, events, out)
    try:
        code = run.run()
    except KeyboardInterrupt as e:                  # Ctrl-C, or SIGTERM/SIGHUP (kdtree.run turns them into this)
        events.emit("interrupted", signal=str(e) or "SIGINT")
        run.stop_engine(str(e) or "Ctrl-C", drain=True)
        code = EXIT_INTERRUPTED
    except KdtreeError as e:  # the host could not be reached, the engine could not start, ...
        events.emit("pipeline_error", error_type=type(e).__name__, error=str(e))
        print(f"error: {e}", file=sys.stderr, flush=True)
        run.stop_engine("error")
        code = EXIT_STAGE_FAILED
    finally:
        if run.host is not None and run.engine is None:
            run.host.close()
    events.emit("pipeline_end", pipeline=spec.name, code=code, seconds=round(time.monotonic() - t0, 3))
    return code
