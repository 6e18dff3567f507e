"""Stage registry: a stage named NAME is the module kdtree.stages.NAME, or a module registered under NAME.

A stage module defines
    SIDE = "host" | "controller" | "any"      where it may run (host = inside the engine process)
    def run(ctx[, conf]) -> dict | None         the work; the returned dict lands in the stage_end event
and optionally
    CONFIG = a dataclass                       the stage's config section, cfg.<stage name> (bench -> cfg.bench):
                                               the ONE home of its options and their defaults. register_schema()
                                               adds it to the root schema (so `bench.repeats=5` is typed and
                                               `bench.repeat=5` fails at compose time); at plan time the runner
                                               merges the pipeline YAML's `params:` (explicit per-pipeline
                                               overrides) over cfg.<name>, checked against the dataclass, and
                                               run() gets the result as `conf`, a CONFIG instance. A stage
                                               without CONFIG takes no params and is called run(ctx). Options
                                               of other sections (serve.port, load.*) are read from ctx.cfg;
                                               sections that library packages read too (load, serve, health,
                                               sampling) are declared in kdtree/config/schema.py, not by a stage.
                                               register_schema() imports every stage module (kdtree.config cannot
                                               import kdtree.stages: stages import config).
and (a value, or a function of the composed config `cfg` evaluated when the pipeline needs it)
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

import dataclasses
import importlib
import importlib.util
import os
import pkgutil
from types import ModuleType
from typing import Any, Dict, List, Union

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kdtree.config import schema
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
        raise PipelineError(f"stage module {name!r} has no run(ctx[, conf]) function; define one")
    conf = getattr(module, "CONFIG", None)
    if conf is not None and not dataclasses.is_dataclass(conf):
        raise PipelineError(f"stage module {name!r} has CONFIG={conf!r}; make CONFIG a dataclass (its config section)")


def stage_sections() -> Dict[str, type]:
    """stage name -> CONFIG of every known stage that declares one (imports every stage module)."""
    return {name: module.CONFIG for name in known_stages()
            if getattr(module := load_stage(name), "CONFIG", None) is not None}


def register_schema() -> None:
    """Register the root config schema, the stage sections included, in Hydra's ConfigStore (before compose)."""
    schema.register(stage_sections())


def section_params(name: str, module: ModuleType, cfg: Any, overrides: Dict[str, Any], label: str) -> Dict[str, Any]:
    """The resolved section of stage `name`: cfg.<name> (or CONFIG's defaults when the composed config has no such
    section) with the pipeline's `params:` overrides merged over it, checked against CONFIG. {} without CONFIG."""
    conf = getattr(module, "CONFIG", None)
    known = [f.name for f in dataclasses.fields(conf)] if conf is not None else []
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise PipelineError(f"{label}: unknown parameter(s) {', '.join(unknown)}; known: "
                            f"{', '.join(sorted(known) + ['timeout_s'])}")
    if conf is None:
        return {}
    node = OmegaConf.structured(conf)
    if cfg is not None and name in cfg:
        node = OmegaConf.merge(node, cfg[name])
    for key, value in overrides.items():
        try:
            node[key] = value
        except OmegaConfBaseException:
            typ = next(f.type for f in dataclasses.fields(conf) if f.name == key)
            raise PipelineError(f"{label}: parameter {key}={value!r} is {type(value).__name__}, expected "
                                f"{getattr(typ, '__name__', typ)}; fix the value (or the config key it "
                                f"interpolates)") from None
    missing = sorted(OmegaConf.missing_keys(node))
    if missing:
        raise PipelineError(f"{label}: missing parameter(s) {', '.join(missing)}; add them under params: or set "
                            f"{', '.join(f'{name}.{k}' for k in missing)} on the command line")
    return OmegaConf.to_container(node, resolve=True)


def call_stage(module: ModuleType, ctx: Any, params: Dict[str, Any]) -> Any:
    """run(ctx, conf) with conf the CONFIG instance of `params` (section_params' dict); run(ctx) without CONFIG."""
    conf = getattr(module, "CONFIG", None)
    if conf is None:
        return module.run(ctx)
    return module.run(ctx, OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(conf), params)))
