"""What a stage receives: the composed config, its run dir, the event sink, and what the stages of one process
share (typed attributes; the pipeline looks inside none of them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional


@dataclass
class StageContext:
    cfg: Any                                  # the composed OmegaConf DictConfig (read-only by convention)
    run_dir: Path                             # Hydra run dir: result.json, events.jsonl, logs, status.json
    emit: Callable[..., None] = lambda kind, **fields: None  # stage events -> console + events.jsonl
    status: Optional[Any] = None              # engine process: the status object a host stage declared
    results: Dict[str, Any] = field(default_factory=dict)   # stage name -> what its run() returned
    engine_process: Optional[Any] = None      # controller: the EngineHandle (pipeline/engine_process.py) of
                                              # this run's engine process, once launched
    shared: Optional[Any] = None              # engine process: what its stages share, typed by them (the
                                              # stages' EngineState); closed (close()) when the process exits
