"""The engine process: runs a group of consecutive `on: host` stages, detached, on the target host.

    python -m kdtree.pipeline.engine_process --run-dir D --stages load,warmup,serve [--at 0]

reads D/config.yaml (the resolved config) and D/pipeline.json (the resolved stages), creates the status
object the first of its stages declares (make_status: D/status.json), calls every stage module's
on_process_start(ctx) hook, runs the stages in order sharing ctx.shared, closes ctx.shared, and writes its
exit status to D/engine.exit (0 = every stage ended, 1 = a stage failed, 143 = stopped by SIGTERM).

When a stage (or a hook, or the process setup) fails, the status says phase "failed" with the error
("<type>: <message>", error_type, failed_stage) before the process exits, so /status, /health (503) and the
monitor report why; then the stages' on_process_failed(ctx) hooks run (serve keeps its open port answering
that for a few seconds; a SIGTERM ends the wait).

Also the controller-side helpers for such a process: launch (`launch_engine`), wait (`wait_engine`),
stop (`stop_engine`), and the registry of launched engines (`<cache_dir>/engines.jsonl`) that
`pipeline=stop` reads.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import OmegaConf

from kdtree.config.paths import cache_dir
from kdtree.errors import HostError, PipelineError
from kdtree.hosts.base import ALIVE_SH
from kdtree.pipeline import registry
from kdtree.pipeline.context import StageContext
from kdtree.pipeline.events import EVENTS_FILE, EventLog, read_jsonl
from kdtree.pipeline.execute import execute_stage
from kdtree.pipeline.spec import StageSpec, repo_root

PIDFILE, LOGFILE, EXITFILE, CONFIG, PIPELINE = "engine.pid", "engine.log", "engine.exit", "config.yaml", "pipeline.json"
EXIT_OK, EXIT_FAILED, EXIT_TERMINATED = 0, 1, 143
POLL_S = 0.5  # controller poll period while an engine runs (liveness, exit file, log tail)


# ----------------------------------------------------------------------------------------------
# The engine process itself
# ----------------------------------------------------------------------------------------------
class EngineTerminated(BaseException):
    """SIGTERM in the engine: unwinds the running stage (its finally blocks run) like Ctrl-C would."""


def _write_exit(run_dir: Path, code: int) -> None:
    tmp = run_dir / f".{EXITFILE}.{os.getpid()}"
    tmp.write_text(f"{code}\n")
    os.replace(tmp, run_dir / EXITFILE)


def _make_status(run_dir: Path, modules) -> Any:
    """The status object of the first stage module that declares make_status(run_dir), else None."""
    for module in modules:
        make = getattr(module, "make_status", None)
        if make is not None:
            return make(run_dir)
    return None


class _FailureRecorder:
    """The EventLog, remembering the last stage_fail it wrote (the error the status reports)."""

    def __init__(self, log):
        self._log, self.last_fail = log, None

    def emit(self, kind: str, **fields):
        if kind == "stage_fail":
            self.last_fail = fields
        return self._log.emit(kind, **fields)

    def __getattr__(self, name):
        return getattr(self._log, name)


def _mark_failed(status, error_type: str, error: str, stage: Optional[str] = None) -> None:
    """status.json -> phase failed with the error; never raises (the failure itself is what matters)."""
    if status is None:
        return
    try:
        status.update(phase="failed", error=f"{error_type}: {error}", error_type=error_type, failed_stage=stage)
    except Exception:
        pass


def _on_failed(ctx, modules, events) -> None:
    """The stages' on_process_failed(ctx) hooks (after the status says failed); SIGTERM ends them early."""
    for module in modules:
        hook = getattr(module, "on_process_failed", None)
        if hook is None or ctx is None:
            continue
        try:
            hook(ctx)
        except EngineTerminated:
            return
        except Exception as e:  # exiting anyway: the failure already recorded is what matters
            events.emit("hook_error", hook="on_process_failed", error_type=type(e).__name__, error=str(e))


