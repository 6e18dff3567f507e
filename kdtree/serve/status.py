"""The engine's status file: one JSON object, rewritten atomically, readable from the process's first second.

    st = StatusFile(run_dir / "status.json")          # writes phase=loading, pid, started_at at once
    st.update(phase="loading", shards_done=3, shards_total=62, bytes_done=..., bytes_total=...,
              rate_mb_s=812.5, eta_s=412.0)
    st.snapshot()                                      # a copy of the current dict

Readers (the HTTP /status endpoint, the monitor's status probe, `cat status.json`) never see a partial
file: every write goes to a temp file in the same directory and is moved over with os.replace.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

PHASES = ("loading", "warmup", "ready", "draining", "stopped", "failed")


class StatusFile:
    """Merged key/value status of one engine process, mirrored to `path` on every update."""

    def __init__(self, path: Union[str, Path], **initial: Any):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._listeners: List[Callable[[Dict[str, Any]], None]] = []
        now = time.time()
        self._data: Dict[str, Any] = {
            "pid": os.getpid(),
            "phase": "loading",
            "started_at": now,
            "updated_at": now,
            "phase_started_at": now,
            "phases": {"loading": {"started_at": now}},   # phase -> started_at / seconds (for history)
            "shards_done": 0,
            "shards_total": 0,
            "bytes_done": 0,
            "bytes_total": 0,
            "rate_mb_s": 0.0,
            "eta_s": None,
        }
        self.update(**initial)

    def update(self, **fields: Any) -> Dict[str, Any]:
        """Merge `fields` into the status and rewrite the file; returns the new snapshot."""
        phase = fields.get("phase")
        if phase is not None and phase not in PHASES:
            raise ValueError(f"status phase={phase!r} is not one of {', '.join(PHASES)}")
        with self._lock:
            now = time.time()
            if phase is not None and phase != self._data["phase"]:
                prev = self._data["phase"]
                self._data["phases"].setdefault(prev, {})["seconds"] = round(
                    now - self._data["phase_started_at"], 3)
                self._data["phases"][phase] = {"started_at": now}
                self._data["phase_started_at"] = now
            self._data.update(fields)
            self._data["updated_at"] = now
            self._data["pid"] = os.getpid()
            snap = json.loads(json.dumps(self._data, default=str))
            self._write(snap)
            listeners = list(self._listeners)
        for fn in listeners:                      # sd_notify, metrics: outside the lock, never fatal
            try:
                fn(snap)
            except Exception:
                pass
        return snap

    def subscribe(self, fn: Callable[[Dict[str, Any]], None]) -> None:
        """Call fn(snapshot) after every update (sd_notify mirrors the status to systemd this way)."""
        with self._lock:
            self._listeners.append(fn)

    def snapshot(self) -> Dict[str, Any]:
        with self._lock:
            return json.loads(json.dumps(self._data, default=str))

    @property
    def phase(self) -> str:
        with self._lock:
            return self._data["phase"]

    def _write(self, data: Dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, self.path)


def read_status(path: Union[str, Path]) -> Optional[Dict[str, Any]]:
    """The last status written at `path`, or None if there is none yet."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def describe(snap: Dict[str, Any]) -> str:
    """One line for humans and systemd: 'loading 3/8 shards, 12.5 MB/40.0 MB, 2.5 MB/s, ETA 11 s'."""
    phase = snap.get("phase", "?")
    parts = [phase]
    if phase == "loading" or (phase in ("warmup", "ready") and snap.get("bytes_total")):
        if snap.get("shards_total"):
            parts[0] += f" {snap.get('shards_done', 0)}/{snap['shards_total']} shards"
        if snap.get("bytes_total"):
            parts.append(f"{_size(snap.get('bytes_done', 0))}/{_size(snap['bytes_total'])}")
        if phase == "loading" and snap.get("rate_mb_s"):
            parts.append(f"{snap['rate_mb_s']:.1f} MB/s")
        if phase == "loading" and snap.get("eta_s") is not None:
            parts.append(f"ETA {snap['eta_s']:.0f} s")
    if phase == "warmup" and snap.get("warmup_total"):
        parts.append(f"shape {snap.get('warmup_done', 0)}/{snap['warmup_total']} {snap.get('warmup_shape', '')}".rstrip())
    if phase == "failed" and snap.get("error"):
        parts.append(str(snap["error"]))
    return ", ".join(parts)


def make_status(run_dir: Union[str, Path]) -> StatusFile:
    """The engine process's status file, run_dir/status.json; the engine's stages declare this function as
    their `make_status` (kdtree/pipeline/registry.py), so the engine process creates it at start."""
    return StatusFile(Path(run_dir) / "status.json")
