"""Probes: each one shell command run through the host connection (kdtree.hosts), with its own timeout, and a
parser. A probe never raises: a timeout, a refused port or an unreachable host is a ProbeResult too, so
"SSH is slow" (host command timed out) is never confused with "the server does not answer" (curl timed out).

    completion   POST /v1/completions {"model", "prompt": "2+2=", "max_tokens": 4, "temperature": 0} via curl
    status       GET /status (kdtree's engine; absent on other servers) and/or cat status.json
    disk         /proc/diskstats (sectors read per device; the monitor turns them into MB/s)
    process      /proc/PID stat/status/io of the engine and its process group (TP ranks)
    gpu          nvidia-smi memory/utilisation, when nvidia-smi exists
    log          engine log size/mtime/last line, or systemctl + journalctl for a unit
"""
from __future__ import annotations

import json
import shlex
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional

from kdtree.errors import HostError

PROMPT = "2+2="


@dataclass
class ProbeResult:
    name: str
    ok: bool                         # the command ran and its output parsed
    seconds: float                   # wall time of the probe, timeouts included
    timed_out: bool = False          # the host command itself did not return in time (ssh slow / host stuck)
    unreachable: bool = False        # the host connection failed (not a timeout of the command)
    error: str = ""
    data: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _run(host, name: str, script, timeout_s: float, parse) -> ProbeResult:
    """script: a command line, or (command line, stdin text)."""
    script, stdin = script if isinstance(script, tuple) else (script, None)
    t0 = time.monotonic()
    try:
        r = host.shell(script, timeout=timeout_s, **({"stdin": stdin} if stdin is not None else {}))
    except HostError as e:
        msg = str(e)
        timed_out = "timed out" in msg
        return ProbeResult(name, False, time.monotonic() - t0, timed_out=timed_out, unreachable=not timed_out,
                           error=msg)
    seconds = time.monotonic() - t0
    try:
        data = parse(r)
    except Exception as e:  # a parser bug or odd output is evidence too, not a crash of the monitor
        return ProbeResult(name, False, seconds, error=f"unparsable output ({type(e).__name__}: {e}): "
                                                      f"{(r.stdout or r.stderr)[:200]!r}")
    return ProbeResult(name, True, seconds, data=data)


# -- HTTP (curl on the host: exactly what an operator would type) ------------------------------------------
# curl exit codes that tell the port's state apart
CURL_REFUSED, CURL_TIMEOUT, CURL_EMPTY, CURL_RESOLVE = 7, 28, 52, 6


def _curl(url: str, timeout_s: float, body: Optional[dict] = None, api_key: str = ""):
    """The curl command line; with a key, (command line, stdin): curl reads the Authorization header from stdin
    (-H @-) so the key is never an argument that `ps` shows. The User-Agent tells kdtree's server not to
    access-log the probe (its lines would read as log growth)."""
    argv = ["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", "--max-time", f"{timeout_s:g}", "-A", "kdtree-monitor"]
    if body is not None:
        argv += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    if api_key:
        argv += ["-H", "@-"]
    cmd = " ".join(shlex.quote(a) for a in argv + [url])
    return (cmd, f"Authorization: Bearer {api_key}\n") if api_key else cmd


def _http_parse(r) -> Dict[str, Any]:
    """{'http': code | None, 'body': parsed JSON or text, 'port': open|refused|timeout|...}"""
    if r.returncode != 0:
        port = {CURL_REFUSED: "refused", CURL_TIMEOUT: "timeout", CURL_EMPTY: "empty_reply",
                CURL_RESOLVE: "unresolved"}.get(r.returncode, f"curl_exit_{r.returncode}")
        return {"http": None, "port": port, "detail": (r.stderr.strip().splitlines() or [""])[-1][:200]}
    text, _, code = r.stdout.rpartition("\n")
    try:
        body: Any = json.loads(text)
    except ValueError:
        body = text[:500]
    return {"http": int(code) if code.isdigit() else None, "port": "open", "body": body}


def probe_completion(host, url: str, model: str, timeout_s: float, api_key: str = "") -> ProbeResult:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    if not model:
        body.pop("model")

    def parse(r):
        d = _http_parse(r)
        b = d.get("body")
        if d["http"] == 200 and isinstance(b, dict) and b.get("choices"):
            d["text"] = b["choices"][0].get("text")
            d["answered"] = True
            d.pop("body")
        else:
            d["answered"] = False
            if isinstance(b, dict) and isinstance(b.get("error"), dict):
                d["message"] = str(b["error"].get("message", ""))[:200]
        return d

    return _run(host, "completion", _curl(url.rstrip("/") + "/v1/completions", timeout_s, body, api_key),
                timeout_s + 5, parse)


