"""Verdict per sample: READY, PROGRESSING, STALLED, CRASHED or UNREACHABLE, from the probe results.

    READY        the completion probe got choices back
    CRASHED      the engine process is gone (or a zombie), its systemd unit failed, or status says failed
    UNREACHABLE  every probe failed to reach the host (connection error or host command timeout)
    PROGRESSING  a progress signal moved within stall_window_s (status bytes/shards/phase/warm-up shapes,
                 process read bytes / CPU, log growth; disk reads and GPU memory only when no process is
                 known, since they are machine-wide and another process's reads must not hide a hang)
    STALLED      nothing moved for stall_window_s, or the deadline passed without progress

The deadline (health.deadline_s) extends while progress moves: a slow load is never called a failure,
a silent one is called STALLED after the window.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

VERDICTS = ("READY", "PROGRESSING", "STALLED", "CRASHED", "UNREACHABLE")
EXIT_CODES = {"READY": 0, "PROGRESSING": 2, "STALLED": 3, "CRASHED": 4, "UNREACHABLE": 5}

# How much a counter must grow between two samples to count as progress. The monitor's own probes make
# the engine answer HTTP (a little CPU, socket reads that are not rchar), so CPU must exceed a floor.
MIN_CPU_FRACTION = 0.05          # of one core over the sample interval
MIN_RCHAR_BYTES = 64 * 1024      # read() bytes incl. page cache
MIN_DISK_BYTES = 1 << 20         # machine-wide device reads
MIN_GPU_MB = 1.0


def progress_signals(probes: Dict[str, Any]) -> Dict[str, Any]:
    """Flat {signal: value} of everything that grows while a cold start makes progress."""
    sig: Dict[str, Any] = {}
    st = probes.get("status")
    snap = st.data.get("status") if st is not None and st.ok else None
    if isinstance(snap, dict):
        for k in ("bytes_done", "shards_done", "warmup_done"):
            if isinstance(snap.get(k), (int, float)):
                sig[f"status.{k}"] = snap[k]
        if snap.get("phase"):
            sig["status.phase"] = snap["phase"]
    proc = probes.get("process")
    has_process = proc is not None and proc.ok and proc.data.get("alive")
    if has_process:
        for k in ("read_bytes", "rchar", "cpu_s"):
            if proc.data.get(k) is not None:
                sig[f"process.{k}"] = proc.data[k]
    else:
        disk = probes.get("disk")
        if disk is not None and disk.ok:
            sig["disk.read_bytes"] = sum(d["read_bytes"] for d in disk.data["devices"].values())
        gpu = probes.get("gpu")
        if gpu is not None and gpu.ok and gpu.data.get("present"):
            sig["gpu.mem_used_mb"] = gpu.data["mem_used_mb"]
    log = probes.get("log")
    if log is not None and log.ok:
        for k in ("size", "mtime", "journal_at"):
            if log.data.get(k) is not None:
                sig[f"log.{k}"] = log.data[k]
    return sig


def moved_signals(prev: Dict[str, Any], cur: Dict[str, Any], dt: float) -> List[str]:
    out = []
    for k, v in cur.items():
        if k not in prev:
            continue
        p = prev[k]
        if isinstance(v, str) or isinstance(p, str):
            if v != p:
                out.append(k)
            continue
        delta = v - p
        if k == "process.cpu_s":
            ok = delta >= MIN_CPU_FRACTION * max(dt, 1e-3)
        elif k == "process.rchar":
            ok = delta >= MIN_RCHAR_BYTES
        elif k == "disk.read_bytes":
            ok = delta >= MIN_DISK_BYTES
        elif k == "gpu.mem_used_mb":
            ok = abs(delta) >= MIN_GPU_MB
        else:
            ok = delta > 0
        if ok:
            out.append(k)
    return out


@dataclass
class Judgement:
    verdict: str
    terminal: bool                  # the monitor stops here
    reason: str = ""
    moved: List[str] = field(default_factory=list)
    quiet_s: float = 0.0            # seconds since the last progress signal moved


class Judge:
    def __init__(self, stall_window_s: float, deadline_s: float, now: float):
        self.window = float(stall_window_s)
        self.t0 = now
        self.deadline_at = now + float(deadline_s)
        self.last_progress = now    # the first window is the benefit of the doubt
        self.prev: Dict[str, Any] = {}
        self.prev_t: Optional[float] = None
        self.unreachable_since: Optional[float] = None

    def judge(self, probes: Dict[str, Any], now: float, seen_at: Optional[float] = None) -> Judgement:
        """`now`: the sample's end; `seen_at`: its start, when the probes went out (default `now`). A move is
        timed at seen_at: the counters were read then, and a sample can last seconds (ssh round trips, a frozen
        server's curl waiting for its timeout), which would otherwise push STALLED up to a sample late."""
        signals = progress_signals(probes)
        moved = moved_signals(self.prev, signals, now - self.prev_t) if self.prev_t is not None else []
        self.prev, self.prev_t = signals, now
        if moved:
            self.last_progress = max(self.last_progress, now if seen_at is None else seen_at)
            self.deadline_at = max(self.deadline_at, now + self.window)
        quiet = 0.0 if moved else now - self.last_progress      # a sample that saw a move is never STALLED

        comp = probes.get("completion")
        if comp is not None and comp.ok and comp.data.get("answered"):
            return Judgement("READY", True, f"completion answered {comp.data.get('text')!r}", moved, quiet)

        crash = self._crash_reason(probes)
        if crash:
            return Judgement("CRASHED", True, crash, moved, quiet)

        reached = [p for p in probes.values() if not (p.unreachable or p.timed_out)]
        if probes and not reached:
            self.unreachable_since = self.unreachable_since or now
            first = next(iter(probes.values()))
            down = now - self.unreachable_since
            return Judgement("UNREACHABLE", down >= self.window,
                             f"host unreachable for {down:.0f} s: {first.error[:160]}", moved, quiet)
        self.unreachable_since = None

        if quiet >= self.window:
            return Judgement("STALLED", True, f"nothing moved for {quiet:.0f} s (stall window {self.window:g} s)",
                             moved, quiet)
        if now >= self.deadline_at:
            return Judgement("STALLED", True, f"deadline of {self.deadline_at - self.t0:.0f} s passed without progress",
                             moved, quiet)
        return Judgement("PROGRESSING", False, "moved: " + ",".join(moved) if moved else
                         f"quiet {quiet:.0f} s of {self.window:g} s window", moved, quiet)

    @staticmethod
    def _crash_reason(probes: Dict[str, Any]) -> str:
        proc = probes.get("process")
        if proc is not None and proc.ok and not proc.data.get("alive"):
            state = proc.data.get("state")
            what = "is gone" if state == "gone" else f"exited (state {state}, not reaped)"
            log = probes.get("log")
            last = log.data.get("last_line") if log is not None and log.ok else ""
            return f"engine pid {proc.data.get('pid')} {what}" + (f"; log: {last}" if last else "")
        log = probes.get("log")
        if log is not None and log.ok and log.data.get("active") in ("failed", "inactive"):
            return (f"unit {log.data.get('active')} ({log.data.get('sub')}, result {log.data.get('result')}): "
                    f"{log.data.get('last_line', '')[:120]}")
        st = probes.get("status")
        snap = st.data.get("status") if st is not None and st.ok else None
        if isinstance(snap, dict) and snap.get("phase") == "failed":
            return f"engine status failed: {snap.get('error', '')}"[:200]
        return ""
