"""The Host API shared by LocalHost (invoke.Context) and SshHost (fabric.Connection).

Both wrap an object `c` with `c.run(command: str, ...)`; everything here builds one shell command line in
which every value is quoted with shlex.quote, so a remote argument with quotes, spaces or `;` arrives intact.
"""
from __future__ import annotations

import io
import shlex
import time
import signal as _signal
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from invoke.exceptions import CommandTimedOut

from kdtree.errors import HostError

SUPERVISORS = ("nohup", "systemd")


@dataclass
class Result:
    command: str        # the exact shell command line that ran
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def brief(script: str, n: int = 100) -> str:
    """A command line for an error message: its first line, cut to n characters."""
    first = script.strip().splitlines()[0] if script.strip() else ""
    return first[:n] + (" ..." if len(first) > n or "\n" in script.strip() else "")


def quote_argv(argv: Sequence[object]) -> str:
    return " ".join(shlex.quote(str(a)) for a in argv)


def with_env_cwd(argv: Sequence[object], cwd: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> str:
    """`cd CWD && env K=V argv...` with every piece quoted (env via `env`, since sshd drops SetEnv by default)."""
    cmd = quote_argv(argv)
    if env:
        cmd = "env " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()) + " " + cmd
    if cwd:
        cmd = f"cd {shlex.quote(str(cwd))} && {cmd}"
    return cmd


# Alive = /proc/PID exists and is not a zombie (a container's PID 1 may never reap the detached engine).
ALIVE_SH = 's=$(cat /proc/{pid}/stat 2>/dev/null) || exit 1; s=${{s##*) }}; case "$s" in Z*|X*) exit 1;; esac; exit 0'


