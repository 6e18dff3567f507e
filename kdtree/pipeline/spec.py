"""Pipeline specs: pipelines/NAME.yaml (or a user's YAML) -> a checked PipelineSpec, before any work.

    name: serve
    stages:
      - {stage: bench,       on: host, params: {repeats: 1}}
      - {stage: health_poll, on: controller, params: {timeout_s: 900}}

A stage's params are its config section cfg.<stage> (the stage module's CONFIG dataclass, pipeline/registry.py);
`params:` in the YAML are explicit per-pipeline overrides of it, checked against the same dataclass, and may
interpolate the composed config (resolved by OmegaConf against it). `timeout_s` is accepted by
every stage and enforced by the runner. Every check fails with one line naming the pipeline, the stage,
the value and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import kdtree
from kdtree.pipeline import registry as stage_registry
from kdtree.config.validate import read_yaml
from kdtree.errors import ConfigError, PipelineError

SIDES = ("host", "controller")
STAGE_KEYS = ("stage", "on", "params", "when")


def repo_root() -> Path:
    """The directory holding kdtree/, conf/ and pipelines/ (found from the package location)."""
    return Path(kdtree.__file__).resolve().parent.parent


def pipelines_dir() -> Path:
    return repo_root() / "pipelines"


def available_pipelines() -> List[str]:
    return sorted(p.stem for p in pipelines_dir().glob("*.yaml"))


def pipeline_path(name_or_path: str) -> Path:
    """`serve` -> <repo>/pipelines/serve.yaml; a path to a YAML file is taken as it is."""
    s = str(name_or_path)
    if s.endswith((".yaml", ".yml")) or "/" in s:
        p = Path(s).expanduser()
        if not p.is_file():
            raise PipelineError(f"pipeline={s}: no such file; give an existing YAML path or one of "
                                f"{', '.join(available_pipelines())}")
        return p.resolve()
    p = pipelines_dir() / f"{s}.yaml"
    if not p.is_file():
        raise PipelineError(f"pipeline={s}: unknown pipeline; known pipelines: {', '.join(available_pipelines())} "
                            f"(or give a path to a YAML file)")
    return p


@dataclass
class StageSpec:
    stage: str                       # stage name (pipeline/registry.py: module kdtree.stages.<stage>)
    on: str                          # "host" | "controller"
    index: int                       # position in the pipeline (0-based)
    params: Dict[str, Any] = field(default_factory=dict)   # resolved, without timeout_s
    timeout_s: Optional[float] = None

    def label(self) -> str:
        return f"#{self.index} {self.stage!r} ({self.on})"

    def to_dict(self) -> Dict[str, Any]:
        return {"stage": self.stage, "on": self.on, "index": self.index, "params": self.params,
                "timeout_s": self.timeout_s}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "StageSpec":
        return cls(stage=d["stage"], on=d["on"], index=d["index"], params=dict(d.get("params") or {}),
                   timeout_s=d.get("timeout_s"))


@dataclass
class PipelineSpec:
    name: str
    path: Path
    stages: List[StageSpec]

    def groups(self) -> List[Tuple[str, List[StageSpec]]]:
        """Consecutive host stages form one group (one engine process); each controller stage is its own."""
        out: List[Tuple[str, List[StageSpec]]] = []
        for s in self.stages:
            if s.on == "host" and out and out[-1][0] == "host":
                out[-1][1].append(s)
            else:
                out.append((s.on, [s]))
        return out

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "path": str(self.path), "stages": [s.to_dict() for s in self.stages]}


def _read_yaml(path: Path, where: str) -> Any:
    try:
        return read_yaml(path)                         # one message for a YAML syntax error: FILE:LINE:COL
    except ConfigError as e:
        raise PipelineError(str(e)) from None


def load_pipeline(name_or_path: str, cfg: DictConfig) -> PipelineSpec:
    """Read, resolve and check a pipeline against the composed config; raise PipelineError on the first problem."""
    path = pipeline_path(name_or_path)
    where = f"pipeline {path}"
    doc = _read_yaml(path, where)
    if not isinstance(doc, dict) or not isinstance(doc.get("stages"), list) or not doc["stages"]:
        raise PipelineError(f"{where}: expected a mapping with `name:` and a non-empty `stages:` list")
    unknown_top = sorted(set(map(str, doc)) - {"name", "stages", "description"})
    if unknown_top:
        raise PipelineError(f"{where}: unknown key(s) {', '.join(unknown_top)}; allowed: name, stages, description")
    name = str(doc.get("name") or path.stem)
    where = f"pipeline {name} ({path})"
    kept = [entry for entry in doc["stages"] if _wanted(entry, cfg, where)]   # index = position in the resolved list
    specs = [_check_stage(entry, i, cfg, where) for i, entry in enumerate(kept)]
    if not specs:
        raise PipelineError(f"{where}: no stage is left for this config (every stage's `when:` excludes it)")
    _check_order(specs, cfg, where)
    return PipelineSpec(name=name, path=path, stages=specs)


def _wanted(entry: Any, cfg: DictConfig, where: str) -> bool:
    """A stage's `when: {config.key: value | [values]}`: kept iff every key's composed value is (one of) those."""
    cond = entry.get("when") if isinstance(entry, dict) else None
    if cond is None:
        return True
    if not isinstance(cond, dict) or not cond:
        raise PipelineError(f"{where}: stage {entry.get('stage')!r} has when={cond!r}; write when: {{config.key: value}}")
    for key, want in cond.items():
        got = OmegaConf.select(cfg, str(key), default="<unset>")
        if got == "<unset>":
            raise PipelineError(f"{where}: stage {entry.get('stage')!r}: when: names {key!r}, not a config key")
        if got not in (list(want) if isinstance(want, (list, tuple)) else [want]):
            return False
    return True


def _check_stage(entry: Any, index: int, cfg: DictConfig, where: str) -> StageSpec:
    if isinstance(entry, str):
        entry = {"stage": entry}
    if not isinstance(entry, dict) or "stage" not in entry:
        raise PipelineError(f"{where}: stage #{index} is {entry!r}; write it as {{stage: NAME, on: host|controller}}")
    entry = {("on" if k is True else str(k)): v for k, v in entry.items()}  # YAML 1.1 reads `on:` as True
    extra = sorted(set(entry) - set(STAGE_KEYS))
    name = str(entry["stage"])
    if extra:
        raise PipelineError(f"{where}: stage #{index} {name!r} has unknown key(s) {', '.join(extra)}; "
                            f"allowed: {', '.join(STAGE_KEYS)}")
    try:
        module = stage_registry.load_stage(name)
    except PipelineError as e:
        raise PipelineError(f"{where}: stage #{index}: {e}") from None
    side = getattr(module, "SIDE")
    on = entry.get("on") or (side if side != "any" else "controller")
    if on not in SIDES:
        raise PipelineError(f"{where}: stage #{index} {name!r} has on={on!r}; use on: host or on: controller")
    if side != "any" and on != side:
        raise PipelineError(f"{where}: stage #{index} {name!r} runs on the {side} side only, got on: {on}; "
                            f"write on: {side}")
    label = f"{where}: stage #{index} {name!r}"
    params = _resolve_params(entry.get("params") or {}, cfg, label)
    timeout_s = params.pop("timeout_s", None)
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or timeout_s <= 0):
        raise PipelineError(f"{label}: timeout_s={timeout_s!r}; give a positive number of seconds or leave it out")
    params = stage_registry.section_params(name, module, cfg, params, label)
    return StageSpec(stage=name, on=on, index=index, params=params,
                     timeout_s=float(timeout_s) if timeout_s is not None else None)


def _resolve_params(raw: Any, cfg: DictConfig, label: str) -> Dict[str, Any]:
    if not isinstance(raw, dict):
        raise PipelineError(f"{label}: params is {raw!r}; write params as a mapping name: value")
    out: Dict[str, Any] = {}
    for key, value in raw.items():
        try:
            node = OmegaConf.create({"v": value}, parent=cfg)  # interpolations resolve against the composed cfg
            out[str(key)] = OmegaConf.to_container(node, resolve=True)["v"]
        except OmegaConfBaseException as e:
            reason = str(e).splitlines()[0]
            raise PipelineError(f"{label}: parameter {key}={value!r} cannot be resolved: {reason}; "
                                f"set the config key on the command line (key=value)") from None
    return out


def _needs_engine(module: Any, params: Dict[str, Any], cfg: DictConfig) -> bool:
    flag = getattr(module, "NEEDS_ENGINE", False)
    return bool(flag(params, cfg)) if callable(flag) else bool(flag)


def _check_order(specs: List[StageSpec], cfg: DictConfig, where: str) -> None:
    """A controller stage that watches this run's engine must come after a host stage (which starts it)."""
    seen_host = False
    for s in specs:
        if s.on == "host":
            seen_host = True
            continue
        module = stage_registry.load_stage(s.stage)
        if not seen_host and _needs_engine(module, s.params, cfg):
            raise PipelineError(f"{where}: stage #{s.index} {s.stage!r} (controller) watches this run's engine "
                                f"but no host stage runs before it; move it after the host stages or give it "
                                f"a url to watch")
