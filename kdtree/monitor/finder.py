"""Finding the server's process when the watch was given no health.pid, pidfile or unit (issue 37 row 14): the
README's first `watch` example names only a URL, and an SGLang/vLLM cold start keeps its port shut for minutes
while it loads, so "nothing listens" alone must not decide. Inside the sample's shell script, while $P is 0:

  1. the owner of the listening socket: the port's inode in /proc/net/tcp{,6} (state 0A), then the process holding
     that inode among /proc/*/fd;
  2. else a process whose command line names the port: `--port N`, `--port=N` or `serve.port=N` (SGLang, vLLM,
     llama.cpp, uvicorn, kdtree); of several, the root (whose parent is not one of them; the lowest pid), never
     the monitor itself or one of its ancestors (a `pipeline=serve serve.port=N` run that watches its own engine).

The process section then prints `found socket|cmdline <command line>` first; the watcher then watches
that pid as health.pid would be and says once which process it found and how. (A unit's MainPID is taken from the
unit's own probe: see watcher.py.)
"""
from __future__ import annotations

from typing import Any, Dict

FIND_SH = r"""if ! [ "$P" -gt 0 ] 2>/dev/null; then
  KD_FOUND=""
  I=$(awk -v h=":$(printf '%04X' {port})" '$2 ~ (h "$") && $4 == "0A" {{print $10; exit}}' /proc/net/tcp /proc/net/tcp6 2>/dev/null)
  [ -n "$I" ] && P=$(find /proc/[0-9]*/fd -lname "socket:\[$I\]" 2>/dev/null | head -n 1 | cut -d/ -f3)
  if [ "${{P:-0}}" -gt 0 ] 2>/dev/null; then KD_FOUND=socket; else
    C=$(grep -aPl -- '(^|\x00)(--port\x00|--port=|serve\.port=){port}(\x00|$)' /proc/[0-9]*/cmdline 2>/dev/null \
        | cut -d/ -f3 | tr '\n' ' ')
    if [ -n "$C" ]; then
      P=$(cat /proc/[0-9]*/stat 2>/dev/null | awk -v c="$C" -v me="$$" '{{p=$1; sub(/^.*\) /, ""); pp[p]=$2}}
          END {{x=me; while ((x in pp) && x > 1) {{anc[x]=1; x=pp[x]}}; n=split(c, a, " ");
               for (i=1; i<=n; i++) if ((a[i] in pp) && !(a[i] in anc)) is[a[i]]=1; best=0;
               for (q in is) if (!(pp[q] in is) && (best == 0 || q+0 < best+0)) best=q; print best+0}}')
      [ "${{P:-0}}" -gt 0 ] 2>/dev/null && KD_FOUND=cmdline
    fi
  fi
  P=${{P:-0}}
fi"""


def find_script(port: int) -> str:
    return FIND_SH.format(port=int(port))


def take_found(lines: list) -> Dict[str, Any]:
    """The `found HOW CMDLINE` line the script printed before the process section (removed from `lines`)."""
    if lines and lines[0].startswith("found "):
        _, how, *cmd = lines.pop(0).split(" ", 2)
        return {"how": how, "cmdline": (cmd[0] if cmd else "").strip()}
    return {}


def found_note(pid: int, found: Dict[str, Any], port: int) -> str:
    how = ("it owns the socket listening on port" if found.get("how") == "socket"
           else "its command line names port")
    cmd = found.get("cmdline", "")
    return (f"found the server's process: pid {pid} ({cmd[:120]!s}) -- {how} {port} (no health.pid given); "
            f"watching its process tree")
