"""A remote machine through fabric.Connection (paramiko), with host keys verified.

fabric's default is AutoAddPolicy (trust any key on first sight); here the policy is RejectPolicy and the
keys come from host.known_hosts (or ~/.ssh/known_hosts), so an unknown or changed host key is refused.
"""
from __future__ import annotations

import getpass
import socket
from pathlib import Path

import fabric
import paramiko
from paramiko.ssh_exception import (AuthenticationException, BadHostKeyException, NoValidConnectionsError,
                                    SSHException)

from kdtree.errors import HostError
from kdtree.hosts.base import Host


class SshHost(Host):
    kind = "ssh"

    def __init__(self, *, address: str, user: str, port: int, key_file: str, known_hosts: str,
                 connect_timeout_s: float, **kw):
        self.address, self.user, self.port = address, user, int(port)
        self.key_file = str(Path(key_file).expanduser()) if key_file else ""
        self.known_hosts = str(Path(known_hosts).expanduser()) if known_hosts else ""
        self.connect_timeout_s = float(connect_timeout_s)
        t = self.connect_timeout_s
        connect_kwargs = {"timeout": t, "banner_timeout": t, "auth_timeout": t}
        if self.key_file:
            connect_kwargs.update(key_filename=[self.key_file], look_for_keys=False, allow_agent=False)
        conn = fabric.Connection(host=address, user=user, port=self.port, connect_kwargs=connect_kwargs)
        conn.connect_timeout = None  # fabric truncates it to int; the float lives in connect_kwargs["timeout"]
        conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        super().__init__(conn, **kw)

    @classmethod
    def from_config(cls, host_cfg) -> "SshHost":
        get = host_cfg.get if hasattr(host_cfg, "get") else lambda k, d=None: getattr(host_cfg, k, d)
        address = get("address", "") or ""
        if not address:
            raise HostError(f"host {get('name', '?')}: kind=ssh needs host.address; set host.address=HOSTNAME")
        return cls(address=address, user=get("user", "") or getpass.getuser(), port=int(get("port", 22) or 22),
                   key_file=get("key_file", "") or "", known_hosts=get("known_hosts", "") or "",
                   connect_timeout_s=float(get("connect_timeout_s", 10.0) or 10.0),
                   name=get("name", "") or address, python=get("python", "") or "python3",
                   workdir=get("workdir", "") or "", supervisor=get("supervisor", "nohup") or "nohup",
                   command_timeout_s=float(get("command_timeout_s", 60.0) or 60.0))

    @property
    def label(self) -> str:
        return f"{self.user}@{self.address}:{self.port}"

    def describe(self):
        return {"name": self.name, "kind": self.kind, "label": self.label}

    def _open(self) -> None:
        if self.c.is_connected:
            return
        client = self.c.client
        kh = self.known_hosts or "~/.ssh/known_hosts"
        try:
            if self.known_hosts:
                client.load_host_keys(self.known_hosts)
            else:
                client.load_system_host_keys()
        except (OSError, SSHException) as e:
            raise HostError(f"cannot reach {self.label}: cannot read known_hosts {kh}: {e}; "
                            f"set host.known_hosts to a readable file") from None
        where = f"[{self.address}]:{self.port}" if self.port != 22 else self.address
        try:
            self.c.open()
        except BadHostKeyException as e:
            raise HostError(f"cannot reach {self.label}: host key {e.key.get_name()} {e.key.get_base64()[:16]}... "
                            f"does not match {kh}; if the host was really reinstalled, update it "
                            f"(ssh-keygen -R '{where}')") from None
        except SSHException as e:
            msg = str(e)
            if "not found in known_hosts" in msg:
                raise HostError(f"cannot reach {self.label}: its host key is not in {kh}; verify it and add it "
                                f"(ssh-keyscan -p {self.port} {self.address} >> {kh})") from None
            if isinstance(e, AuthenticationException):
                raise HostError(f"cannot reach {self.label}: authentication failed ({msg}); check host.user and "
                                f"host.key_file={self.key_file or '(default keys)'}") from None
            reason = msg.splitlines()[0] if msg else type(e).__name__
            if "banner" in msg.lower():
                reason = f"no SSH banner within {self.connect_timeout_s:g} s (connect_timeout_s): {reason}"
            raise HostError(f"cannot reach {self.label}: {reason}") from None
        except NoValidConnectionsError as e:
            errs = "; ".join(sorted({str(x.strerror or x) for x in e.errors.values()})) or str(e)
            raise HostError(f"cannot reach {self.label}: {errs}; is sshd listening on port {self.port}?") from None
        except (socket.timeout, TimeoutError):
            raise HostError(f"cannot reach {self.label}: no answer within {self.connect_timeout_s:g} s "
                            f"(connect_timeout_s); check the address, port and firewall") from None
        except OSError as e:
            raise HostError(f"cannot reach {self.label}: {e.strerror or e}") from None

    def open(self) -> "SshHost":
        self._open()
        return self

    def put(self, local: str, remote: str) -> None:
        self._open()
        try:
            self.c.put(str(local), str(remote))
        except (OSError, SSHException) as e:
            raise HostError(f"put {local} -> {self.label}:{remote} failed: {e}") from None

    def get(self, remote: str, local: str) -> None:
        self._open()
        try:
            self.c.get(str(remote), str(local))
        except (OSError, SSHException) as e:
            raise HostError(f"get {self.label}:{remote} -> {local} failed: {e}") from None

    def close(self) -> None:
        try:
            self.c.close()
        except Exception:
            pass
