"""Stage registry: a stage named NAME is the module kdtree.stages.NAME.

A stage module defines
    SIDE = "host" | "controller" | "any"      where it may run (host = inside the engine process)
    def run(ctx, **params) -> dict | None       the work; the returned dict lands in the stage_end event
and optionally
    PARAMS = {"name": type, ...}               checked at plan time (int is accepted for float);
                                               required = the run() parameters without a default
    NEEDS_ENGINE = bool | callable(params, cfg) -> bool
                                               a controller stage that watches this run's engine;
                                               the planner requires a host stage before it
    def on_process_start(ctx)                  called in the engine process before its first stage
                                               (serve opens its HTTP port from the first second)
Every stage also accepts `timeout_s` (handled by the runner, never passed to run()).
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
from types import ModuleType
from typing import Dict, List

from kdtree.errors import PipelineError

SIDES = ("host", "controller", "any")
_EXTRA: Dict[str, ModuleType] = {}  # stages registered in-process (plugins, tests)


def register_stage(name: str, module: ModuleType) -> None:
    """Make `module` available as stage `name` in this process (controller-side planning and runs)."""
    _check_module(name, module)
    _EXTRA[name] = module


def unregister_stage(name: str) -> None:
    _EXTRA.pop(name, None)


def known_stages() -> List[str]:
    """Names of every stage: the modules of this package (not starting with _) and registered ones."""
    names = {m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}
    return sorted(names | set(_EXTRA))


def load_stage(name: str) -> ModuleType:
    """The module of stage `name`; a PipelineError listing the known stages if there is none."""
    if name in _EXTRA:
        return _EXTRA[name]
    known = known_stages()
    if name not in known:
        raise PipelineError(f"unknown stage {name!r}; known stages: {', '.join(known)}")
    module = importlib.import_module(f"{__name__}.{name}")
    _check_module(name, module)
    return module


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
