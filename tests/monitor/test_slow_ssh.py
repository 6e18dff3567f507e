"""Issue 37 row 19 through a real sshd: the host's replies turn slow for a few seconds (a TCP relay in front of sshd
holds every byte from it for 1.5 s; no fault), then fast again. Slow is not unreachable: the lines of the slow
samples say WAITING "host not answering", never "unreachable", and the watch ends READY.

Run: .venv/bin/python -m pytest -q tests/monitor/test_slow_ssh.py
"""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from tests.monitor.test_cold_start import start_stand_in


class SlowRelay:
    """127.0.0.1:<port> -> sshd; bytes from sshd are held `delay_s` (settable while it runs)."""

    def __init__(self, target_port: int):
        self.target, self.delay_s = target_port, 0.0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src, dst, held):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if held and self.delay_s:
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.sock.close()


def test_slow_ssh_replies_are_slow_samples_not_an_unreachable_host(tmp_path, port, sshd):
    from kdtree.hosts import SshHost
    from kdtree.monitor.watcher import Target, Watcher

    relay = SlowRelay(int(sshd["port"]))
    key = Path(sshd["known_hosts"]).read_text().split(None, 1)[1]
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{relay.port} {key}")
    host = SshHost.from_config({**{k: v for k, v in sshd.items() if k != "dir"}, "port": relay.port,
                                "known_hosts": str(known)})
    go = tmp_path / "go"
    server, log = start_stand_in(tmp_path, port, seconds=7.0, go=go)
    lines = []

    def slow_phase():
        time.sleep(2.0)
        relay.delay_s = 1.5                     # every reply of sshd now arrives 1.5 s late
        time.sleep(3.5)
        relay.delay_s = 0.0

    threading.Timer(0.5, go.write_text, ("",)).start()
    threading.Thread(target=slow_phase, daemon=True).start()
    try:
        summary = Watcher(host, Target(url=f"http://127.0.0.1:{port}", pid=server.pid, log=str(log)),
                          interval_s=0.5, stall_window_s=10, probe_timeout_s=2, out_dir=tmp_path / "w",
                          echo=lines.append).run()
    finally:
        server.kill()
        server.wait(10)
        host.close()
        relay.close()
    assert summary["verdict"] == "READY", lines
    assert any("host not answering" in ln for ln in lines), lines            # the slow phase was seen
    assert not any("unreachable" in ln.lower() for ln in lines[1:]), lines
