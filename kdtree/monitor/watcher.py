"""The monitor loop: sample every probe, judge, print one evidence line per sample, stop on a settled verdict.

    w = Watcher(host, Target(url="http://127.0.0.1:30001", pid=1234, log=".../engine.log"),
                interval_s=1, stall_window_s=30, deadline_s=600, probe_timeout_s=5,
                history=History(cache_dir, fields), out_dir=run_dir)
    summary = w.run()        # {"verdict": "READY", "exit_code": 0, ...}; health.json + health.jsonl in out_dir

A line per sample reads, e.g.
    12.0s PROGRESSING loading 2/4 shards 6.3 MB/12.5 MB 1.0 MB/s ETA 6 s | http 503 | pid 812 R cpu 12% rss 180 MB
          read 1.0 MB/s | disk idle | log +0 B | moved: status.bytes_done,process.rchar
"""
from __future__ import annotations

import io
import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional
from urllib.parse import urlsplit

from kdtree.config.paths import cache_dir
from kdtree.monitor import probes as P
from kdtree.monitor.eta import LoadBytes, RateMeter, eta_seconds
from kdtree.monitor.evidence import check_evidence, evidence_note
from kdtree.monitor.finder import found_note
from kdtree.monitor.history import History, compare
from kdtree.monitor.verdict import EXIT_CODES, Judge
from kdtree.serve.status import describe


@dataclass
class Target:
    url: str                    # base URL as seen from the host (curl runs there)
    model: str = ""             # empty: the first id of GET /v1/models, or a completion without `model`
    api_key: str = ""
    pid: int = 0                # root of the server's process tree; 0: from pidfile, the status, or the unit's MainPID
    pidfile: str = ""
    status_path: str = ""       # kdtree's status.json on the host (read when /status does not answer)
    log: str = ""               # engine log file on the host
    unit: str = ""              # systemd unit (log silence via journalctl, crash via ActiveState)
    unit_user: bool = False
    checkpoint: str = ""        # checkpoint dir on the host: its size for the ETA of servers that report nothing
    expected_bytes: int = 0     # the checkpoint's size when known (health.expected_bytes); wins over `checkpoint`
    disk: str = ""              # a block device (nvme0n1) that holds the weights: its reads count as progress
    pid_source: str = ""        # the setting that named `pid` ("health.pid"): it must exist at start (evidence.py)


class _FirstByte(io.TextIOBase):
    """The sample's stdout as it streams in: `seen` is set by the first byte (the host answers)."""

    def __init__(self):
        super().__init__()
        self.seen = threading.Event()
        self.at: Optional[float] = None          # monotonic time of the first byte

    def write(self, s: str) -> int:
        if s and not self.seen.is_set():
            self.at = time.monotonic()
            self.seen.set()
        return len(s)

    def writable(self) -> bool:
        return True


_ETA_WORDS = re.compile(r"[,;]?\s*\bETA\s+~?[\d.]+\s*s\b")


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


