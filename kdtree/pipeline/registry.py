"""Stage registry: a stage named NAME is the module kdtree.stages.NAME, or a module registered under NAME.

A stage module defines
    SIDE = "host" | "controller" | "any"      where it may run (host = inside the engine process)
    def run(ctx, **params) -> dict | None       the work; the returned dict lands in the stage_end event
and optionally (a value, or a function of the composed config `cfg` evaluated when the pipeline needs it)
    PARAMS = {"name": type, ...}               checked at plan time (int is accepted for float);
                                               required = the run() parameters without a default
    NEEDS_ENGINE = bool | f(params, cfg)       a controller stage that watches this run's engine;
                                               the planner requires a host stage before it
    KEEPS_RUNNING = bool | f(cfg)              (host) the engine process running this stage may outlive the
                                               pipeline: after a last controller stage it is left running
                                               (detached), and a failing controller stage does not stop it
    STOP_GRACE_S = float | f(cfg)              (host) seconds between SIGTERM and SIGKILL when the runner stops
                                               the engine process running this stage (default 10)
    PORT = int | f(cfg)                        (host) the TCP port the engine process serves while this stage
                                               runs, recorded in the engine registry (`pipeline=stop` by port)
    def make_status(run_dir)                   (host) the engine's status object (.update(**fields)) that the
                                               engine process creates at start and hands to every stage as
                                               ctx.status; the first host stage declaring it wins
    def on_process_start(ctx)                  called in the engine process before its first stage
                                               (serve opens its HTTP port from the first second)
    def on_process_failed(ctx)                 called in the engine process after a stage failed and the status
                                               says so, before the process exits (serve keeps answering it)
Every stage also accepts `timeout_s` (handled by the runner, never passed to run()).

Stages registered by module path (`register_stage("fail", "tests.pipeline.fail_stage")`) are also known to
the processes this one starts (the engine process, through any host): the registration travels in the
KDTREE_STAGES environment variable (name=module,...), which the runner forwards.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pkgutil
from types import ModuleType
from typing import Any, Dict, List, Union

from kdtree.errors import PipelineError

SIDES = ("host", "controller", "any")
STAGES_PACKAGE = "kdtree.stages"
ENV = "KDTREE_STAGES"
_EXTRA: Dict[str, ModuleType] = {}  # stages registered in-process as module objects (tests, plugins)


def _env_stages() -> Dict[str, str]:
    pairs = (p.partition("=") for p in os.environ.get(ENV, "").split(",") if p.strip())
    return {name.strip(): module.strip() for name, _, module in pairs}


def _set_env_stages(entries: Dict[str, str]) -> None:
    if entries:
        os.environ[ENV] = ",".join(f"{k}={v}" for k, v in sorted(entries.items()))
    else:
        os.environ.pop(ENV, None)


def register_stage(name: str, module: Union[ModuleType, str]) -> None:
    """Make `module` available as stage `name`: a module object (this process only) or a dotted module path
    (this process and the processes it starts)."""
    if isinstance(module, str):
        _check_module(name, importlib.import_module(module))
        _set_env_stages({**_env_stages(), name: module})
        return
    _check_module(name, module)
    _EXTRA[name] = module


def unregister_stage(name: str) -> None:
    _EXTRA.pop(name, None)
    entries = _env_stages()
    if entries.pop(name, None) is not None:
        _set_env_stages(entries)


def _package_stages() -> List[str]:
    spec = importlib.util.find_spec(STAGES_PACKAGE)
    paths = list(spec.submodule_search_locations or []) if spec is not None else []
    return [m.name for m in pkgutil.iter_modules(paths) if not m.name.startswith("_")]


def known_stages() -> List[str]:
    """Names of every stage: the modules of kdtree/stages (not starting with _) and registered ones."""
    return sorted(set(_package_stages()) | set(_EXTRA) | set(_env_stages()))


def load_stage(name: str) -> ModuleType:
    """The module of stage `name`; a PipelineError listing the known stages if there is none."""
    if name in _EXTRA:
        return _EXTRA[name]
    registered = _env_stages()
    if name in registered:
        module = importlib.import_module(registered[name])
    elif name in _package_stages():
        module = importlib.import_module(f"{STAGES_PACKAGE}.{name}")
    else:
        raise PipelineError(f"unknown stage {name!r}; known stages: {', '.join(known_stages())}")
    _check_module(name, module)
    return module


def declared(module: ModuleType, attr: str, cfg: Any, default: Any = None) -> Any:
    """What `module` declares as `attr` for this config: the value, or the function's answer f(cfg)."""
    value = getattr(module, attr, default)
    return value(cfg) if callable(value) else value


def _check_module(name: str, module: ModuleType) -> None:
    side = getattr(module, "SIDE", None)
    if side not in SIDES:
        raise PipelineError(f"stage module {name!r} has SIDE={side!r}; set SIDE to one of {', '.join(SIDES)}")
    if not callable(getattr(module, "run", None)):
        raise PipelineError(f"stage module {name!r} has no run(ctx, **params) function; define one")


def stage_params(module: ModuleType) -> Dict[str, object]:
    """name -> default (inspect.Parameter.empty when required) of the parameters run() takes after ctx."""
    sig = inspect.signature(module.run)
    out: Dict[str, object] = {}
    for i, (pname, p) in enumerate(sig.parameters.items()):
        if i == 0 or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        out[pname] = p.default
    return out


def accepts_any_params(module: ModuleType) -> bool:
    """True when run() takes **kwargs and the module declares no PARAMS: no unknown-parameter check."""
    if getattr(module, "PARAMS", None) is not None:
        return False
    return any(p.kind == p.VAR_KEYWORD for p in inspect.signature(module.run).parameters.values())