def engine_main(run_dir: Path, stage_names: List[str], at: int) -> int:
    run_dir = Path(run_dir).resolve()
    events = _FailureRecorder(EventLog(run_dir / EVENTS_FILE, where="engine", console=sys.stdout))
    code = EXIT_FAILED
    ctx = None
    modules: List[Any] = []

    # The signal lands wherever the engine is: inside a library (OmegaConf loading the config, a stage's own code) the
    # EngineTerminated it raises can be caught and come out as another error. `terminated` remembers the signal, so
    # such an error still ends the engine as terminated (143), not as failed (1).
    terminated: List[str] = []

    def on_term(signum, frame):
        terminated.append(signal.Signals(signum).name)
        raise EngineTerminated(terminated[0])

    signal.signal(signal.SIGTERM, on_term)
    try:
        events.emit("engine_start", stages=stage_names, host=socket.gethostname(),
                    ssh=os.environ.get("SSH_CONNECTION", ""), python=sys.executable)
        modules = [registry.load_stage(name) for name in stage_names]
        cfg = OmegaConf.load(run_dir / CONFIG)
        doc = json.loads((run_dir / PIPELINE).read_text())
        specs = [StageSpec.from_dict(d) for d in doc["stages"][at:at + len(stage_names)]]
        if [s.stage for s in specs] != stage_names or any(s.on != "host" for s in specs):
            raise PipelineError(f"--stages {','.join(stage_names)} --at {at} does not match the host stages of "
                                f"{run_dir / PIPELINE}; relaunch through kdtree.run")
        ctx = StageContext(cfg=cfg, run_dir=run_dir, emit=events.emit, status=_make_status(run_dir, modules))
        for spec, module in zip(specs, modules):
            hook = getattr(module, "on_process_start", None)
            if hook is not None:
                try:
                    hook(ctx)
                except Exception as e:
                    if terminated:
                        raise EngineTerminated(terminated[0]) from e
                    events.emit("stage_fail", stage=spec.stage, index=spec.index, side="host", seconds=0.0,
                                error_type=type(e).__name__, error=f"on_process_start: {e}")
                    _mark_failed(ctx.status, type(e).__name__, f"on_process_start: {e}", spec.stage)
                    _on_failed(ctx, modules, events)
                    _close_shared(ctx)
                    return _finish(run_dir, events, EXIT_FAILED)
        code = EXIT_OK

        def hard_exit():  # a stage stuck past its timeout: the process ends at once, the status says why
            f = events.last_fail or {}
            _mark_failed(ctx.status, f.get("error_type", "StageTimeout"), f.get("error", ""), f.get("stage"))
            _write_exit(run_dir, EXIT_FAILED)
            os._exit(EXIT_FAILED)

        for spec in specs:
            if not execute_stage(ctx, spec, events, hard_exit=hard_exit):
                if terminated:  # the stage's failure is the signal, turned into another error on its way out
                    raise EngineTerminated(terminated[0])
                code = EXIT_FAILED
                f = events.last_fail or {}
                _mark_failed(ctx.status, f.get("error_type", "Error"), f.get("error", f"stage {spec.stage!r} failed"),
                             spec.stage)
                _on_failed(ctx, modules, events)
                break
    except EngineTerminated as e:
        events.emit("engine_terminated", signal=str(e))
        code = EXIT_TERMINATED
    except Exception as e:  # config/pipeline files unreadable: still leave an exit status behind
        if terminated:  # the signal, turned into another error by the code it interrupted
            events.emit("engine_terminated", signal=terminated[0])
            code = EXIT_TERMINATED
        else:
            events.emit("engine_error", error_type=type(e).__name__, error=str(e))
            _mark_failed(ctx.status if ctx is not None else _make_status_quietly(run_dir, modules),
                         type(e).__name__, str(e))
            code = EXIT_FAILED
    _close_shared(ctx)
    return _finish(run_dir, events, code)


def _close_shared(ctx) -> None:
    """Close what the stages share (the model engine: its tensor-parallel ranks) before exiting."""
    close = getattr(ctx.shared, "close", None) if ctx is not None else None
    if close is not None:
        try:
            close()
        except Exception as e:  # exiting anyway; the ranks also die with this process
            print(f"engine close failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def _make_status_quietly(run_dir: Path, modules) -> Any:
    try:
        return _make_status(run_dir, modules)
    except Exception:
        return None


def _finish(run_dir: Path, events, code: int) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _write_exit(run_dir, code)
    events.emit("engine_exit", code=code)
    return code


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kdtree.pipeline.engine_process", description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--stages", required=True, help="comma-separated stage names (consecutive host stages)")
    ap.add_argument("--at", type=int, default=0, help="index of the first of them in pipeline.json")
    a = ap.parse_args(argv)
    return engine_main(Path(a.run_dir), [s for s in a.stages.split(",") if s], a.at)


