"""Hosts: where the engine runs. One `Host` API over invoke.Context (local) and fabric.Connection (ssh).

    host = connect(cfg.host)                 # LocalHost or SshHost, from conf/host/<name>.yaml
    host.run(["python", "-c", "print(1)"])   # every argument shell-quoted; timeout = host.command_timeout_s
    pid = host.start_detached(argv, log, pidfile)   # own session (process group = pid), survives the caller
    host.is_alive(pid); host.signal(pid, signal.SIGTERM)   # the whole process group
"""
from __future__ import annotations

from kdtree.errors import ConfigError
from kdtree.hosts.base import Host, Result
from kdtree.hosts.local import LocalHost
from kdtree.hosts.ssh import SshHost

KINDS = ("local", "ssh")


def connect(host_cfg) -> Host:
    """The Host for a `host` config group (HostConfig or any mapping with the same keys); ssh connects lazily."""
    get = host_cfg.get if hasattr(host_cfg, "get") else lambda k, d=None: getattr(host_cfg, k, d)
    kind = get("kind", "local") or "local"
    if kind == "local":
        return LocalHost.from_config(host_cfg)
    if kind == "ssh":
        return SshHost.from_config(host_cfg)
    raise ConfigError(f"host.kind={kind!r} (host={get('name', '?')}); use one of {', '.join(KINDS)}")


__all__ = ["Host", "Result", "LocalHost", "SshHost", "connect", "KINDS"]