class Watcher:
    def __init__(self, host, target: Target, interval_s: float = 1.0, stall_window_s: float = 30.0,
                 deadline_s: float = 600.0, probe_timeout_s: float = 5.0, history: Optional[History] = None,
                 out_dir: Optional[Path] = None, echo: Callable[[str], None] = lambda s: print(s, flush=True)):
        self.host, self.target = host, target
        self.interval_s, self.window, self.deadline_s = float(interval_s), float(stall_window_s), float(deadline_s)
        self.timeout = float(probe_timeout_s)
        self.completion_timeout = self.timeout   # grows when a connected completion is slower than it
        self.history, self.out_dir, self.echo = history, Path(out_dir) if out_dir else None, echo
        self.samples: List[Dict[str, Any]] = []
        self.meter = RateMeter(window_s=max(5.0, min(30.0, self.window)))
        self.read_meter = RateMeter(window_s=self.meter.window_s)   # the tree's loaded bytes, for its `read` rate
        self.load_bytes = LoadBytes()                # the tree's loaded bytes less its reads before the load
        self.tree = P.ProcessTree()
        self._tree_root = 0
        self._prev_disk: Optional[Dict[str, Any]] = None
        self._prev_proc: Optional[Dict[str, Any]] = None
        self._prev_log_size: Optional[int] = None
        self._prev_t: Optional[float] = None
        self._gpu_absent = False
        self._models_settled = bool(target.model)   # the completion's `model` is as good as it gets
        self._checkpoint_total: Optional[int] = int(target.expected_bytes) or None
        self._last_status: Optional[Dict[str, Any]] = None
        self._unit_pid = 0
        self._port_pid = 0                           # the process found by the URL's port (finder.py)
        self._found_note = ""                        # said once, in the sample that found it
        self._first_byte_s: List[float] = []       # seconds from a sample's start to its first byte (recent ones)
        self._observed: Dict[str, float] = {}      # monitor-seen milestones: port_open, ready (seconds)
        self._missing: Dict[str, str] = {}         # evidence named but absent at start: {"log": why, ...}

    # -- probes ----------------------------------------------------------------------------------------
    def _pid(self) -> int:
        t = self.target
        if t.pid:
            return t.pid
        if self._unit_pid:
            return self._unit_pid
        if self._port_pid:
            return self._port_pid
        if self._last_status and self._last_status.get("pid"):
            return int(self._last_status["pid"])
        return 0

    def _local_port(self) -> int:
        """The URL's port when the server listens on the host the probes run on (its owner can be found there)."""
        try:
            u = urlsplit(self.target.url)
            port = u.port or (443 if u.scheme == "https" else 80)
        except ValueError:
            return 0
        here = ("127.0.0.1", "localhost", "::1", "0.0.0.0", getattr(self.host, "address", None))
        return port if u.hostname in here else 0

    def _spec(self) -> P.SampleSpec:
        t = self.target
        if not t.url and self._last_status and self._last_status.get("url"):
            t.url = self._last_status["url"]          # serve.port=0: the engine wrote the port it got
        return P.SampleSpec(url=t.url, model=t.model, pid=self._pid(), pidfile=t.pidfile, status_path=t.status_path,
                            port_owner=self._local_port() if not (t.pidfile or t.unit) else 0,
                            log=t.log, unit=t.unit, unit_user=t.unit_user, gpu=not self._gpu_absent,
                            http_timeout_s=self.timeout, completion_timeout_s=self.completion_timeout)

    def sample_deadline(self) -> float:
        """One sample's whole budget: the slowest curl + the shell's own time (>= 1 s, or twice the slowest recent
        first byte: an ssh channel and a login shell); + a (re)connect when there is no connection."""
        connect = 0.0 if getattr(self.host, "connected", True) else float(getattr(self.host, "connect_timeout_s", 0))
        overhead = max([1.0] + [2 * x for x in self._first_byte_s])
        return max(self.timeout, self.completion_timeout) + overhead + connect

    def _probes(self, out_stream=None) -> Dict[str, P.ProbeResult]:
        spec = self._spec()
        probes = P.run_sample(self.host, spec, self.target.api_key, self.sample_deadline(), out_stream)
        t = self.target
        m = probes.get("models")
        if m is not None and m.ok:
            if m.data.get("model"):
                t.model = m.data["model"]              # the next completions name it
            self._models_settled = True
        comp = probes["completion"]
        if comp.ok:
            if self._models_settled and comp.data.get("http") is not None:
                comp.data["final"] = bool(spec.model) or not t.model   # asked with the id /v1/models gave, if any
            if comp.data.get("slow"):                  # connected, no answer in time: give the next one longer
                self.completion_timeout = min(max(self.window, self.timeout), 2 * self.completion_timeout)
        pr = probes.get("process")
        if pr is not None and pr.ok and pr.data.get("alive") is None:
            del probes["process"]                      # no process known yet: no process evidence, not a crash
            pr = None
        if pr is not None and pr.ok:
            if pr.data["pid"] != self._tree_root:      # another root (pidfile appeared, port owner found): a new tree
                self.tree, self._tree_root = P.ProcessTree(), pr.data["pid"]
            if spec.port_owner and not spec.pid and pr.data.get("alive"):
                self._port_pid = pr.data["pid"]        # found by its port: watched from now on, as health.pid would be
                self._found_note = found_note(self._port_pid, pr.data.get("found") or {}, spec.port_owner)
            self.tree.account(pr.data)
        lg = probes.get("log")
        if lg is not None and lg.ok and lg.data.get("main_pid"):
            self._unit_pid = lg.data["main_pid"]
        g = probes.get("gpu")
        if g is not None and g.ok:
            if not g.data.get("present"):
                self._gpu_absent = True
            elif pr is not None and pr.ok and pr.data.get("members"):
                mine = [a for a in g.data["apps"] if a["pid"] in set(pr.data["members"])]
                g.data["tree_mem_mb"] = sum(a["mem_mb"] for a in mine)
                g.data["tree_gpus"] = sorted({a["uuid"] for a in mine})
        dk = probes.get("disk")
        if dk is not None and dk.ok and t.disk:
            dev = dk.data["devices"].get(t.disk)
            dk.data["named_read_bytes"] = dev["read_bytes"] if dev else None
        return probes

    # -- one sample ------------------------------------------------------------------------------------
    def sample(self, judge: Judge, t_start: float) -> Iterator[Dict[str, Any]]:
        """One sample, run in a thread; while no byte of it has come back from the host, a "host unreachable for
        N s" record at every interval (terminal once N reaches the stall window), then the sample's own record."""
        t_probe, started_at = time.monotonic(), time.time()
        first = _FirstByte()
        box: Dict[str, Any] = {}

        def work():
            try:
                box["probes"] = self._probes(first)
            except BaseException as e:           # a monitor bug must not look like a hung host
                box["error"] = e

        th = threading.Thread(target=work, name="monitor-sample", daemon=True)
        th.start()
        tick = t_probe + self.interval_s
        silent_after = self._silent_after()
        while True:
            th.join(max(0.0, tick - time.monotonic()))
            if not th.is_alive():
                break
            if not first.seen.is_set() and time.monotonic() - t_probe >= silent_after:
                waited = time.monotonic() - t_probe
                failed = P.failed_sample(self._spec(), f"command timed out: no answer from "
                                         f"{getattr(self.host, 'label', 'the host')} for {waited:.1f} s", waited)
                rec = self._record(judge, t_start, failed, t_probe, started_at, interim=True)
                yield rec
                if rec["terminal"]:
                    return
            tick += self.interval_s
        if "error" in box:
            raise box["error"]
        if first.at is not None:
            self._first_byte_s = (self._first_byte_s + [first.at - t_probe])[-5:]
        yield self._record(judge, t_start, box["probes"], t_probe, started_at, t_read=first.at)

    def _silent_after(self) -> float:
        """How long a sample may go without its first byte before the host counts as silent: an interval, or twice
        the slowest recent first byte (an ssh channel + login shell take ~0.5 s on a busy host), >= 1 s; before the
        first contact, also the connect timeout. A local host cannot be unreachable: its sample is a subprocess,
        slow only on an overloaded machine, so it counts as silent only after the whole stall window."""
        if getattr(self.host, "kind", "local") == "local":
            return max(self.interval_s, 1.0, self.window)
        if not self._first_byte_s:
            return max(self.interval_s, 1.0, float(getattr(self.host, "connect_timeout_s", 0.0)))
        return max(self.interval_s, 1.0, 2 * max(self._first_byte_s))

    def _record(self, judge: Judge, t_start: float, probes: Dict[str, P.ProbeResult], t_probe: float,
                started_at: float, interim: bool = False, t_read: Optional[float] = None) -> Dict[str, Any]:
        """`t_read`: when the host ran the probes (the first byte of their output arrived), for the ETA."""
        now = time.monotonic()
        elapsed = now - t_start
        st = probes.get("status")
        snap = st.data.get("status") if st is not None and st.ok else None
        if isinstance(snap, dict):
            self._last_status = snap
        j = judge.judge(probes, now, seen_at=t_probe)
        comp = probes["completion"]
        if comp.ok and comp.data.get("port") == "open":
            self._observed.setdefault("port_open", elapsed)
        if j.verdict == "READY":
            self._observed.setdefault("ready", elapsed)

        eta = self._eta(probes, snap, t_read or t_probe, now)
        line = self._line(elapsed, j, probes, snap, eta, now)
        sample = {"t": round(elapsed, 3), "started_at": started_at, "at": time.time(), "verdict": j.verdict,
                  "terminal": j.terminal, "seconds": round(now - t_probe, 3), "interim": interim,
                  "reason": j.reason, "moved": j.moved, "quiet_s": round(j.quiet_s, 2), "eta": eta, "line": line,
                  "probes": {k: v.to_dict() for k, v in probes.items()}}
        if self._found_note:
            sample["found"], self._found_note = self._found_note, ""
        sample["probes"].get("status", {}).get("data", {}).pop("status", None)   # kept once below, smaller
        if isinstance(snap, dict):
            sample["status"] = {k: snap.get(k) for k in ("phase", "shards_done", "shards_total", "bytes_done",
                                                         "bytes_total", "rate_mb_s", "eta_s", "pid", "warmup_done",
                                                         "warmup_total", "updated_at", "error")}
        if any(p.ok for p in probes.values()):
            self._prev_t = now                  # rates are per time between samples that saw the host
        return sample

    def _eta(self, probes, snap, t: float, now: float) -> Optional[Dict[str, Any]]:
        """Load ETA from kdtree's status bytes, else from the process tree's loaded bytes (read() or mmap page-ins
        from disk) against the checkpoint's size (health.expected_bytes, or model.path's size on the host).

        The counters were read at `t` (over ssh ~0.5 s after the sample began), the ETA is printed at `now`."""
        done = total = None
        source = None
        pr = probes.get("process")
        if isinstance(snap, dict) and snap.get("phase") == "loading" and snap.get("bytes_total"):
            done, total, source = snap.get("bytes_done", 0), snap["bytes_total"], "status"
        elif pr is not None and pr.ok and pr.data.get("alive") and pr.data.get("io_readable") \
                and (self.target.expected_bytes or self.target.checkpoint):
            if self._checkpoint_total is None:
                self._checkpoint_total = P.read_checkpoint_total(self.host, self.target.checkpoint,
                                                                 self.timeout) or 0
            if self._checkpoint_total:
                total = self._checkpoint_total
                done = min(self.load_bytes.done(pr.data["loaded"], total), total)
                source = "process"
        if done is None:
            return None
        self.meter.add(t, done)
        rate = self.meter.rate()
        e = eta_seconds(done, total, rate)
        e = None if e is None else max(0.0, e - (now - t))
        return {"source": source, "bytes_done": done, "bytes_total": total,
                "rate_mb_s": None if rate is None else round(rate / 1e6, 3),
                "eta_s": None if e is None or done >= total else round(e, 1)}

    def _line(self, elapsed, j, probes, snap, eta, now) -> str:
        parts = []
        dt = (now - self._prev_t) if self._prev_t else None
        # engine status
        if isinstance(snap, dict):
            s = dict(snap)
            if eta is not None and eta["source"] == "status":
                s["rate_mb_s"] = eta["rate_mb_s"] or 0.0
                s["eta_s"] = eta["eta_s"]
            src = probes["status"].data.get("source")
            if src == "file":
                src_note = " (status.json; /status not answering)" if self.target.url else " (status.json)"
            else:
                src_note = ""
            parts.append(describe(s) + src_note)
        elif eta is not None:
            parts.append(f"read {_mb(eta['bytes_done'])}/{_mb(eta['bytes_total'])}"
                         + (f" {eta['rate_mb_s']:.1f} MB/s" if eta["rate_mb_s"] else "")
                         + (f" ETA {eta['eta_s']:.0f} s" if eta["eta_s"] is not None else ""))
        # the completion probe, exactly what users see
        c = probes["completion"]
        if c.timed_out or c.unreachable:
            parts.append(f"http ? (host command failed after {c.seconds:.1f} s)")
        elif not c.ok:
            parts.append(f"http ? ({c.error[:60]})")
        elif c.data.get("answered"):
            parts.append(f"http 200 {c.data.get('text')!r} in {c.seconds:.2f} s")
        elif c.data.get("http") is not None:
            msg = c.data.get("message")
            if msg and eta is not None and eta["eta_s"] is not None:
                msg = _ETA_WORDS.sub("", msg)      # one ETA per line: the monitor's, not also the engine's
            parts.append(f"http {c.data['http']}" + (f" {msg[:80]!r}" if msg else ""))
        elif c.data.get("slow"):
            parts.append(f"port open, no answer within {c.seconds:.1f} s")
        else:
            parts.append(f"port {c.data.get('port')}" + (f" after {c.seconds:.1f} s" if c.data.get("port") == "timeout"
                                                        else ""))
        # process tree
        pr = probes.get("process")
        if pr is not None:
            if not pr.ok:
                parts.append(f"pid ? ({'ssh timeout' if pr.timed_out else pr.error[:40]})")
            elif not pr.data["alive"]:
                parts.append(f"pid {pr.data['pid']} {pr.data['state']}")
            else:
                d = pr.data
                txt = f"pid {d['pid']} {d['state']}"
                prev = self._prev_proc
                same = prev is not None and prev.get("pid") == d["pid"] and dt
                if same:
                    txt += f" cpu {100 * (d['cpu_s'] - prev['cpu_s']) / dt:.0f}%"
                txt += f" rss {_mb(d['rss_bytes'])}"
                if d.get("io_readable"):             # over the rate window: mmap reads come in bursts
                    if prev is not None and prev.get("pid") != d["pid"]:
                        self.read_meter = RateMeter(window_s=self.meter.window_s)
                    self.read_meter.add(now, d["loaded"])
                    r = self.read_meter.rate()
                    txt += f" read {r / 1e6:.1f} MB/s" if r is not None else ""
                else:
                    txt += " io ?"
                if len(d.get("members", ())) > 1:
                    txt += f" ({len(d['members'])} procs)"
                if d.get("left"):
                    txt += f" (left: pid {','.join(map(str, d['left'][:4]))})"
                parts.append(txt)
                self._prev_proc = d
        # disk: the named device counts; other devices are shown but are not the server's evidence
        dk = probes.get("disk")
        if dk is not None and dk.ok:
            devs = P.whole_devices(dk.data["devices"])
            if self.target.disk and self.target.disk in dk.data["devices"]:
                devs[self.target.disk] = dk.data["devices"][self.target.disk]
            if self._prev_disk is not None and dt:
                rates = {n: (v["read_bytes"] - self._prev_disk[n]["read_bytes"]) / dt / 1e6
                         for n, v in devs.items() if n in self._prev_disk}
                dk.data["read_mb_s"] = {n: round(r, 2) for n, r in rates.items() if r > 0}
                if self.target.disk:
                    r = rates.get(self.target.disk)
                    if r is not None:           # a device the host does not list: said once at start
                        parts.append(f"disk {self.target.disk} {r:.1f} MB/s")
                else:
                    top = sorted(dk.data["read_mb_s"].items(), key=lambda kv: -kv[1])[:2]
                    parts.append("disk " + (", ".join(f"{n} {r:.1f} MB/s" for n, r in top) + " (not counted)"
                                            if top else "idle"))
            self._prev_disk = devs
            dk.data["devices"] = {}         # raw counters are large; the per-device rates above are the evidence
        # gpu: the tree's processes when it is known, else the machine's
        g = probes.get("gpu")
        if g is not None and g.ok and g.data.get("present"):
            gs = g.data["gpus"]
            if g.data.get("tree_mem_mb") is not None:
                used = [x for x in gs if x["uuid"] in set(g.data.get("tree_gpus", ()))]
                parts.append(f"gpu {g.data['tree_mem_mb'] / 1024:.1f} GiB on {len(used)} GPU(s) "
                             f"util {max([(x['util_pct'] or 0) for x in used] or [0]):.0f}%")
            else:
                parts.append(f"gpu {sum(x['mem_used_mb'] for x in gs) / 1024:.1f}/"
                             f"{sum(x['mem_total_mb'] for x in gs) / 1024:.0f} GiB "
                             f"util {max((x['util_pct'] or 0) for x in gs):.0f}% (machine)")
        # log
        lg = probes.get("log")
        if lg is not None and lg.ok:
            if "active" in lg.data:
                if lg.data["active"]:           # no systemd / no such unit: said once at start
                    parts.append(f"unit {lg.data['active']}/{lg.data['sub']}")
            elif lg.data.get("exists"):
                grew = lg.data["size"] - self._prev_log_size if self._prev_log_size is not None else 0
                parts.append(f"log +{grew} B" if grew else f"log silent {time.time() - lg.data['mtime']:.0f} s")
                self._prev_log_size = lg.data["size"]
        head = f"{elapsed:6.1f}s {j.verdict:<11}"
        return head + " " + " | ".join(parts) + f" | {j.reason}"

    def evidence_note(self) -> str:
        """What this watch can attribute to the server (said once, in the first line); see evidence.py."""
        return evidence_note(self.target, self._missing, self._local_port())

    # -- the loop --------------------------------------------------------------------------------------
    def run(self) -> Dict[str, Any]:
        self._missing = check_evidence(self.host, self.target, self.timeout + 1.0)   # ConfigError: no such pid
        t_start = time.monotonic()
        local = getattr(self.host, "kind", "local") == "local"
        judge = Judge(self.window, self.deadline_s, t_start, local=local)
        base = self.history.baseline() if self.history is not None else {"starts": 0}
        hist_line = (f"{base['starts']} earlier cold start(s), usually ready after {base['to_ready_s']:.1f} s"
                     if base.get("starts") and base.get("to_ready_s") else "no earlier cold starts recorded")
        self.echo(f"watching {self.target.url or '(the engine URL, once its status says)'} on "
                  f"{getattr(self.host, 'label', 'local')} (every {self.interval_s:g} s, stall window {self.window:g} s, "
                  f"deadline {self.deadline_s:g} s); {self.evidence_note()}; {hist_line}")
        jsonl = self.out_dir / "health.jsonl" if self.out_dir else None
        if jsonl:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            jsonl.write_text("")
        verdict, reason = "STALLED", "interrupted"
        try:
            settled = False
            while not settled:
                t_sample = time.monotonic()
                for s in self.sample(judge, t_start):
                    self.samples.append(s)
                    if s.get("found"):
                        self.echo(s["found"])
                    self.echo(s["line"])
                    if jsonl:
                        with open(jsonl, "a") as f:
                            f.write(json.dumps(s, default=str) + "\n")
                    if s["terminal"]:
                        verdict, reason, settled = s["verdict"], s["reason"], True
                if not settled:
                    time.sleep(max(0.0, self.interval_s - (time.monotonic() - t_sample)))
        except KeyboardInterrupt:
            verdict, reason = "INTERRUPTED", "interrupted by the user"
        return self._finish(verdict, reason, time.monotonic() - t_start, base)

    def _finish(self, verdict: str, reason: str, seconds: float, base: Dict[str, Any]) -> Dict[str, Any]:
        phases, to_ready = self._phases(verdict)
        cmp = compare(phases, to_ready, base) if verdict == "READY" else {"starts": base.get("starts", 0)}
        if self.history is not None and verdict != "INTERRUPTED":
            self.history.record(verdict, phases, to_ready, url=self.target.url)
        summary = {"verdict": verdict, "exit_code": EXIT_CODES.get(verdict, 130), "reason": reason,
                   "url": self.target.url, "host": getattr(self.host, "label", "local"),
                   "seconds": round(seconds, 3), "phases": phases, "to_ready_s": to_ready, "history": cmp,
                   "samples": self.samples}
        if self.out_dir:
            tmp = self.out_dir / ".health.json.tmp"
            tmp.write_text(json.dumps(summary, indent=1, default=str))
            tmp.replace(self.out_dir / "health.json")
        tail = f"; {cmp['line']}" if cmp.get("line") else ""
        self.echo(f"{verdict}: {reason} ({seconds:.1f} s){tail}")
        return summary

    def _phases(self, verdict: str):
        """Phase durations of this start (engine-reported when kdtree, else monitor-observed) and time to ready."""
        snap = self._last_status
        if isinstance(snap, dict) and snap.get("phases"):
            ph = snap["phases"]
            phases = {p: float(v["seconds"]) for p, v in ph.items() if "seconds" in v}
            to_ready = None
            if "ready" in ph and snap.get("started_at"):
                to_ready = round(ph["ready"]["started_at"] - snap["started_at"], 3)
            return phases, to_ready
        obs = self._observed
        phases = {}
        if "port_open" in obs:
            phases["port_closed"] = round(obs["port_open"], 3)
            if "ready" in obs:
                phases["not_ready"] = round(obs["ready"] - obs["port_open"], 3)
        to_ready = obs.get("ready") if verdict == "READY" else None
        pr = self.samples[-1]["probes"].get("process") if self.samples else None
        if to_ready is not None and pr and pr.get("ok") and pr["data"].get("elapsed_s"):
            to_ready = pr["data"]["elapsed_s"]          # from the server's own start, not the monitor's
        return phases, to_ready


