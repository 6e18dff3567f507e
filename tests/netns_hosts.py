"""Real test hosts on this machine: network namespaces, each with its own address on a veth pair and its own sshd
on port 22 of that address, so fabric connects to N "machines" (they share this filesystem and process table, not
the network: a server bound to a namespace's address is reachable only through its veth).

    from tests.netns_hosts import netns_hosts      # the fixture (session scope), in a test module
    def test_x(netns_hosts): netns_hosts.hosts[0].address   # '10.X.0.2'; .overrides: host.* for kdtree.run

Made by the fixture (`ip netns add`, `ip link add ... type veth`, an sshd per namespace with a host key and an
authorized client key from temp key pairs; known_hosts pins the host key at each address) and removed by it
(sshd stopped, every process left in a namespace killed by pid, the namespace deleted: its veth end goes with it,
and the peer with it). Skipped with the reason where namespaces cannot be made: not root, no `ip` (iproute2),
no sshd, or `ip netns add` refused (a container without CAP_SYS_ADMIN).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import pytest

from tests.conftest import REPO, SSHD, _keygen

N_HOSTS = 3


@dataclass
class NsHost:
    ns: str
    address: str        # the namespace's end of the veth pair; sshd and the replicas bind it
    peer: str           # the root namespace's end (the controller's address on that link)


@dataclass
class NsHosts:
    hosts: List[NsHost]
    key_file: str
    known_hosts: str
    overrides: List[str] = field(default_factory=list)   # host.* for `python -m kdtree.run` (the shared settings)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def _why_not() -> str:
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if not shutil.which("ip"):
        return "no `ip` command (apt-get install -y iproute2)"
    if not os.path.exists(SSHD) or not shutil.which("ssh-keygen"):
        return "openssh-server not installed (apt-get install -y openssh-server openssh-client)"
    return ""


def _wait_banner(address: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"sshd in a namespace exited {proc.returncode}: {log.read_text()[-500:]}")
        with contextlib.suppress(OSError):
            with socket.create_connection((address, 22), timeout=1) as s:
                if s.recv(8).startswith(b"SSH-"):
                    return
        time.sleep(0.1)
    pytest.fail(f"sshd did not answer on {address}:22 within 10 s: {log.read_text()[-500:]}")


def _remove(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:                                   # what the test left running there (ours): by pid
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", ns, check=False)


def namespaces_unavailable() -> str:
    """Why no network namespace can be made here ('' when one can: made and deleted at once)."""
    why = _why_not()
    if why:
        return why
    name = f"kdtprobe{os.getpid() % 100000}"
    probe = _ip("netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"cannot make a network namespace here: {probe.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return ""


@pytest.fixture(scope="session")
def netns_hosts(tmp_path_factory):
    why = _why_not()
    if why:
        pytest.skip(why)
    tag = f"{os.getpid() % 100000}"
    octet = 100 + os.getpid() % 100                   # 10.<octet>.<i>.0/24: one subnet per namespace
    probe = _ip("netns", "add", f"kdt{tag}n0", check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.strip()}")
    d = tmp_path_factory.mktemp("netns")
    _keygen(d / "host_key")
    _keygen(d / "client_key")
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    os.chmod(d / "authorized_keys", 0o600)
    os.makedirs("/run/sshd", exist_ok=True)
    host_pub = (d / "host_key.pub").read_text().split()
    hosts, procs, logs = [], [], []
    try:
        for i in range(N_HOSTS):
            ns, a, b = f"kdt{tag}n{i}", f"kv{tag}{i}a", f"kv{tag}{i}b"
            if i:
                _ip("netns", "add", ns)
            peer, address = f"10.{octet}.{i}.1", f"10.{octet}.{i}.2"
            _ip("link", "add", a, "type", "veth", "peer", "name", b, "netns", ns)
            _ip("addr", "add", f"{peer}/24", "dev", a)
            _ip("link", "set", a, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", b)
            _ip("-n", ns, "link", "set", b, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            cfg = d / f"sshd_{i}.config"
            cfg.write_text("\n".join([
                "Port 22", f"ListenAddress {address}", f"HostKey {d / 'host_key'}", f"PidFile {d / f'sshd_{i}.pid'}",
                f"AuthorizedKeysFile {d / 'authorized_keys'}", "PubkeyAuthentication yes", "PasswordAuthentication no",
                "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "PermitRootLogin yes",
                "AllowUsers root", "LogLevel VERBOSE", "MaxStartups 30", ""]))
            logs.append(open(d / f"sshd_{i}.log", "wb"))
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(cfg)],
                                          stdout=logs[-1], stderr=subprocess.STDOUT))
            hosts.append(NsHost(ns, address, peer))
            _wait_banner(address, procs[-1], d / f"sshd_{i}.log")
        (d / "known_hosts").write_text("".join(f"{h.address} {host_pub[0]} {host_pub[1]}\n" for h in hosts))
        yield NsHosts(hosts, str(d / "client_key"), str(d / "known_hosts"), [
            "host.user=root", f"host.key_file={d / 'client_key'}", f"host.known_hosts={d / 'known_hosts'}",
            f"host.workdir={REPO}", f"host.python={sys.executable}", "host.connect_timeout_s=5"])
    finally:
        for p in procs:
            p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()
        for i in range(N_HOSTS):
            _remove(f"kdt{tag}n{i}")
