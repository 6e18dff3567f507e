"""This machine, through invoke.Context (the same `c.run` API as fabric)."""
from __future__ import annotations

import os
import shutil
import signal as _signal
import sys
from pathlib import Path

import invoke

from kdtree.hosts.base import Host


class LocalHost(Host):
    kind = "local"

    @classmethod
    def from_config(cls, host_cfg) -> "LocalHost":
        get = host_cfg.get if hasattr(host_cfg, "get") else lambda k, d=None: getattr(host_cfg, k, d)
        return cls(invoke.Context(), name=get("name", "local") or "local",
                   python=get("python", "") or sys.executable, workdir=get("workdir", "") or "",
                   supervisor=get("supervisor", "nohup") or "nohup",
                   command_timeout_s=float(get("command_timeout_s", 60.0) or 60.0))

    def put(self, local: str, remote: str) -> None:
        if os.path.abspath(local) != os.path.abspath(remote):
            Path(remote).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local, remote)

    def get(self, remote: str, local: str) -> None:
        self.put(remote, local)

    def mkdir(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def read_file(self, path: str, offset: int = 0) -> bytes:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read()
        except FileNotFoundError:
            return b""

    # Python instead of a shell per call: the runner polls these every half second.
    def is_alive(self, pid: int, timeout=None) -> bool:
        try:
            stat = Path(f"/proc/{int(pid)}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            return False
        return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")

    def signal(self, pid: int, sig: int = _signal.SIGTERM, group: bool = True, timeout=None) -> bool:
        try:
            if group:
                try:
                    os.killpg(int(pid), sig)
                    return True
                except ProcessLookupError:
                    pass
            os.kill(int(pid), sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False