# ----------------------------------------------------------------------------------------------
# Controller side: launch, wait, stop
# ----------------------------------------------------------------------------------------------
@dataclass
class EngineHandle:
    host: Any                   # kdtree.hosts.Host
    pid: int
    run_dir: str                # the run dir on the host
    local_run_dir: Path         # the run dir of the controller
    shared_fs: bool             # True when both are the same directory (local host, or ssh to this machine)
    stages: List[str] = field(default_factory=list)
    log_offset: int = 0

    @property
    def log(self) -> str:
        return f"{self.run_dir}/{LOGFILE}"



def _host_run_dir(host, local_run_dir: Path) -> (str, bool):
    """Where the engine's run dir lives on `host`, and whether it is the controller's own directory."""
    if host.kind == "local":
        return str(local_run_dir), True
    marker = local_run_dir / f".controller-{uuid.uuid4().hex[:12]}"
    marker.write_text("")
    try:
        if host.exists(str(marker)):  # ssh to this very machine (tests) or a shared filesystem
            return str(local_run_dir), True
    finally:
        marker.unlink(missing_ok=True)
    base = host.workdir or host.shell('printf %s "$HOME"').stdout.strip() or "/tmp"
    return f"{base}/kdtree-runs/{local_run_dir.parent.name}/{local_run_dir.name}", False


SECRET_ENV = ("KDTREE_API_KEY",)  # passed on stdin at launch, never as `env K=V` on a command line


def _engine_env(host) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith("KDTREE_") and k not in SECRET_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    if host.kind == "local":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root()), os.environ.get("PYTHONPATH", "")) if p)
    return env


def launch_engine(host, local_run_dir: Path, stages: List[Any]) -> EngineHandle:
    """Start the engine process for `stages` (StageSpecs, consecutive, on: host) through `host`, detached."""
    local_run_dir = Path(local_run_dir)
    rdir, shared = _host_run_dir(host, local_run_dir)
    if not shared:
        host.mkdir(rdir)
        for name in (CONFIG, PIPELINE):
            host.put(str(local_run_dir / name), f"{rdir}/{name}")
    else:
        for name in (EXITFILE, PIDFILE):
            (local_run_dir / name).unlink(missing_ok=True)  # a second host group reuses the run dir
    names = [s.stage for s in stages]
    argv = [host.python, "-m", "kdtree.pipeline.engine_process", "--run-dir", rdir,
            "--stages", ",".join(names), "--at", str(stages[0].index)]
    cwd = host.workdir or (os.getcwd() if host.kind == "local" else None)
    pid = host.start_detached(argv, log=f"{rdir}/{LOGFILE}", pidfile=f"{rdir}/{PIDFILE}", cwd=cwd,
                              env=_engine_env(host), unit=f"{local_run_dir.name}-{stages[0].index}",
                              secret_env={k: os.environ[k] for k in SECRET_ENV if os.environ.get(k)})
    return EngineHandle(host=host, pid=pid, run_dir=rdir, local_run_dir=local_run_dir, shared_fs=shared,
                        stages=names)


def read_exit(engine: EngineHandle) -> Optional[int]:
    raw = engine.host.read_file(f"{engine.run_dir}/{EXITFILE}").decode(errors="replace").strip()
    return int(raw) if raw.lstrip("-").isdigit() else None


def engine_running(engine: EngineHandle) -> bool:
    return read_exit(engine) is None and engine.host.is_alive(engine.pid)


def tail_log(engine: EngineHandle, out=None) -> None:
    """Print what the engine wrote to its log since the last call."""
    chunk = engine.host.read_file(engine.log, engine.log_offset)
    if chunk:
        engine.log_offset += len(chunk)
        out = out if out is not None else sys.stdout
        out.write(chunk.decode(errors="replace"))
        out.flush()


def poll_engine(engine: EngineHandle, tail: bool = True) -> Tuple[bool, Optional[int], bytes]:
    """(alive, exit code or None, new log bytes) — one round trip on an ssh host, no process on a local one."""
    host = engine.host
    if host.kind == "local":
        chunk = host.read_file(engine.log, engine.log_offset) if tail else b""
        return host.is_alive(engine.pid), read_exit(engine), chunk
    q = shlex.quote
    script = (f"if ( {ALIVE_SH.format(pid=int(engine.pid))} ); then a=1; else a=0; fi; "
              f"e=$(cat {q(engine.run_dir + '/' + EXITFILE)} 2>/dev/null); printf '%s %s\\n' \"$a\" \"${{e:--}}\"; "
              + (f"tail -c +{engine.log_offset + 1} {q(engine.log)} 2>/dev/null; " if tail else "") + "true")
    out = host.shell(script).stdout
    head, _, rest = out.partition("\n")
    alive, _, code = head.partition(" ")
    return alive == "1", int(code) if code.lstrip("-").isdigit() else None, rest.encode()


