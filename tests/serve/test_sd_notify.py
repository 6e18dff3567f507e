"""sd_notify over a real unix datagram socket (path and abstract namespace), as systemd receives it."""
import socket

from kdtree.serve.sd_notify import SdNotifier, notify
from kdtree.serve.status import StatusFile


def test_notify_reaches_a_path_socket_and_an_abstract_one(tmp_path, monkeypatch):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(tmp_path / "n.sock"))
    s.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "n.sock"))
    assert notify("READY=1")
    assert s.recv(100) == b"READY=1"
    a = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    a.bind(f"\0kdtree-test-{id(a)}")
    a.settimeout(5)
    assert notify("STATUS=x", socket_path=f"@kdtree-test-{id(a)}")
    assert a.recv(100) == b"STATUS=x"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert notify("READY=1") is False          # not under systemd: a no-op


def test_status_updates_become_status_extend_and_ready(tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(tmp_path / "n.sock"))
    s.settimeout(5)
    st = StatusFile(tmp_path / "status.json")
    n = SdNotifier(extend_s=90, min_interval_s=0, socket_path=str(tmp_path / "n.sock"))
    st.subscribe(n.on_status)
    st.update(shards_done=1, shards_total=4, bytes_done=3_000_000, bytes_total=12_000_000, rate_mb_s=1.5, eta_s=6)
    msg = s.recv(1000).decode()
    assert "STATUS=loading 1/4 shards, 3.0 MB/12.0 MB, 1.5 MB/s, ETA 6 s" in msg
    assert "EXTEND_TIMEOUT_USEC=90000000" in msg and "READY=1" not in msg
    st.update(phase="ready")
    assert "READY=1" in s.recv(1000).decode()
