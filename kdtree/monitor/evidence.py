"""What a watch can attribute to the server, checked ONCE before the first sample (one host command):

    missing = check_evidence(host, target, timeout_s)   # ConfigError: health.pid names no process
    note = evidence_note(target, missing, local_port)   # the first line's "evidence: ..." part

* health.pid that names no process is a mistake in the command, not a crash: a ConfigError at start ("no process
  999999 (health.pid)"), never a CRASHED verdict.
* A log file that does not exist (yet), a unit the host cannot know (no systemd, or no such unit) and a disk that
  /proc/diskstats does not list are said once, with why, in the first line; the unit and the disk are then left out
  of the samples (no `unit None/None`, no `disk nosuchdev ?`), and the log counts only once it appears.
"""
from __future__ import annotations

import shlex
from typing import Dict

from kdtree.errors import ConfigError, HostError


def _script(t, check_pid: bool) -> str:
    q = shlex.quote
    parts = []
    if check_pid:
        parts.append(f"[ -d /proc/{int(t.pid)} ] && echo 'pid ok' || echo 'pid missing'")
    if t.log and not t.unit:
        parts.append(f"[ -e {q(t.log)} ] && echo 'log ok' || echo 'log missing'")
    if t.unit:
        scope = "--user " if t.unit_user else ""
        parts.append(f"if command -v systemctl >/dev/null 2>&1; then echo \"unit $(systemctl {scope}show -p "
                     f"LoadState --value {q(t.unit)} 2>&1 | head -n 1)\"; else echo 'unit nosystemd'; fi")
    if t.disk:
        parts.append(f"awk -v d={q(t.disk)} '$3 !~ /^(loop|ram|zram)/ {{n = n \" \" $3}} $3 == d {{f = 1}} "
                     f"END {{print (f ? \"disk ok\" : \"disk missing\" n)}}' /proc/diskstats 2>/dev/null "
                     f"|| echo 'disk missing'")
    return "\n".join(parts)


def check_evidence(host, t, timeout_s: float) -> Dict[str, str]:
    """{"log" | "unit" | "disk": why it is missing}; drops a missing unit and disk from `t` (they would be
    reported as nothing every sample). `t.pid_source` (e.g. "health.pid") set: the pid must exist."""
    check_pid = bool(t.pid and getattr(t, "pid_source", ""))
    script = _script(t, check_pid)
    if not script:
        return {}
    label = getattr(host, "label", "the host")
    try:
        out = host.shell(script, timeout=timeout_s, stdin="").stdout
    except HostError:
        return {}                           # the host does not answer: the samples will say so
    got = dict((ln.split(" ", 1) + [""])[:2] for ln in out.splitlines() if ln.strip())
    if check_pid and got.get("pid") == "missing":
        raise ConfigError(f"no process {t.pid} ({t.pid_source}) on {label}: give the server's pid (as `pgrep -f "
                          f"<server>` or `systemctl show -p MainPID <unit>` print it), or leave {t.pid_source} unset "
                          f"to watch the process listening on the URL's port")
    missing = {}
    if got.get("log") == "missing":
        missing["log"] = (f"health.log={t.log}: no such file on {label} (yet); its growth counts once it appears")
    unit = got.get("unit")
    if unit is not None and unit != "loaded":
        why = ("systemctl not found: no systemd" if unit == "nosystemd" else
               "no such unit" if unit == "not-found" else f"systemctl says {unit[:120]!r}")
        missing["unit"] = f"health.unit={t.unit}: {why} on {label}; its state and journal are not watched"
        t.unit = ""
    disk = got.get("disk", "")
    if disk.startswith("missing"):
        devs = disk.split()[1:]
        listed = f" (it lists {', '.join(devs[:8])})" if devs else ""
        missing["disk"] = f"health.disk={t.disk}: not in /proc/diskstats on {label}{listed}; its reads are not counted"
        t.disk = ""
    return missing


def evidence_note(t, missing: Dict[str, str], local_port: int) -> str:
    """What this watch can attribute to the server (said once, in the first line), and what is missing and why."""
    what = []
    if t.pid or t.pidfile:
        what.append(f"process tree of pid {t.pid or '(pidfile ' + t.pidfile + ')'}")
    elif t.unit:
        what.append(f"process tree of unit {t.unit}'s MainPID")
    elif t.status_path:
        what.append("the engine's status (and its pid's process tree)")
    if t.disk:
        what.append(f"reads of {t.disk}")
    has_log = bool(t.unit or (t.log and "log" not in missing))
    gone = ("; missing: " + "; ".join(missing.values())) if missing else ""
    if not what:
        owner = (" until the server's process is found by its port (listening on it, or naming it on its command "
                 "line: then its process tree)") if local_port else ""
        return ("evidence: nothing attributable to the server (no health.pid, health.unit or health.disk): "
                "judging on the port, the completion probe" + (" and the log" if has_log else "") + " alone"
                + owner + gone)
    return "evidence: " + " + ".join(what) + (" + log" if has_log else "") + gone