class HealthError(Exception):
    """The monitor settled on something other than READY; carries the verdict and the process exit code."""

    def __init__(self, summary: Dict[str, Any]):
        self.verdict, self.exit_code = summary["verdict"], summary["exit_code"]
        super().__init__(f"{summary['verdict']}: {summary['reason']} after {summary['seconds']:.1f} s "
                         f"(evidence: health.json)")


def history_for(cfg, url: str = "") -> History:
    """Cold starts are comparable when host, model, checkpoint, quant, tp and backend match (+ the URL
    for servers this run did not start)."""
    fields = {"host": f"{cfg.host.name}:{cfg.host.address}", "model": cfg.model.name, "path": cfg.model.path,
              "quant": cfg.quant.method, "tp": cfg.tp.size, "backend": cfg.backend.name, "tree": cfg.tree.kind}
    if url:
        fields = {"host": f"{cfg.host.name}:{cfg.host.address}", "url": url, "model": cfg.health.model}
    return History(cache_dir(cfg), fields)


def watch(cfg, host, target: Target, out_dir: Path, history: Optional[History]) -> Dict[str, Any]:
    """Run the monitor with health.* settings; the summary on READY, HealthError otherwise."""
    h = cfg.health
    w = Watcher(host, target, interval_s=h.interval_s, stall_window_s=h.stall_window_s, deadline_s=h.deadline_s,
                probe_timeout_s=h.probe_timeout_s, history=history, out_dir=out_dir)
    summary = w.run()
    if summary["verdict"] == "INTERRUPTED":
        raise KeyboardInterrupt
    if summary["verdict"] != "READY":
        raise HealthError(summary)
    return {k: summary[k] for k in ("verdict", "seconds", "to_ready_s", "phases", "url")} | \
        {"history": summary["history"].get("line"), "samples": len(summary["samples"])}
