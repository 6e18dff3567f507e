"""Probes: ONE shell command per sample, run through the host connection (kdtree.hosts) under one deadline, that
gathers every probe and prints it in sections; a parser per section. A sample never raises: a timeout, a refused
port or an unreachable host is a ProbeResult too, so "SSH is slow" (the sample's command timed out) is never
confused with "the server does not answer" (curl timed out inside a sample that came back).

    completion   POST /v1/completions {"model"?, "prompt": "2+2=", "max_tokens": 4, "temperature": 0} via curl
    models       GET /v1/models (the served model's id, when health.model is not given)
    status       GET /status (kdtree's engine; absent on other servers) and/or cat status.json
    process      the server's process TREE (descendants of the pid, by ppid; not its process group): per process
                 /proc/PID stat (state, CPU, faults), VmRSS and io (read_bytes counts mmap page-ins from disk)
    disk         /proc/diskstats (bytes read per device; progress only for the device named by health.disk)
    gpu          nvidia-smi per GPU and per process (compute apps), when nvidia-smi exists
    log          engine log size/mtime/last lines, or systemctl + journalctl for a unit

The HTTP probes run in the background of the script so /proc is read when the sample starts, not after a frozen
server's curl gave up. The API key reaches curl through the script's stdin (never a command line). The User-Agent
kdtree-monitor tells kdtree's server not to access-log the probes (their lines would read as log growth).
"""
from __future__ import annotations

import json
import shlex
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from kdtree.errors import HostError
from kdtree.monitor.finder import find_script, take_found

PROMPT = "2+2="
BODY_HEAD = 160                        # characters of an error body shown in the evidence line


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


@dataclass
class SampleSpec:
    """What one sample asks the host."""
    url: str = ""                    # base URL as seen from the host; "" = no HTTP probes yet
    model: str = ""                  # "" = completion without `model`, and GET /v1/models to learn the id
    pid: int = 0                     # root of the watched process tree; 0 = from pidfile, else no process probe
    pidfile: str = ""
    port_owner: int = 0              # no pid: the process listening on this TCP port of the host, else one whose
                                     # command line names it, is the root (finder.py; 0 = no)
    status_path: str = ""
    log: str = ""
    unit: str = ""
    unit_user: bool = False
    gpu: bool = True
    http_timeout_s: float = 5.0      # curl --max-time of status/models
    completion_timeout_s: float = 5.0

    def names(self) -> List[str]:
        out = ["completion"]
        if self.url and not self.model:
            out.append("models")
        out += ["status", "disk"]
        if self.pid or self.pidfile or self.port_owner:
            out.append("process")
        if self.gpu:
            out.append("gpu")
        if self.unit or self.log:
            out.append("log")
        return out


# -- the script ----------------------------------------------------------------------------------------------
# curl exit codes that tell the port's state apart
CURL_REFUSED, CURL_TIMEOUT, CURL_EMPTY, CURL_RESOLVE = 7, 28, 52, 6

_PRELUDE = r"""# kdtree monitor sample
IFS= read -r KD_KEY || true
D=$(mktemp -d 2>/dev/null) || { D=/tmp/kd-probe.$$; mkdir -p "$D"; }
trap 'rm -rf "$D"' EXIT
kd_mark() { echo "@@kd $1 $(date +%s.%N)"; }
kd_hdr() { if [ -n "$KD_KEY" ]; then printf 'Authorization: Bearer %s\n' "$KD_KEY"; else printf '\n'; fi; }
kd_http() {  # name max_time url [json body]
  ( s=$(date +%s.%N)
    if [ -n "$4" ]; then
      kd_hdr | curl -sS -o "$D/$1.body" -w '%{http_code} %{time_connect}' --max-time "$2" -A kdtree-monitor -H @- \
        -H 'Content-Type: application/json' --data-binary "$4" "$3" >"$D/$1.w" 2>"$D/$1.err"
    else
      kd_hdr | curl -sS -o "$D/$1.body" -w '%{http_code} %{time_connect}' --max-time "$2" -A kdtree-monitor -H @- "$3" \
        >"$D/$1.w" 2>"$D/$1.err"
    fi
    echo "$? $s $(date +%s.%N)" >"$D/$1.rc" ) &
}
kd_show() {
  [ -f "$D/$1.rc" ] || return 0
  echo "@@http $1"; cat "$D/$1.rc"; printf '%s\n' "$(cat "$D/$1.w" 2>/dev/null)"
  printf '%s\n' "$(tail -n 1 "$D/$1.err" 2>/dev/null)"; head -c 4000 "$D/$1.body" 2>/dev/null; echo
}
"""