def probe_models(host, url: str, timeout_s: float, api_key: str = "") -> ProbeResult:
    """GET /v1/models: the served model's name, for servers this run did not start."""
    def parse(r):
        d = _http_parse(r)
        b = d.pop("body", None)
        if d["http"] == 200 and isinstance(b, dict) and b.get("data"):
            d["model"] = b["data"][0].get("id", "")
        return d

    return _run(host, "models", _curl(url.rstrip("/") + "/v1/models", timeout_s, None, api_key), timeout_s + 5, parse)


def probe_status(host, url: str, timeout_s: float, status_path: str = "") -> ProbeResult:
    """kdtree's /status; falls back to reading status.json (a frozen server still has its last file)."""
    parts = []
    if url:
        parts.append(_curl(url.rstrip("/") + "/status", timeout_s))
    else:
        parts.append("false")
    script = parts[0] + "; echo; echo @@FILE"
    if status_path:
        script += f"; cat {shlex.quote(status_path)} 2>/dev/null; true"

    def parse(r):
        http_out, _, file_out = r.stdout.partition("@@FILE\n")
        d: Dict[str, Any] = {"source": None}
        http_text, _, code = http_out.rstrip("\n").rpartition("\n")
        if code.isdigit() and int(code) == 200:
            try:
                d["status"] = json.loads(http_text)
                d["source"] = "http"
            except ValueError:
                pass
        d["http"] = int(code) if code.isdigit() else None
        if d["source"] is None and file_out.strip():
            try:
                d["status"] = json.loads(file_out)
                d["source"] = "file"
            except ValueError:
                pass
        if d["source"] is None:
            d["status"] = None
        return d

    return _run(host, "status", script, timeout_s + 5, parse)


def probe_diskstats(host, timeout_s: float) -> ProbeResult:
    def parse(r):
        devs = {}
        for line in r.stdout.splitlines():
            f = line.split()
            if len(f) < 10 or f[2].startswith(("ram", "zram")):
                continue
            devs[f[2]] = {"read_bytes": int(f[5]) * 512, "write_bytes": int(f[9]) * 512}   # 512-byte sectors
        names = set(devs)
        # partitions (sda1, nvme0n1p2) double-count their disk: keep whole devices only
        whole = {n: v for n, v in devs.items()
                 if not any(n != p and n.startswith(p) and n[len(p):].lstrip("p").isdigit() for p in names)}
        return {"devices": whole}

    return _run(host, "disk", "cat /proc/diskstats", timeout_s, parse)


_PROC_SH = r"""P={pid}
[ -r /proc/$P/stat ] || {{ echo GONE; exit 0; }}
cat /proc/uptime; getconf CLK_TCK
for q in $P $(pgrep -g $P 2>/dev/null); do
  echo "## $q"; cat /proc/$q/stat 2>/dev/null; grep -E '^VmRSS' /proc/$q/status 2>/dev/null
  cat /proc/$q/io 2>/dev/null
done"""


def probe_process(host, pid: int, timeout_s: float) -> ProbeResult:
    """The engine process and its process group (the detached engine is a session leader; TP ranks join it)."""
    def parse(r):
        out = r.stdout
        if out.startswith("GONE"):
            return {"pid": pid, "alive": False, "state": "gone"}
        lines = out.splitlines()
        uptime = float(lines[0].split()[0])
        hz = int(lines[1])
        procs: Dict[int, Dict[str, Any]] = {}
        cur = None
        for line in lines[2:]:
            if line.startswith("## "):
                q = int(line[3:])
                cur = None if q in procs else procs.setdefault(q, {})
            elif cur is not None and ") " in line and "pid" not in cur:
                rest = line.rsplit(") ", 1)[1].split()
                # /proc/PID/stat fields after the comm: state ppid pgrp ... utime(14) stime(15) ... starttime(22)
                cur.update(pid=int(line.split(" ", 1)[0]), state=rest[0], cpu_s=(int(rest[11]) + int(rest[12])) / hz,
                           elapsed_s=round(uptime - int(rest[19]) / hz, 2))
            elif cur is not None and line.startswith("VmRSS:"):
                cur["rss_bytes"] = int(line.split()[1]) * 1024
            elif cur is not None and ":" in line:
                k, _, v = line.partition(":")
                if k in ("rchar", "read_bytes", "wchar", "write_bytes"):
                    cur[k] = int(v)
        main = procs.get(pid, {})
        state = main.get("state", "gone")
        alive = state not in ("Z", "X", "gone")
        group = [p for p in procs.values() if p.get("state") not in (None, "Z", "X")]
        d = {"pid": pid, "alive": alive, "state": state, "elapsed_s": main.get("elapsed_s"),
             "procs": len(group),
             "cpu_s": round(sum(p.get("cpu_s", 0.0) for p in group), 2),
             "rss_bytes": sum(p.get("rss_bytes", 0) for p in group),
             "io_readable": all("rchar" in p for p in group) and bool(group)}
        if d["io_readable"]:
            d["read_bytes"] = sum(p["read_bytes"] for p in group)
            d["rchar"] = sum(p["rchar"] for p in group)
        return d

    return _run(host, "process", _PROC_SH.format(pid=int(pid)), timeout_s, parse)