class Host:
    """Run commands, copy files and manage detached processes on one machine."""

    kind = "?"

    def __init__(self, c, name: str, python: str, workdir: str = "", supervisor: str = "nohup",
                 command_timeout_s: float = 60.0):
        if supervisor not in SUPERVISORS:
            raise HostError(f"host {name}: supervisor={supervisor!r}; use one of {', '.join(SUPERVISORS)}")
        self.c = c                    # invoke.Context or fabric.Connection (fabric style: functions take `c`)
        self.name = name
        self.python = python          # interpreter on that host
        self.workdir = workdir        # where kdtree is importable on that host ("" = default)
        self.supervisor = supervisor
        self.command_timeout_s = float(command_timeout_s)

    # --- identity -----------------------------------------------------------------------------
    @property
    def label(self) -> str:
        return self.name

    def describe(self) -> Dict[str, object]:
        return {"name": self.name, "kind": self.kind, "label": self.label}

    # --- commands -----------------------------------------------------------------------------
    def _open(self) -> None:
        """Connect if needed (ssh); local hosts have nothing to open."""

    def shell(self, script: str, timeout: Optional[float] = None, stdin: Optional[str] = None,
              out_stream=None) -> Result:
        """Run a shell command line as it is. Callers quote every value (see quote_argv). `stdin`: text fed to the
        command's standard input (secrets go there, never on a command line another user can read in ps).
        `out_stream`: also gets stdout as it arrives (Result.stdout has all of it anyway)."""
        self._open()
        return self._run_on(self.c, script, self.command_timeout_s if timeout is None else float(timeout), stdin,
                            out_stream)

    def _run_on(self, c, script: str, t: float, stdin: Optional[str] = None, out_stream=None) -> Result:
        timed_out = HostError(f"command timed out after {t:.3g} s on {self.label}: {brief(script)}; "
                              f"raise host.command_timeout_s or check the host")
        t0 = time.monotonic()
        try:
            streams = {"hide": True} if out_stream is None else {"hide": "err", "out_stream": out_stream}
            r = c.run(script, warn=True, in_stream=io.StringIO(stdin) if stdin is not None else False, timeout=t,
                      **streams)
        except CommandTimedOut:
            raise timed_out from None
        except HostError:
            raise
        except Exception as e:  # the connection died under the command (ssh)
            raise HostError(f"command failed on {self.label}: {type(e).__name__}: {e}; {brief(script)}") from None
        elapsed = time.monotonic() - t0
        # invoke's timer lost a race: with the command's end (seen under load), or with its own kill -- the timer
        # thread still inside kill() when invoke asks whether it fired, so the killed command comes back as a result
        # without an exit status (None; paramiko's -1: the channel closed without one) instead of CommandTimedOut
        if elapsed > t + 0.5 or (r.exited in (None, -1) and elapsed >= t):
            raise timed_out
        return Result(command=script, returncode=int(r.exited if r.exited is not None else -1),
                      stdout=r.stdout, stderr=r.stderr)

    def run(self, argv: List[object], timeout: Optional[float] = None, cwd: Optional[str] = None,
            env: Optional[Dict[str, str]] = None, check: bool = False) -> Result:
        """Run argv (each argument shell-quoted) and return its Result; check=True raises on non-zero exit."""
        if isinstance(argv, (str, bytes)):
            raise TypeError("Host.run takes an argument list; use Host.shell for a command line")
        r = self.shell(with_env_cwd(argv, cwd, env), timeout)
        if check and not r.ok:
            err = (r.stderr.strip().splitlines() or ["(no stderr)"])[-1]
            raise HostError(f"{quote_argv(argv)[:120]} exited {r.returncode} on {self.label}: {err}")
        return r

    # --- files --------------------------------------------------------------------------------
    def put(self, local: str, remote: str) -> None:
        raise NotImplementedError

    def get(self, remote: str, local: str) -> None:
        raise NotImplementedError

    def mkdir(self, path: str) -> None:
        self.run(["mkdir", "-p", path], check=True)

    def exists(self, path: str) -> bool:
        return self.run(["test", "-e", path]).ok

    def read_file(self, path: str, offset: int = 0) -> bytes:
        """Bytes of `path` from `offset` on (b"" if it does not exist) — for tailing logs."""
        r = self.run(["tail", "-c", f"+{int(offset) + 1}", path])
        return r.stdout.encode() if r.ok else b""

    # --- detached processes -------------------------------------------------------------------
    def start_detached(self, argv: List[object], log: str, pidfile: str, cwd: Optional[str] = None,
                       env: Optional[Dict[str, str]] = None, unit: str = "",
                       secret_env: Optional[Dict[str, str]] = None) -> int:
        """Start argv in its own session (pgid = pid), stdout+stderr appended to `log`; write and return its pid.

        nohup: `nohup setsid sh -c 'echo $$ > pidfile; exec argv'`, so the pid is the program itself.
        systemd: a transient user unit (`systemd-run --user --unit kdtree-<unit>`), pid from MainPID.
        secret_env: variables read from stdin by the launching shell (`read -r`), never written on a command line.
        """
        cwd = cwd or self.workdir or None
        q = shlex.quote
        if self.supervisor == "systemd":
            # Untested here (no user systemd in CI containers): kept to the documented systemd-run options.
            unit_name = f"kdtree-{unit or 'engine'}"
            opts = ["systemd-run", "--user", "--collect", f"--unit={unit_name}",
                    f"--property=StandardOutput=append:{log}", f"--property=StandardError=append:{log}"]
            if cwd:
                opts.append(f"--working-directory={cwd}")
            opts += [f"--setenv={k}={v}" for k, v in (env or {}).items()]
            opts += [f"--setenv={k}" for k in (secret_env or {})]      # the value comes from the environment
            script = (f"mkdir -p {q(_dirname(log))} {q(_dirname(pidfile))} && "
                      f"{quote_argv(opts + ['--'] + list(argv))} >/dev/null && "
                      f"systemctl --user show -p MainPID --value {q(unit_name)} > {q(pidfile)} && cat {q(pidfile)}")
        else:
            inner = with_env_cwd(argv, None, env)
            launcher = 'echo $$ > "$0.tmp" && mv "$0.tmp" "$0" && exec "$@"'
            script = (f"mkdir -p {q(_dirname(log))} {q(_dirname(pidfile))} && rm -f {q(pidfile)} && "
                      + (f"cd {q(str(cwd))} && " if cwd else "")
                      + f"(nohup setsid sh -c {q(launcher)} {q(pidfile)} {inner} >> {q(log)} 2>&1 < /dev/null &) ; "
                      f"i=0; while [ ! -s {q(pidfile)} ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done; "
                      f"cat {q(pidfile)}")
        secrets = {k: v for k, v in (secret_env or {}).items() if v}
        if secrets:
            script = "".join(f"IFS= read -r {k} && export {k} && " for k in secrets) + script
        r = self.shell(script, stdin="".join(f"{v}\n" for v in secrets.values()) if secrets else None)
        out = r.stdout.strip()
        if not r.ok or not out.isdigit() or int(out) <= 0:
            err = (r.stderr.strip().splitlines() or [out or "(no output)"])[-1]
            raise HostError(f"could not start {quote_argv(argv)[:100]} on {self.label} ({self.supervisor}): {err}; "
                            f"see {log}")
        return int(out)

    def is_alive(self, pid: int, timeout: Optional[float] = None) -> bool:
        return self.shell(ALIVE_SH.format(pid=int(pid)), timeout).ok

    def signal(self, pid: int, sig: int = _signal.SIGTERM, group: bool = True, timeout: Optional[float] = None) -> bool:
        """Send `sig` to the process group of `pid` (group=True) or to pid alone; False if nothing received it."""
        name = _signal.Signals(sig).name[3:]
        target = f"-{int(pid)}" if group else str(int(pid))
        r = self.shell(f"kill -s {name} -- {target} 2>/dev/null || kill -s {name} {int(pid)}", timeout)
        return r.ok

    def close(self) -> None:
        pass

    def __enter__(self) -> "Host":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _dirname(path: str) -> str:
    import posixpath

    return posixpath.dirname(str(path)) or "."