# Descendants of $P by ppid (one pass over every /proc/*/stat; the comm may hold spaces and parentheses, so
# everything up to the LAST ") " is cut first), then each member's stat, RSS and io.
_PROCESS_SH = r"""kd_mark process
[ -n "$KD_FOUND" ] && echo "found $KD_FOUND $(tr '\0' ' ' </proc/$P/cmdline 2>/dev/null | head -c 200)"
if ! [ "$P" -gt 0 ] 2>/dev/null; then
  echo "NOPID"
elif [ -r /proc/$P/stat ]; then
  echo "pid $P"; cat /proc/uptime; getconf CLK_TCK
  for q in $(cat /proc/[0-9]*/stat 2>/dev/null | awk -v root="$P" '{p=$1; sub(/^.*\) /, ""); pp[p]=$2}
      END {t[root]=1; do {c=0; for (x in pp) if (!(x in t) && (pp[x] in t)) {t[x]=1; c=1}} while (c);
           for (x in t) print x}'); do
    echo "## $q"; cat /proc/$q/stat 2>/dev/null; grep -E '^VmRSS' /proc/$q/status 2>/dev/null
    cat /proc/$q/io 2>/dev/null
  done
else
  echo "GONE $P"
fi
"""

_GPU_SH = r"""kd_mark gpu
if command -v nvidia-smi >/dev/null 2>&1; then
  T=""; command -v timeout >/dev/null 2>&1 && T="timeout 5"
  $T nvidia-smi --query-gpu=index,uuid,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits
  echo "@@apps"
  $T nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits
else
  echo ABSENT
fi
"""


