"""Verdict per sample: READY, PROGRESSING, WAITING, STALLED, CRASHED, UNREACHABLE or NOT_OPENAI, from the probe
results.

    READY        the completion probe got choices back
    CRASHED      the engine process is gone (or a zombie), its systemd unit failed, or status says failed
    NOT_OPENAI   the completion endpoint answers with a permanent 4xx (404, 405, ...) on two samples in a row:
                 something answers there, but not as an OpenAI completions server
    UNREACHABLE  the host: its connection failed (connect/transport), or (ssh) no sample command came back for
                 stall_window_s -- never a local host, whose late sample is a slow sample; or the server: nothing
                 listened at the URL (refused, unresolved, timed out) for stall_window_s and no process of it is known
    WAITING      nothing has moved yet since the watch began (the window has not decided), or no reply from the
                 host yet: a line that does not claim progress
    PROGRESSING  a progress signal moved within stall_window_s: status bytes/shards/phase/warm-up shapes, the
                 watched process TREE's loaded bytes / disk reads / CPU / page faults, its GPU memory, log growth,
                 the completion's answer changing (port opens, 503 -> 200), or reads of the disk named by health.disk. Machine-wide disk reads and GPU memory never count:
                 another process's reads must not hide a hang
    STALLED      nothing moved for stall_window_s, or the deadline passed without progress

The deadline (health.deadline_s) extends while progress moves: a slow load is never called a failure,
a silent one is called STALLED after the window.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

VERDICTS = ("READY", "PROGRESSING", "WAITING", "STALLED", "CRASHED", "UNREACHABLE", "NOT_OPENAI")
EXIT_CODES = {"READY": 0, "PROGRESSING": 2, "WAITING": 2, "STALLED": 3, "CRASHED": 4, "UNREACHABLE": 5,
              "NOT_OPENAI": 6}
TERMINAL = ("READY", "CRASHED", "STALLED", "UNREACHABLE", "NOT_OPENAI")

# How much a counter must grow between two samples to count as progress. The monitor's own probes make
# the engine answer HTTP (a little CPU, socket reads that are not rchar), so CPU must exceed a floor.
MIN_CPU_FRACTION = 0.05          # of one core over the sample interval
MIN_RCHAR_BYTES = 64 * 1024      # read() bytes incl. page cache
MIN_FAULTS = 256                 # page faults (1 MiB of 4 KiB pages): an mmap load from the page cache
MIN_DISK_BYTES = 1 << 20         # reads of the named device (health.disk)
MIN_GPU_MB = 1.0
# Answers of /v1/completions that will not change by waiting: the URL is not an OpenAI completions server
# (or the key is wrong). 429/503 are "not now" and stay PROGRESSING/STALLED material.
PERMANENT_HTTP = (400, 401, 403, 404, 405, 422, 501)
PERMANENT_SAMPLES = 2            # seen this many samples in a row before the verdict


def progress_signals(probes: Dict[str, Any]) -> Dict[str, Any]:
    """Flat {signal: value} of everything that grows while a cold start of THE WATCHED server makes progress."""
    sig: Dict[str, Any] = {}
    comp = probes.get("completion")
    if comp is not None and comp.ok and comp.data.get("port"):
        # the port opening, or the answer changing (503 -> 404 -> ...), is the server moving on
        http = comp.data.get("http")
        sig["completion.state"] = str(http) if http is not None else \
            "slow" if comp.data["port"] == "open" else "closed"
    st = probes.get("status")
    snap = st.data.get("status") if st is not None and st.ok else None
    if isinstance(snap, dict):
        for k in ("bytes_done", "shards_done", "warmup_done"):
            if isinstance(snap.get(k), (int, float)):
                sig[f"status.{k}"] = snap[k]
        if snap.get("phase"):
            sig["status.phase"] = snap["phase"]
    proc = probes.get("process")
    if proc is not None and proc.ok and proc.data.get("alive"):
        for k in ("loaded", "read_bytes", "cpu_s", "faults"):
            if proc.data.get(k) is not None:
                sig[f"process.{k}"] = proc.data[k]
    disk = probes.get("disk")
    if disk is not None and disk.ok and disk.data.get("named_read_bytes") is not None:
        sig["disk.read_bytes"] = disk.data["named_read_bytes"]
    gpu = probes.get("gpu")
    if gpu is not None and gpu.ok and gpu.data.get("tree_mem_mb") is not None:
        sig["gpu.mem_used_mb"] = gpu.data["tree_mem_mb"]
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
        if k == "completion.state":     # closing, or an answer turning into no answer, is not progress
            if v != p and v != "closed" and not (v == "slow" and p != "closed"):
                out.append(k)
            continue
        if isinstance(v, str) or isinstance(p, str):
            if v != p:
                out.append(k)
            continue
        delta = v - p
        if k == "process.cpu_s":
            ok = delta >= MIN_CPU_FRACTION * max(dt, 1e-3)
        elif k in ("process.rchar", "process.loaded"):
            ok = delta >= MIN_RCHAR_BYTES
        elif k == "process.faults":
            ok = delta >= MIN_FAULTS
        elif k == "disk.read_bytes":
            ok = delta >= MIN_DISK_BYTES
        elif k == "gpu.mem_used_mb":
            ok = abs(delta) >= MIN_GPU_MB
        else:
            ok = delta > 0
        if ok:
            out.append(k)
    return out


PORT_WORDS = {"refused": "connection refused", "unresolved": "host name not resolved", "timeout": "connect timed out",
              "empty_reply": "connection closed without a reply"}


@dataclass
class Judgement:
    verdict: str
    terminal: bool                  # the monitor stops here
    reason: str = ""
    moved: List[str] = field(default_factory=list)
    quiet_s: float = 0.0            # seconds since the last progress signal moved


class Judge:
    def __init__(self, stall_window_s: float, deadline_s: float, now: float, local: bool = False):
        self.window = float(stall_window_s)
        self.local = local          # probes run on this machine: a late sample is slow, never an unreachable host
        self.moved_once = False     # until something moves, lines say WAITING, not PROGRESSING
        self.t0 = now
        self.deadline_at = now + float(deadline_s)
        self.last_progress = now    # the first window is the benefit of the doubt
        self.prev: Dict[str, Any] = {}
        self.prev_t: Optional[float] = None
        self.unreachable_since: Optional[float] = None
        self.port_open_at: float = now     # last time something listened at the URL (start: benefit of the doubt)
        self.permanent: List[int] = []     # HTTP codes of the last samples' completions, while permanent
        self.moves: List[float] = []       # when the last few moves were seen: a bursty load's cadence
        self.spacing = 0.0                 # seconds between samples (running mean)
        self.moving = False                # the previous sample saw a move

    def judge(self, probes: Dict[str, Any], now: float, seen_at: Optional[float] = None) -> Judgement:
        """`now`: the sample's end; `seen_at`: its start, when the probes went out (default `now`). A move is
        timed at seen_at: the counters were read then, and a sample can last seconds (ssh round trips, a frozen
        server's curl waiting for its timeout), which would otherwise push STALLED up to a sample late."""
        seen_at = now if seen_at is None else seen_at
        reached = [p for p in probes.values() if not (p.unreachable or p.timed_out)]
        if probes and not reached:         # the sample never came back: nothing was observed, nothing moved
            return self._no_reply(probes, now, seen_at)
        self.unreachable_since = None

        signals = progress_signals(probes)
        moved = moved_signals(self.prev, signals, now - self.prev_t) if self.prev_t is not None else []
        if self.prev_t is not None:
            self.spacing = now - self.prev_t if not self.spacing else 0.8 * self.spacing + 0.2 * (now - self.prev_t)
        self.prev, self.prev_t = signals, now
        if moved:
            self.moved_once = True
            self.last_progress = max(self.last_progress, seen_at)
            self.deadline_at = max(self.deadline_at, now + self.window)
            if not self.moving:                    # a burst's start (a burst can span samples)
                self.moves = (self.moves + [seen_at])[-4:]
        self.moving = bool(moved)
        cadence = self.cadence()
        # a sample that saw a move is never STALLED; between the bursts of a steady bursty load (mmap page-ins in
        # ~17 MB bursts) the quiet counts past the load's usual gap, not from its last burst (issue 37 row 17)
        quiet = 0.0 if moved else max(0.0, now - self.last_progress - min(cadence, self.window / 2))

        comp = probes.get("completion")
        cd = comp.data if comp is not None and comp.ok else {}
        if cd.get("answered"):
            return Judgement("READY", True, f"completion answered {cd.get('text')!r}", moved, quiet)

        crash = self._crash_reason(probes)
        if crash:
            return Judgement("CRASHED", True, crash, moved, quiet)

        if cd.get("http") in PERMANENT_HTTP and cd.get("final"):
            self.permanent.append(cd["http"])
            if len(self.permanent) >= PERMANENT_SAMPLES:
                hint = "; check health.api_key" if cd["http"] in (401, 403) else \
                    "; is health.url the server's base URL (without /v1)?" if cd["http"] in (404, 405) else ""
                return Judgement("NOT_OPENAI", True, f"answers, but not as an OpenAI completions server: POST "
                                 f"/v1/completions -> HTTP {cd['http']} {cd.get('message', '')!r}{hint}", moved, quiet)
        else:
            self.permanent = []

        port = cd.get("port")
        if port == "open" or "process" in probes:     # a known process speaks for the server while its port is shut
            self.port_open_at = seen_at
        if quiet >= self.window or now >= self.deadline_at:
            closed_for = now - self.port_open_at
            if closed_for >= self.window and port and port != "open":
                why = PORT_WORDS.get(port) or f"{port}: {cd.get('detail', '')}"
                return Judgement("UNREACHABLE", True, f"nothing listening at the URL for {closed_for:.0f} s ({why}) "
                                 f"and no process of the server to watch (health.pid)", moved, quiet)
            if quiet >= self.window:
                return Judgement("STALLED", True, f"nothing moved for {now - self.last_progress:.0f} s (stall window "
                                 f"{self.window:g} s" + (f" past the load's usual {cadence:.0f} s between moves)"
                                                        if cadence else ")")
                                 + _stopped(probes), moved, quiet)
            return Judgement("STALLED", True, f"deadline of {self.deadline_at - self.t0:.0f} s passed without "
                             f"progress", moved, quiet)
        if not self.moved_once:
            return Judgement("WAITING", False, f"nothing moved yet: {quiet:.0f} s of {self.window:g} s window"
                             + _stopped(probes), moved, quiet)
        usual = f" past the load's usual {cadence:.0f} s between moves" if cadence else ""
        return Judgement("PROGRESSING", False, "moved: " + ",".join(moved) if moved else
                         f"quiet {quiet:.0f} s{usual} of {self.window:g} s window", moved, quiet)

    def cadence(self) -> float:
        """The usual gap between a bursty load's moves, once two regular gaps (each >= 2 sample spacings, within
        a factor 2 of each other) were seen: a frozen bursty load is then STALLED that much later (at most half a
        window later). 0 for a load that moves every sample or irregularly."""
        gaps = [b - a for a, b in zip(self.moves, self.moves[1:])][-2:]
        if len(gaps) < 2 or min(gaps) < 2 * max(self.spacing, 0.1) or max(gaps) > 2 * min(gaps):
            return 0.0
        return sum(gaps) / 2

    def _no_reply(self, probes: Dict[str, Any], now: float, seen_at: float) -> Judgement:
        """A sample that observed nothing. A failed connection (connect/transport) is an unreachable host; a sample
        that ran out of time is a slow one: on a local host never "unreachable" (STALLED once nothing moved for the
        window), over ssh WAITING until no reply came for the whole window (then UNREACHABLE)."""
        first = next(iter(probes.values()))
        quiet = now - self.last_progress
        if self.local:
            if quiet >= self.window:
                return Judgement("STALLED", True, f"nothing moved for {quiet:.0f} s (stall window {self.window:g} s); "
                                 f"the last sample took {first.seconds:.1f} s: this machine is overloaded", [], quiet)
            return Judgement("WAITING", False, f"slow sample ({first.seconds:.1f} s; this machine is overloaded): "
                             f"nothing observed, quiet {quiet:.0f} s of {self.window:g} s window", [], quiet)
        self.unreachable_since = self.unreachable_since or seen_at
        down = now - self.unreachable_since
        if any(p.unreachable for p in probes.values()) or down >= self.window:
            return Judgement("UNREACHABLE", down >= self.window, f"host unreachable for {down:.0f} s: "
                             f"{first.error[:160]}", [], quiet)
        return Judgement("WAITING", False, f"host not answering for {down:.0f} s (no reply yet: slow is not down; "
                         f"the verdict waits for the {self.window:g} s window): {first.error[:120]}", [], quiet)

    @staticmethod
    def _crash_reason(probes: Dict[str, Any]) -> str:
        proc = probes.get("process")
        if proc is not None and proc.ok and not proc.data.get("alive"):
            state = proc.data.get("state")
            what = "is gone" if state == "gone" else f"exited (state {state}, not reaped)"
            log = probes.get("log")
            last = log.data.get("last_line") if log is not None and log.ok else ""
            st = probes.get("status")
            snap = st.data.get("status") if st is not None and st.ok else None
            err = snap.get("error") if isinstance(snap, dict) and snap.get("phase") == "failed" else ""
            return (f"engine pid {proc.data.get('pid')} {what}" + (f"; status: {err}"[:200] if err else "")
                    + (f"; log: {last}" if last else ""))
        log = probes.get("log")
        if log is not None and log.ok and log.data.get("active") in ("failed", "inactive"):
            return (f"unit {log.data.get('active')} ({log.data.get('sub')}, result {log.data.get('result')}): "
                    f"{log.data.get('last_line', '')[:120]}")
        st = probes.get("status")
        snap = st.data.get("status") if st is not None and st.ok else None
        if isinstance(snap, dict) and snap.get("phase") == "failed":
            return f"engine status failed: {snap.get('error', '')}"[:240]
        return ""


def _stopped(probes: Dict[str, Any]) -> str:
    """"; pid N is stopped (state T ...)" when the watched process is stopped (SIGSTOP, a debugger), else ""."""
    proc = probes.get("process")
    if proc is not None and proc.ok and proc.data.get("alive") and proc.data.get("state") in ("T", "t"):
        pid = proc.data.get("pid")
        return f"; pid {pid} is stopped (state T: SIGSTOP or a debugger; `kill -CONT {pid}` resumes it)"
    return ""
