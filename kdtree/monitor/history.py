"""Cold-start history: phase durations of earlier starts of the same host + model + config, so a start can
say "loading 41 s, usually 39 s (5 past starts)" or "3.1x slower than usual".

Stored as JSON lines under <cache_dir>/health/<key>.jsonl, one line per finished start.
"""
from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

MATCH_TOLERANCE = 0.5      # within +-50 % of the median (or 2 s on tiny) counts as "matches the past"
MATCH_SLACK_S = 2.0
KEEP = 50                  # starts kept per key


def history_key(fields: Dict[str, Any]) -> str:
    """fields: what makes two cold starts comparable (host, model, checkpoint, quant, tp, backend)."""
    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


class History:
    def __init__(self, cache_dir: Path, fields: Dict[str, Any]):
        self.fields = fields
        self.key = history_key(fields)
        self.path = Path(cache_dir) / "health" / f"{self.key}.jsonl"

    def load(self) -> List[Dict[str, Any]]:
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue          # a torn last line from a killed monitor: skip it
        return out

    def record(self, verdict: str, phases: Dict[str, float], to_ready_s: Optional[float], **extra: Any) -> None:
        entries = self.load()[-(KEEP - 1):]
        entries.append({"at": time.time(), "verdict": verdict, "phases": phases, "to_ready_s": to_ready_s,
                        "fields": self.fields, **extra})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(e) + "\n" for e in entries))
        tmp.replace(self.path)

    def baseline(self) -> Dict[str, Any]:
        """Medians over past READY starts: {'starts': n, 'to_ready_s': m, 'phases': {phase: m}}."""
        ready = [e for e in self.load() if e.get("verdict") == "READY"]
        out: Dict[str, Any] = {"starts": len(ready), "phases": {}}
        if not ready:
            return out
        vals = [e["to_ready_s"] for e in ready if e.get("to_ready_s") is not None]
        out["to_ready_s"] = statistics.median(vals) if vals else None
        names = {p for e in ready for p in (e.get("phases") or {})}
        for p in sorted(names):
            v = [e["phases"][p] for e in ready if p in (e.get("phases") or {})]
            out["phases"][p] = statistics.median(v)
        return out


def matches(value: float, median: Optional[float]) -> Optional[bool]:
    if median is None:
        return None
    return abs(value - median) <= max(MATCH_TOLERANCE * median, MATCH_SLACK_S)


def compare(phases: Dict[str, float], to_ready_s: Optional[float], base: Dict[str, Any]) -> Dict[str, Any]:
    """This start against the baseline: per phase and overall, with one summary line."""
    if not base.get("starts"):
        return {"starts": 0, "matches": None, "line": "no earlier cold starts of this host+model+config"}
    rows = {}
    for p, s in phases.items():
        m = base["phases"].get(p)
        if m is not None:
            rows[p] = {"seconds": round(s, 2), "median_s": round(m, 2), "matches": matches(s, m)}
    total_m = base.get("to_ready_s")
    ok_total = matches(to_ready_s, total_m) if to_ready_s is not None else None
    verdicts = [r["matches"] for r in rows.values()] + ([ok_total] if ok_total is not None else [])
    all_ok = all(verdicts) if verdicts else None
    parts = [f"{p} {r['seconds']:.1f} s (usually {r['median_s']:.1f} s)" for p, r in rows.items()]
    if to_ready_s is not None and total_m is not None:
        parts.append(f"ready after {to_ready_s:.1f} s (usually {total_m:.1f} s)")
    head = "matches" if all_ok else "differs from"
    line = f"{head} the {base['starts']} earlier cold start(s): " + ", ".join(parts)
    return {"starts": base["starts"], "matches": all_ok, "phases": rows, "to_ready_s": to_ready_s,
            "median_to_ready_s": total_m, "line": line}
