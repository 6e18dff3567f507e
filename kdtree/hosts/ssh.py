"""A remote machine through fabric.Connection (paramiko), with host keys verified.

fabric's default is AutoAddPolicy (trust any key on first sight); here the policy is RejectPolicy and the
keys come from host.known_hosts (or ~/.ssh/known_hosts), so an unknown or changed host key is refused.

Every command has ONE deadline that covers connecting, opening the channel and running: a frozen sshd (or a
dead network path) costs `timeout` seconds, not paramiko's unbounded waits. A command past its deadline
abandons its transport (closed in the background) and the next command connects afresh; the transport sends
keep-alives so idle NAT/firewall state does not silently drop a long watch.
"""
from __future__ import annotations

import getpass
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Optional

import fabric
import paramiko
from paramiko.ssh_exception import (AuthenticationException, BadHostKeyException, NoValidConnectionsError,
                                    SSHException)

from kdtree.errors import HostError
from kdtree.hosts.base import Host, Result, brief

KEEPALIVE_S = 5          # transport keep-alive period (seconds)
CLOSE_WAIT_S = 1.0       # longest close() waits for a transport that does not answer


def quiet_paramiko() -> None:
    """paramiko logs INFO lines and whole tracebacks ("Error reading SSH protocol banner") of failures kdtree
    reports itself in one line: silent unless KDTREE_VERBOSE (`python -m kdtree.run -v`)."""
    if not os.environ.get("KDTREE_VERBOSE"):
        log = logging.getLogger("paramiko")
        log.setLevel(logging.CRITICAL + 1)
        log.propagate = False


quiet_paramiko()


class SshHost(Host):
    kind = "ssh"

    def __init__(self, *, address: str, user: str, port: int, key_file: str, known_hosts: str,
                 connect_timeout_s: float, **kw):
        self.address, self.user, self.port = address, user, int(port)
        self.key_file = str(Path(key_file).expanduser()) if key_file else ""
        self.known_hosts = str(Path(known_hosts).expanduser()) if known_hosts else ""
        self.connect_timeout_s = float(connect_timeout_s)
        self._lock = threading.Lock()                     # guards self.c and self._open_locks
        self._open_locks = {}                             # id(connection) -> lock: one connect at a time on it
        super().__init__(self._new_connection(), **kw)

    def _new_connection(self) -> fabric.Connection:
        t = self.connect_timeout_s
        connect_kwargs = {"timeout": t, "banner_timeout": t, "auth_timeout": t, "channel_timeout": t}
        if self.key_file:
            connect_kwargs.update(key_filename=[self.key_file], look_for_keys=False, allow_agent=False)
        conn = fabric.Connection(host=self.address, user=self.user, port=self.port, connect_kwargs=connect_kwargs)
        conn.connect_timeout = None  # fabric truncates it to int; the float lives in connect_kwargs["timeout"]
        conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        return conn

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

    @property
    def connected(self) -> bool:
        return bool(self.c.is_connected)

    def shell(self, script: str, timeout: Optional[float] = None, stdin: Optional[str] = None,
              out_stream=None) -> Result:
        """The command under one deadline (connect + channel open + run); past it the transport is abandoned."""
        t = self.command_timeout_s if timeout is None else float(timeout)
        with self._lock:
            c = self.c
        box = {}

        def work():
            try:
                self._open_conn(c)
                box["r"] = self._run_on(c, script, t, stdin, out_stream)
            except BaseException as e:       # handed to the caller below
                box["e"] = e

        th = threading.Thread(target=work, name="ssh-command", daemon=True)
        th.start()
        th.join(t + 0.2)                     # invoke's own timer fires at t; this catches a frozen transport
        if th.is_alive():
            self._abandon(c)
            raise HostError(f"command timed out after {t:.3g} s on {self.label} (no answer from the ssh connection; "
                            f"it is rebuilt for the next command): {brief(script)}")
        if "e" in box:
            if not isinstance(box["e"], HostError):
                raise HostError(f"command failed on {self.label}: {type(box['e']).__name__}: {box['e']}") from None
            if "timed out" in str(box["e"]):
                self._abandon(c)             # a timed-out channel may be what froze: do not reuse its transport
            raise box["e"]
        return box["r"]

    def _abandon(self, c) -> None:
        """Swap in a fresh connection; close the stuck one in the background (its close may block too)."""
        with self._lock:
            if self.c is c:
                self.c = self._new_connection()
            self._open_locks.pop(id(c), None)
        threading.Thread(target=_close_quietly, args=(c,), name="ssh-close", daemon=True).start()

    def _open(self) -> None:
        with self._lock:
            c = self.c
        self._open_conn(c)

    def _open_conn(self, c) -> None:
        with self._lock:
            lock = self._open_locks.setdefault(id(c), threading.Lock())
        with lock:
            self._connect(c)

    def _connect(self, c) -> None:
        if c.is_connected:
            return
        client = c.client
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
            c.open()
            c.transport.set_keepalive(KEEPALIVE_S)
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
            if msg == "No existing session":    # paramiko's words when the handshake never completed
                reason = (f"no SSH session within {self.connect_timeout_s:g} s (connect_timeout_s): the port accepts "
                          f"connections but sshd does not answer")
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
        th = threading.Thread(target=_close_quietly, args=(self.c,), name="ssh-close", daemon=True)
        th.start()
        th.join(CLOSE_WAIT_S)                # a frozen peer must not hold the caller's exit


def _close_quietly(c) -> None:
    try:
        c.close()
    except Exception:
        pass