def completion_body(model: str) -> Dict[str, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    if not model:
        body.pop("model")                  # as an operator's curl would: the server's only model
    return body


def sample_script(spec: SampleSpec) -> str:
    q = shlex.quote
    parts = [_PRELUDE]
    if spec.url:
        base = spec.url.rstrip("/")
        parts.append(f"kd_http completion {spec.completion_timeout_s:g} {q(base + '/v1/completions')} "
                     f"{q(json.dumps(completion_body(spec.model)))}")
        if not spec.model:
            parts.append(f"kd_http models {spec.http_timeout_s:g} {q(base + '/v1/models')}")
        parts.append(f"kd_http status {spec.http_timeout_s:g} {q(base + '/status')}")
    if spec.pid or spec.pidfile or spec.port_owner:
        parts.append(f"P={int(spec.pid)}; KD_FOUND=")
        if not spec.pid and spec.pidfile:
            parts.append(f"P=$(cat {q(spec.pidfile)} 2>/dev/null); P=${{P:-0}}")
        if not spec.pid and spec.port_owner:
            parts.append(find_script(spec.port_owner))
        parts.append(_PROCESS_SH)
    parts.append("kd_mark disk; cat /proc/diskstats")
    if spec.gpu:
        parts.append(_GPU_SH)
    if spec.unit:
        scope = "--user " if spec.unit_user else ""
        u = q(spec.unit)
        parts.append(f"kd_mark log; systemctl {scope}show -p ActiveState,SubState,MainPID,Result {u}; echo @@; "
                     f"journalctl {scope}-u {u} -n 1 -o short-unix --no-pager 2>/dev/null; true")
    elif spec.log:
        f = q(spec.log)
        parts.append(f"kd_mark log; stat -c '%s %Y' {f} 2>/dev/null || echo MISSING; tail -n 5 {f} 2>/dev/null")
    if spec.status_path:
        parts.append(f"kd_mark statusfile; cat {q(spec.status_path)} 2>/dev/null")
    parts.append("kd_mark wait; wait")
    parts += ["kd_show completion", "kd_show models", "kd_show status", "kd_mark end"]
    return "\n".join(parts) + "\n"


def run_sample(host, spec: SampleSpec, api_key: str, deadline_s: float, out_stream=None) -> Dict[str, ProbeResult]:
    """Every probe of one sample: one host command, `deadline_s` for all of it (connect included). `out_stream`
    sees the output as it arrives (the watcher tells "host silent" from "a slow curl" by its first byte)."""
    t0 = time.monotonic()
    try:
        r = host.shell(sample_script(spec), timeout=deadline_s, stdin=f"{api_key}\n", out_stream=out_stream)
    except HostError as e:
        # also when part of the output came: curl gives up by its --max-time and the deadline leaves room for the
        # shell beyond it, so a sample past its deadline means the host (or the connection) stopped answering
        return failed_sample(spec, str(e), time.monotonic() - t0)
    return parse_sample(spec, r.stdout, time.monotonic() - t0)


def failed_sample(spec: SampleSpec, error: str, seconds: float) -> Dict[str, ProbeResult]:
    timed_out = "timed out" in error
    return {n: ProbeResult(n, False, seconds, timed_out=timed_out, unreachable=not timed_out, error=error)
            for n in spec.names()}


# -- parsing ---------------------------------------------------------------------------------------------------
def _sections(stdout: str) -> Tuple[Dict[str, Tuple[float, float, str]], Dict[str, str]]:
    """{'disk': (t_start, t_end, text)} from the @@kd marks (host clock) and {'completion': raw} of @@http."""
    marks: List[Tuple[str, float, int, int]] = []      # name, t, start of text, start of the mark line
    http: Dict[str, str] = {}
    pos = 0
    lines = stdout.splitlines(keepends=True)
    http_name, http_buf = None, []
    for line in lines:
        if line.startswith("@@kd "):
            if http_name:
                http[http_name] = "".join(http_buf)
                http_name = None
            _, name, t = (line.split() + ["0"])[:3]
            try:
                marks.append((name, float(t), pos + len(line), pos))
            except ValueError:
                marks.append((name, 0.0, pos + len(line), pos))
        elif line.startswith("@@http "):
            if http_name:
                http[http_name] = "".join(http_buf)
            http_name, http_buf = line.split()[1], []
        elif http_name:
            http_buf.append(line)
        pos += len(line)
    if http_name:
        http[http_name] = "".join(http_buf)
    out = {}
    for i, (name, t, start, _) in enumerate(marks):
        end_t, end_pos = (marks[i + 1][1], marks[i + 1][3]) if i + 1 < len(marks) else (t, len(stdout))
        out[name] = (t, end_t, stdout[start:end_pos])
    return out, http


def parse_sample(spec: SampleSpec, stdout: str, seconds: float) -> Dict[str, ProbeResult]:
    secs, http = _sections(stdout)
    results: Dict[str, ProbeResult] = {}

    def parsed(name: str, text: str, dt: float, parse, **extra) -> ProbeResult:
        try:
            return ProbeResult(name, True, round(dt, 4), data=parse(text, **extra))
        except Exception as e:   # a parser bug or odd output is evidence too, not a crash of the monitor
            return ProbeResult(name, False, round(dt, 4),
                               error=f"unparsable output ({type(e).__name__}: {e}): {text[:200]!r}")

    for name, fn in (("process", _parse_process), ("disk", _parse_diskstats), ("gpu", _parse_gpu)):
        if name in secs:
            t, t_end, text = secs[name]
            results[name] = parsed(name, text, t_end - t, fn)
    if "log" in secs:
        t, t_end, text = secs["log"]
        results["log"] = parsed("log", text, t_end - t, _parse_unit if spec.unit else _parse_log_file)
    # HTTP: seconds = curl's own duration (host clock)
    for name in ("completion", "models"):
        if name in http:
            rc_line = http[name].split("\n", 1)[0].split()
            dt = float(rc_line[2]) - float(rc_line[1]) if len(rc_line) >= 3 else seconds
            timeout = spec.completion_timeout_s if name == "completion" else spec.http_timeout_s
            results[name] = parsed(name, http[name], dt, _parse_completion if name == "completion" else _parse_models,
                                   timeout_s=timeout)
    status_text = http.get("status", "")
    file_text = secs["statusfile"][2] if "statusfile" in secs else ""
    results["status"] = parsed("status", status_text, 0.0, _parse_status, file_text=file_text)
    if not spec.url:
        results["completion"] = ProbeResult("completion", True, 0.0,
                                            data={"port": "unknown (no status yet)", "answered": False})
    for n in spec.names():             # a section the script never reached (killed half-way) is a failure
        results.setdefault(n, ProbeResult(n, False, seconds, error="no output (the sample script ended early)"))
    return {n: results[n] for n in spec.names()}


def _http_fields(raw: str, timeout_s: float) -> Dict[str, Any]:
    """{'http': code | None, 'port': open|refused|timeout|unresolved|..., 'body': JSON or text, 'detail'}"""
    rc_line, w_line, err_line, body = (raw.split("\n", 3) + ["", "", "", ""])[:4]
    rc = int(rc_line.split()[0])
    code_s, _, connect_s = w_line.strip().partition(" ")
    code = int(code_s) if code_s.isdigit() and int(code_s) > 0 else None
    body = body[:-1] if body.endswith("\n") else body
    if rc != 0:
        connected = _float(connect_s) > 0
        if rc == CURL_TIMEOUT and connected:       # connected, then no answer in time: slow, not closed
            return {"http": None, "port": "open", "slow": True, "detail": f"no answer within {timeout_s:g} s"}
        port = {CURL_REFUSED: "refused", CURL_TIMEOUT: "timeout", CURL_EMPTY: "empty_reply",
                CURL_RESOLVE: "unresolved"}.get(rc, f"curl_exit_{rc}")
        return {"http": None, "port": port, "detail": err_line.strip()[:200]}
    try:
        parsed: Any = json.loads(body)
    except ValueError:
        parsed = body[:500]
    return {"http": code, "port": "open", "body": parsed}


def _float(s: str) -> float:
    try:
        return float(s)
    except ValueError:
        return 0.0


def error_message(body: Any) -> str:
    """The start of an error body: OpenAI's error.message, FastAPI's detail, or the text itself."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:BODY_HEAD]
        if isinstance(err, str):
            return err[:BODY_HEAD]
        if "detail" in body:
            return str(body["detail"])[:BODY_HEAD]
        return json.dumps(body)[:BODY_HEAD]
    return " ".join(str(body).split())[:BODY_HEAD]


def _parse_completion(raw: str, timeout_s: float) -> Dict[str, Any]:
    d = _http_fields(raw, timeout_s)
    b = d.pop("body", None)
    if d["http"] == 200 and isinstance(b, dict) and b.get("choices"):
        d["text"] = b["choices"][0].get("text")
        d["answered"] = True
    else:
        d["answered"] = False
        if d["http"] is not None and b not in (None, ""):
            d["message"] = error_message(b)
    return d


def _parse_models(raw: str, timeout_s: float) -> Dict[str, Any]:
    d = _http_fields(raw, timeout_s)
    b = d.pop("body", None)
    if d["http"] == 200 and isinstance(b, dict) and b.get("data"):
        d["model"] = str(b["data"][0].get("id", ""))
    return d


def _parse_status(raw: str, file_text: str) -> Dict[str, Any]:
    d: Dict[str, Any] = {"source": None, "status": None, "http": None}
    if raw:
        h = _http_fields(raw, 0)
        d["http"] = h["http"]
        if h["http"] == 200 and isinstance(h.get("body"), dict):
            d["status"], d["source"] = h["body"], "http"
    if d["source"] is None and file_text.strip():
        try:
            d["status"], d["source"] = json.loads(file_text), "file"
        except ValueError:
            pass
    return d


def _parse_diskstats(text: str) -> Dict[str, Any]:
    devs = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) < 10 or f[2].startswith(("ram", "zram", "loop")):
            continue
        devs[f[2]] = {"read_bytes": int(f[5]) * 512, "write_bytes": int(f[9]) * 512}   # 512-byte sectors
    return {"devices": devs}


def whole_devices(devs: Dict[str, Any]) -> Dict[str, Any]:
    """Partitions (sda1, nvme0n1p2) double-count their disk: whole devices only."""
    names = set(devs)
    return {n: v for n, v in devs.items()
            if not any(n != p and n.startswith(p) and n[len(p):].lstrip("p").isdigit() for p in names)}


def _parse_process(text: str) -> Dict[str, Any]:
    lines = text.splitlines()
    found = take_found(lines)
    if found and lines and lines[0].startswith("GONE"):     # found, then gone before it was read: not found
        return {"pid": 0, "alive": None, "state": "unknown", "procs": {}}
    return dict(_parse_tree(lines), found=found) if found else _parse_tree(lines)


def _parse_tree(lines: List[str]) -> Dict[str, Any]:
    if lines and lines[0].startswith("NOPID"):             # no pidfile yet / nothing listens on the port yet
        return {"pid": 0, "alive": None, "state": "unknown", "procs": {}}
    if not lines or lines[0].startswith("GONE"):
        pid = int(lines[0].split()[1]) if lines and len(lines[0].split()) > 1 else 0
        return {"pid": pid, "alive": False, "state": "gone", "procs": {}}
    pid = int(lines[0].split()[1])
    uptime = float(lines[1].split()[0])
    hz = int(lines[2])
    procs: Dict[int, Dict[str, Any]] = {}
    cur = None
    for line in lines[3:]:
        if line.startswith("## "):
            q = int(line[3:])
            cur = None if q in procs else procs.setdefault(q, {"pid": q})
        elif cur is not None and ") " in line and "state" not in cur:
            rest = line.rsplit(") ", 1)[1].split()
            # /proc/PID/stat fields after the comm: state(0) ppid(1) pgrp(2) ... minflt(7) majflt(9) utime(11)
            # stime(12) ... starttime(19)
            cur.update(state=rest[0], ppid=int(rest[1]), faults=int(rest[7]) + int(rest[9]),
                       cpu_s=(int(rest[11]) + int(rest[12])) / hz, start=int(rest[19]),
                       elapsed_s=round(uptime - int(rest[19]) / hz, 2))
        elif cur is not None and line.startswith("VmRSS:"):
            cur["rss_bytes"] = int(line.split()[1]) * 1024
        elif cur is not None and ":" in line:
            k, _, v = line.partition(":")
            if k in ("rchar", "read_bytes"):
                cur[k] = int(v)
    procs = {q: p for q, p in procs.items() if "state" in p}
    main = procs.get(pid, {})
    state = main.get("state", "gone")
    return {"pid": pid, "alive": state not in ("Z", "X", "gone"), "state": state,
            "elapsed_s": main.get("elapsed_s"), "procs": procs}


def _parse_gpu(text: str) -> Dict[str, Any]:
    if text.startswith("ABSENT"):
        return {"present": False}
    gpu_text, _, apps_text = text.partition("@@apps\n")
    gpus, apps = [], []
    for line in gpu_text.strip().splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) >= 5 and f[0].isdigit():
            gpus.append({"index": int(f[0]), "uuid": f[1], "mem_used_mb": _float(f[2]), "mem_total_mb": _float(f[3]),
                         "util_pct": _float(f[4]) if f[4].replace(".", "").isdigit() else None})
    for line in apps_text.strip().splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) >= 3 and f[0].isdigit():
            apps.append({"pid": int(f[0]), "uuid": f[1], "mem_mb": _float(f[2])})
    if not gpus:
        raise ValueError(text.strip()[:200] or "nvidia-smi printed nothing")
    return {"present": True, "gpus": gpus, "apps": apps}


def _parse_log_file(text: str) -> Dict[str, Any]:
    first, _, tail = text.partition("\n")
    if first.startswith("MISSING"):
        return {"exists": False}
    size, mtime = first.split()
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    # the line that explains a crash is rarely the very last one ("engine exit code=1")
    telling = [ln for ln in lines if any(w in ln.lower() for w in ("error", "fail", "traceback", "killed"))]
    return {"exists": True, "size": int(size), "mtime": float(mtime),
            "last_line": (telling or lines or [""])[-1][-200:]}


def _parse_unit(text: str) -> Dict[str, Any]:
    """systemd unit state + its last journal line (log silence for services)."""
    head, _, journal = text.partition("@@\n")
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


# -- the process tree over time ---------------------------------------------------------------------------------
# loaded = max(read_bytes, rchar) per process: the bytes it brought in, from disk (mmap page-ins count) or through
# read() from the page cache, whichever is larger (a read() from disk counts in both)
COUNTERS = ("read_bytes", "rchar", "loaded", "cpu_s", "faults")


class ProcessTree:
    """Monotone totals of the tree's counters. Each process (pid + start time, so a reused pid is a new one) adds
    what it did since the previous sample; a process that appears adds all it did since it started; one that
    leaves the tree is noted and keeps what it contributed (its counters leaving never makes a rate negative)."""

    def __init__(self):
        self.seen: Dict[Tuple[int, int], Dict[str, float]] = {}
        self.totals: Dict[str, float] = {k: 0.0 for k in COUNTERS}

    def account(self, data: Dict[str, Any]) -> None:
        """Replaces data['procs'] by the totals, members, left (pids gone since the last sample), rss_bytes."""
        procs = data.pop("procs", None) or {}
        live = {(q, int(p.get("start", 0))): p for q, p in procs.items() if p.get("state") not in ("Z", "X")}
        for p in live.values():
            if "rchar" in p:
                p["loaded"] = max(p.get("read_bytes", 0), p["rchar"])
        for key, p in live.items():
            before = self.seen.get(key, {})
            for k in COUNTERS:
                if k in p:
                    self.totals[k] += max(0.0, float(p[k]) - float(before.get(k, 0.0)))
        left = sorted(q for (q, _) in set(self.seen) - set(live))
        self.seen = {key: {k: p[k] for k in COUNTERS if k in p} for key, p in live.items()}
        data.update({k: round(v, 2) if k == "cpu_s" else int(v) for k, v in self.totals.items()})
        data.update(members=sorted(q for q, _ in live), left=left,
                    io_readable=bool(live) and all("rchar" in p for p in live.values()),
                    rss_bytes=sum(p.get("rss_bytes", 0) for p in live.values()))


def read_checkpoint_total(host, checkpoint: str, timeout_s: float) -> Optional[int]:
    """Size of a checkpoint on the host (bytes): the index's metadata.total_size, else the directory's size."""
    q = shlex.quote(checkpoint.rstrip("/"))
    script = (f"cat {q}/model.safetensors.index.json 2>/dev/null || echo '{{}}'; echo; echo @@du; "
              f"du -sb {q} 2>/dev/null | cut -f1")
    try:
        r = host.shell(script, timeout=timeout_s, stdin="")
    except HostError:
        return None
    index, _, du = r.stdout.partition("@@du\n")
    try:
        total = int(json.loads(index)["metadata"]["total_size"])
        if total > 0:
            return total
    except (ValueError, KeyError, TypeError):
        pass
    return int(du.strip()) if du.strip().isdigit() and int(du.strip()) > 0 else None