def probe_gpu(host, timeout_s: float) -> ProbeResult:
    script = ("command -v nvidia-smi >/dev/null 2>&1 || { echo ABSENT; exit 0; }; "
              "nvidia-smi --query-gpu=index,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits")

    def parse(r):
        if r.stdout.startswith("ABSENT"):
            return {"present": False}
        gpus = []
        for line in r.stdout.strip().splitlines():
            f = [x.strip() for x in line.split(",")]
            if len(f) >= 4 and f[0].isdigit():
                gpus.append({"index": int(f[0]), "mem_used_mb": float(f[1]), "mem_total_mb": float(f[2]),
                             "util_pct": float(f[3]) if f[3].replace(".", "").isdigit() else None})
        if not gpus and r.returncode != 0:
            raise ValueError((r.stderr or r.stdout).strip()[:200])
        return {"present": True, "gpus": gpus, "mem_used_mb": sum(g["mem_used_mb"] for g in gpus)}

    return _run(host, "gpu", script, timeout_s, parse)


def probe_log_file(host, path: str, timeout_s: float) -> ProbeResult:
    q = shlex.quote(path)
    script = f"stat -c '%s %Y' {q} 2>/dev/null || {{ echo MISSING; exit 0; }}; tail -n 5 {q}"

    def parse(r):
        first, _, tail = r.stdout.partition("\n")
        if first.startswith("MISSING"):
            return {"exists": False}
        size, mtime = first.split()
        lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
        # the line that explains a crash is rarely the very last one ("engine exit code=1")
        telling = [ln for ln in lines if any(w in ln.lower() for w in ("error", "fail", "traceback", "killed"))]
        return {"exists": True, "size": int(size), "mtime": float(mtime),
                "last_line": (telling or lines or [""])[-1][-200:]}

    return _run(host, "log", script, timeout_s, parse)


def probe_unit(host, unit: str, timeout_s: float, user: bool = False) -> ProbeResult:
    """systemd unit state + its last journal line (log silence for services)."""
    scope = "--user " if user else ""
    q = shlex.quote(unit)
    script = (f"systemctl {scope}show -p ActiveState,SubState,MainPID,Result {q}; echo @@; "
              f"journalctl {scope}-u {q} -n 1 -o short-unix --no-pager 2>/dev/null; true")

    def parse(r):
        head, _, journal = r.stdout.partition("@@\n")
        props = dict(line.split("=", 1) for line in head.strip().splitlines() if "=" in line)
        last = [ln for ln in journal.strip().splitlines() if ln and not ln.startswith("--")]
        stamp = None
        if last:
            try:
                stamp = float(last[-1].split()[0])
            except ValueError:
                stamp = None
        return {"active": props.get("ActiveState"), "sub": props.get("SubState"),
                "main_pid": int(props.get("MainPID") or 0), "result": props.get("Result"),
                "journal_at": stamp, "last_line": last[-1][-200:] if last else ""}

    return _run(host, "log", script, timeout_s, parse)


def read_checkpoint_total(host, checkpoint: str, timeout_s: float) -> Optional[int]:
    """metadata.total_size of <checkpoint>/model.safetensors.index.json on the host (bytes), if readable."""
    r = _run(host, "index", f"cat {shlex.quote(checkpoint.rstrip('/') + '/model.safetensors.index.json')}",
             timeout_s, lambda r: {"total": int(json.loads(r.stdout)["metadata"]["total_size"])})
    return r.data["total"] if r.ok else None
