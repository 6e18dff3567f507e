"""launch: serve the composed config with another engine (engine=sglang | vllm | llamacpp) from the engine process.

    python -m kdtree.run engine=sglang model=k26 model.path=/models/Kimi-K2.6 tp=8 quant=int4_w4a16
    python -m kdtree.run engine=llamacpp tree=ar serve.port=30002 serve.detach=true     # the exported tiny GGUF
    python -m kdtree.run pipeline=stop serve.port=30002

The serve pipeline runs this stage instead of load/warmup/serve when engine != kdtree. It starts the command line
kdtree/engines builds from the config (`pipeline=plan engine=...` prints it) as a child of the engine process: the
same process group (pipeline=stop's SIGTERM reaches both), the same log (engine.log), the same supervisor (nohup,
or the transient systemd unit of host.supervisor=systemd, whose journal then holds the server's log), the same
host (local, or remote over fabric). health_poll watches it with the generic evidence it uses for any server (its
process tree's reads, its log, the disk, the checkpoint's size for the ETA, the completion probe): there is no
kdtree status.json for another engine. The stage returns when the server exits (non-zero: the stage fails, with the
code); SIGTERM stops the server (SIGTERM, wait, SIGKILL) and ends the stage.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from kdtree.config.secrets import api_key
from kdtree.engines import command_line, launch_env, printable
from kdtree.errors import PipelineError
from kdtree.pipeline.engine_process import EngineTerminated

SIDE = "host"
TERM_GRACE_S = 30.0              # SIGTERM to SIGKILL of the launched server when the stage is stopped


def KEEPS_RUNNING(cfg) -> bool:  # serve.detach=true: the pipeline returns, the server keeps serving
    return bool(cfg.serve.detach)


def STOP_GRACE_S(cfg) -> float:
    return TERM_GRACE_S + float(cfg.stop.timeout_s)


def PORT(cfg) -> int:            # recorded in the engine registry: `pipeline=stop serve.port=N` finds it
    return int(cfg.serve.port)


def _gguf(ctx) -> str:
    """engine=llamacpp without engine.gguf: the model's GGUF, exported once into <cache_dir>/gguf and reused while
    the checkpoint, its config and the writer hold (export_gguf.cached_export; a K2-shaped export is 1-6 GB)."""
    from kdtree.stages.export_gguf import cached_export
    return cached_export(ctx)["path"]


def _stop(proc: subprocess.Popen, grace_s: float = TERM_GRACE_S) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def run(ctx) -> dict:
    cfg = ctx.cfg
    name = str(cfg.engine.name)
    if name == "kdtree":
        raise PipelineError("stage launch: engine=kdtree serves through the load/warmup/serve stages; use "
                            "engine=sglang, vllm or llamacpp with this stage")
    if name == "llamacpp" and not cfg.engine.gguf:
        cfg.engine.gguf = _gguf(ctx)
    if not cfg.model.path:                     # the embedded tiny checkpoint (generated on first use)
        from kdtree.engine import resolve_checkpoint
        cfg.model.path = str(resolve_checkpoint(cfg))
    key = api_key(cfg.serve)
    argv = command_line(cfg, key if name == "sglang" else "")
    env = {**os.environ, **launch_env(cfg, key)}
    shown = printable(argv, key)
    ctx.emit("engine_command", engine=name, command=shown, port=int(cfg.serve.port))
    print(f"launch engine={name}: {shown}", flush=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, env=env, cwd=str(Path(ctx.run_dir)))   # stdout/stderr: engine.log
    except OSError as e:
        raise PipelineError(f"engine={name}: cannot start {argv[0]!r} ({e.strerror}); set engine.python (or "
                            f"engine.command) to the {name} installation on this host") from None
    try:
        code = proc.wait()
    except BaseException as e:                 # the server never outlives the stage
        code = _stop(proc)
        seconds = round(time.monotonic() - t0, 3)
        ctx.emit("engine_stopped", engine=name, pid=proc.pid, code=code, seconds=seconds)
        if isinstance(e, (EngineTerminated, KeyboardInterrupt)):   # SIGTERM (pipeline=stop, a bench's end) or
            return {"engine": name, "pid": proc.pid, "code": code, "seconds": seconds, "stopped": True}  # Ctrl-C
        raise
    seconds = round(time.monotonic() - t0, 3)
    ctx.emit("engine_exit", engine=name, pid=proc.pid, code=code, seconds=seconds)
    if code != 0:
        raise PipelineError(f"engine={name} (pid {proc.pid}) exited with code {code} after {seconds} s; its output "
                            f"is in the engine log above ({shown[:120]})")
    return {"engine": name, "pid": proc.pid, "code": code, "seconds": seconds}
