"""What a stage receives: the composed config, its run dir, shared state and the event sink."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional


@dataclass
class StageContext:
    cfg: Any                                  # the composed OmegaConf DictConfig (read-only by convention)
    run_dir: Path                             # Hydra run dir: result.json, events.jsonl, logs, status.json
    state: Dict[str, Any] = field(default_factory=dict)   # shared by stages of one process ("engine", ...)
    emit: Callable[..., None] = lambda kind, **fields: None  # stage events -> console + events.jsonl
    status: Optional[Any] = None              # the engine's StatusFile in host processes, else None