def wait_engine(engine: EngineHandle, tail: bool = True, out=None, timeout_s: Optional[float] = None) -> Optional[int]:
    """Wait until the engine exits (tailing its log); its exit code, or None if it died without one."""
    out = out if out is not None else sys.stdout
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        alive, code, chunk = poll_engine(engine, tail)
        if chunk:
            engine.log_offset += len(chunk)
            out.write(chunk.decode(errors="replace"))
            out.flush()
        if code is not None or not alive or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(POLL_S)
    if code is None and not alive:  # it wrote engine.exit just before ending: read once more
        code = read_exit(engine)
    if tail:
        time.sleep(0.05)
        tail_log(engine, out)
    return code


class StopUnreachable(PipelineError):
    """The engine's host did not answer while stopping it: it may still run (the message says how to stop it)."""


def stop_engine(host, pid: int, grace_s: float = 10.0, poll_s: float = 0.2) -> str:
    """SIGTERM the engine's process group, wait up to grace_s, then SIGKILL it: 'not running'|'terminated'|'killed'.

    Every host command shares one budget (grace_s + 2 s for the SIGKILL): over a dead transport this gives up
    with StopUnreachable after that long instead of waiting a command timeout per call."""
    give_up_at = time.monotonic() + max(0.0, grace_s) + 2.0

    def budget() -> float:     # seconds the next host command may take (>= 0.5 s so a live host can answer)
        return max(0.5, min(host.command_timeout_s, give_up_at - time.monotonic()))

    try:
        if not host.is_alive(pid, timeout=budget()):
            return "not running"
        host.signal(pid, signal.SIGTERM, group=True, timeout=budget())
        deadline = time.monotonic() + max(0.0, grace_s)
        while time.monotonic() < deadline:
            if not host.is_alive(pid, timeout=budget()):
                return "terminated"
            time.sleep(poll_s)
        host.signal(pid, signal.SIGKILL, group=True, timeout=budget())
        for _ in range(50):  # bounded: SIGKILL cannot be refused; only the reaping can lag
            if not host.is_alive(pid, timeout=budget()) or time.monotonic() > give_up_at:
                break
            time.sleep(0.1)
    except HostError as e:
        raise StopUnreachable(f"could not stop engine pid {pid} on {host.label}: {e}") from None
    return "killed"


def fetch_back(engine: EngineHandle) -> None:
    """Copy the engine's files to the controller's run dir when they are not the same directory."""
    if engine.shared_fs:
        return
    r = engine.host.run(["ls", "-1", engine.run_dir])
    for name in r.stdout.split():
        if name in (CONFIG, PIPELINE) or name.startswith("."):
            continue
        if name == EVENTS_FILE:  # the engine's events join the controller's file (lines, O_APPEND)
            data = engine.host.read_file(f"{engine.run_dir}/{name}")
            fd = os.open(engine.local_run_dir / EVENTS_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            continue
        try:
            engine.host.get(f"{engine.run_dir}/{name}", str(engine.local_run_dir / name))
        except Exception:
            pass  # a directory or a file that vanished: the engine's run dir keeps it


# ----------------------------------------------------------------------------------------------
# Registry of launched engines: <cache_dir>/engines.jsonl (one JSON line per launch)
# ----------------------------------------------------------------------------------------------
REGISTRY = "engines.jsonl"


def record_engine(cfg, engine: EngineHandle, host_cfg: Dict[str, Any], port: Optional[int]) -> None:
    """Append this engine to the registry so `pipeline=stop` finds it by run dir or serve port."""
    d = cache_dir(cfg)
    d.mkdir(parents=True, exist_ok=True)
    entry = {"t": round(time.time(), 3), "run_dir": str(engine.local_run_dir), "host_run_dir": engine.run_dir,
             "pid": engine.pid, "port": port, "host": host_cfg, "stages": engine.stages}
    fd = os.open(d / REGISTRY, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    finally:
        os.close(fd)


def registry_entries(cfg) -> List[Dict[str, Any]]:
    return read_jsonl(cache_dir(cfg) / REGISTRY)


if __name__ == "__main__":     # run as the package's module, so stages catching EngineTerminated catch this one
    from kdtree.pipeline import engine_process
    sys.exit(engine_process.main())
