"""The host layer against a REAL sshd on 127.0.0.1 (tests/conftest.py): commands, quoting, host keys, timeouts,
detached processes, put/get. Skipped when openssh-server is not installed."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from kdtree.errors import HostError
from kdtree.hosts import SshHost, connect

NASTY = "it's a \"quoted\" arg; echo PWNED $HOME `id` && |"


def test_command_runs_through_sshd(sshd):
    with connect(sshd) as host:
        r = host.run(["sh", "-c", 'echo "$SSH_CONNECTION"'], check=True)
    # the command really ran in an sshd session on the fixture's port
    assert r.stdout.split()[-1] == str(sshd["port"])


def test_remote_argument_with_quotes_spaces_and_semicolon_arrives_intact(sshd):
    with connect(sshd) as host:
        r = host.run([sshd["python"], "-c", "import sys; print(repr(sys.argv[1:]))", NASTY, "", "two words"],
                     check=True)
    assert r.stdout.strip() == repr([NASTY, "", "two words"])


def test_local_host_quotes_the_same_way():
    host = connect({"kind": "local"})
    r = host.run([sys.executable, "-c", "import sys; print(repr(sys.argv[1:]))", NASTY], check=True)
    assert r.stdout.strip() == repr([NASTY])


def test_wrong_host_key_is_refused(sshd, tmp_path):
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True, timeout=30)
    kind, b64 = (tmp_path / "other_key.pub").read_text().split()[:2]
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{sshd['port']} {kind} {b64}\n")
    host = connect({**sshd, "known_hosts": str(known)})
    with pytest.raises(HostError, match=r"cannot reach .*127\.0\.0\.1:\d+: host key .* does not match") as e:
        host.run(["true"])
    assert "\n" not in str(e.value)


def test_unknown_host_key_is_refused_not_added(sshd, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("")
    host = connect({**sshd, "known_hosts": str(known)})
    with pytest.raises(HostError, match=r"its host key is not in .*ssh-keyscan"):
        host.run(["true"])
    assert known.read_text() == ""  # never trusted on first sight


def test_refused_port_fails_with_one_clear_line(sshd, port):
    p = port
    host = connect({**sshd, "port": p, "connect_timeout_s": 2})
    t0 = time.monotonic()
    with pytest.raises(HostError, match=rf"cannot reach \S+@127\.0\.0\.1:{p}: .*refused") as e:
        host.run(["true"])
    assert time.monotonic() - t0 < 2 + 1.0
    assert "\n" not in str(e.value)


def test_silent_port_fails_within_the_connect_timeout(sshd):
    # a listener that accepts TCP but never speaks SSH: the connect must give up after connect_timeout_s
    with contextlib.closing(socket.socket()) as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        p = srv.getsockname()[1]
        host = connect({**sshd, "port": p, "connect_timeout_s": 1.0})
        t0 = time.monotonic()
        with pytest.raises(HostError, match=rf"cannot reach \S+@127\.0\.0\.1:{p}: ") as e:
            host.run(["true"])
        elapsed = time.monotonic() - t0
    assert 0.8 < elapsed < 1.0 + 1.5, elapsed
    assert "\n" not in str(e.value)


def test_detached_process_lives_in_the_sshd_session_and_dies_by_group_signal(sshd, tmp_path):
    log, pidfile, child = tmp_path / "d.log", tmp_path / "d.pid", tmp_path / "child.pid"
    with connect(sshd) as host:
        # a child `sleep` in the same process group: the group signal must take it down too
        pid = host.start_detached(["sh", "-c", 'echo started; sleep 60 & echo $! > "$0"; wait', str(child)],
                                  str(log), str(pidfile))
        assert host.is_alive(pid) and int(pidfile.read_text()) == pid
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        assert any(e.startswith(b"SSH_CONNECTION=") and e.endswith(str(sshd["port"]).encode()) for e in environ)
        assert int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[2]) == pid  # own process group
        for _ in range(50):
            if child.exists() and child.read_text().strip():
                break
            time.sleep(0.1)
        child_pid = int(child.read_text())
        assert host.is_alive(child_pid)
        assert host.signal(pid, signal.SIGTERM)
        for _ in range(50):
            if not host.is_alive(pid) and not host.is_alive(child_pid):
                break
            time.sleep(0.1)
        assert not host.is_alive(pid) and not host.is_alive(child_pid)
    assert "started" in log.read_text()


def test_put_and_get_round_trip(sshd, tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("payload; with 'quotes'\n")
    with connect(sshd) as host:
        assert isinstance(host, SshHost)
        host.mkdir(str(tmp_path / "remote dir"))
        host.put(str(src), str(tmp_path / "remote dir" / "b.txt"))
        host.get(str(tmp_path / "remote dir" / "b.txt"), str(tmp_path / "c.txt"))
        assert host.read_file(str(tmp_path / "remote dir" / "b.txt"), 9) == b"with 'quotes'\n"
    assert (tmp_path / "c.txt").read_text() == src.read_text()


def test_command_timeout_is_a_host_error(sshd):
    with connect({**sshd, "command_timeout_s": 1}) as host:
        with pytest.raises(HostError, match=r"timed out after 1 s"):
            host.run(["sleep", "5"])


def _sshd_session_pid(host) -> int:
    """The sshd process serving `host`'s current connection ("sshd: user@notty", the command's parent)."""
    p = int(host.shell("echo $PPID").stdout)
    assert open(f"/proc/{p}/cmdline", "rb").read().startswith(b"sshd: ") and b" -D " not in open(
        f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" "), "the command's parent is not an sshd session"
    return p


def test_frozen_connection_times_out_in_time_and_the_next_command_reconnects(sshd):
    """SIGSTOP of the sshd session under a live connection: a command with timeout=3 returns in ~3 s (not the
    60 s of an unbounded channel open), and the next command gets a new transport (the listening sshd is fine)."""
    with connect(sshd) as host:
        frozen = _sshd_session_pid(host)
        os.kill(frozen, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(HostError, match=r"timed out after 3 s") as e:
                host.shell("echo ok", timeout=3)
            assert time.monotonic() - t0 < 3 + 1.0
            assert "\n" not in str(e.value)
            t0 = time.monotonic()
            assert host.shell("echo ok", timeout=10).stdout.strip() == "ok"      # a fresh transport
            assert time.monotonic() - t0 < 5
        finally:
            os.kill(frozen, signal.SIGCONT)


def test_secret_env_reaches_a_detached_remote_process(sshd, tmp_path):
    """The API key of a remote engine: the launching shell reads it from stdin (`read -r`), the process has it
    in its environment and in no argument."""
    log, pidfile, out = tmp_path / "s.log", tmp_path / "s.pid", tmp_path / "seen"
    secret = "key-" + "x7" * 8
    with connect(sshd) as host:
        pid = host.start_detached(["sh", "-c", 'printf %s "$KDTREE_API_KEY" > "$0"; sleep 30', str(out)],
                                  str(log), str(pidfile), secret_env={"KDTREE_API_KEY": secret})
        try:
            for _ in range(50):
                if out.exists() and out.read_text():
                    break
                time.sleep(0.1)
            assert out.read_text() == secret
            assert secret.encode() not in open(f"/proc/{pid}/cmdline", "rb").read()
            assert host.shell("ps -eo args").stdout.count(secret) == 0
        finally:
            host.signal(pid, signal.SIGKILL)
