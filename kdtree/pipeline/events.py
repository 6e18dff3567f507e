"""Pipeline events: one JSON object per line in run_dir/events.jsonl, and one readable line on the console.

The controller and the engine process append to the same file; every event is ONE os.write on a file
opened with O_APPEND, so lines from the two processes interleave but never tear.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, TextIO

EVENTS_FILE = "events.jsonl"


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


class EventLog:
    """emit(kind, **fields) -> appends {"t", "kind", "where", "pid", **fields} and prints one line."""

    def __init__(self, path: Optional[Path], where: str = "controller", console: Optional[TextIO] = sys.stdout):
        self.path = Path(path) if path is not None else None
        self.where = where  # "controller" | "engine": which process wrote the event
        self.console = console
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, kind: str, **fields: Any) -> Dict[str, Any]:
        event = {"t": round(time.time(), 3), "kind": kind, "where": self.where, "pid": os.getpid()}
        event.update({k: _jsonable(v) for k, v in fields.items()})
        if self.path is not None:
            line = (json.dumps(event, sort_keys=False) + "\n").encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, line)  # one write per event: atomic w.r.t. other O_APPEND writers
            finally:
                os.close(fd)
        if self.console is not None:
            try:
                self.console.write(format_event(event) + "\n")
                self.console.flush()
            except (OSError, ValueError):  # closed console (detached engine): the file is the record
                pass
        return event

    __call__ = emit


def format_event(event: Dict[str, Any]) -> str:
    """`[kdtree 08:01:02 engine] stage load end 1.23 s` — the console form of an event."""
    clock = time.strftime("%H:%M:%S", time.localtime(event.get("t", time.time())))
    parts = [f"[kdtree {clock} {event.get('where', '?')}]", str(event.get("kind", "?")).replace("_", " ")]
    if "stage" in event:
        parts.append(str(event["stage"]))
    if "seconds" in event:
        parts.append(f"{event['seconds']:.2f} s")
    skip = {"t", "kind", "where", "pid", "stage", "seconds", "index", "result"}
    for key, value in event.items():
        if key not in skip:
            parts.append(f"{key}={value}")
    return " ".join(parts)


def read_events(run_dir: Path) -> List[Dict[str, Any]]:
    """All events of a run, in file order (lines that are not JSON are skipped)."""
    return read_jsonl(Path(run_dir) / EVENTS_FILE)


def read_jsonl(path: Path) -> List[Dict[str, Any]]:
    """One dict per JSON line of `path` ([] when it does not exist; torn or foreign lines are skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
