"""Issue 37 row 1 against a real server process (`pipeline=serve`, tiny model): sockets that send part of a request
head, or a whole head and part of its body, and stall (or trickle a byte at a time) are answered 408 and closed by
`serve.request_read_timeout_s`, while /health and a canary completion keep answering within 1 s; one client address
cannot take more than `serve.max_connections_per_client` sockets (503), and other clients are still served.

Run: .venv/bin/python -m pytest -q tests/serve/test_slowloris.py
"""
from __future__ import annotations

import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from served_engine import alive, start_served, stop

READ_TIMEOUT_S = 1.5
PER_CLIENT = 230


@pytest.fixture(scope="module")
def loris(tmp_path_factory, kdtree_cache):
    s = start_served(tmp_path_factory, kdtree_cache, f"serve.request_read_timeout_s={READ_TIMEOUT_S}",
                     f"serve.max_connections_per_client={PER_CLIENT}")
    yield s
    if alive(s.pid):
        stop(s.pid, signal.SIGKILL)


def _addr(served):
    host, port = served.url.rsplit("//", 1)[1].rsplit(":", 1)
    return host, int(port)


def _connect(addr, source="127.0.0.1"):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((source, 0))
    s.connect(addr)
    return s


def _read_until_closed(s: socket.socket, deadline: float) -> bytes:
    out = b""
    while True:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            return out + b"<still open>"
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


class Canary:
    """/health and a one-token completion, over and over on fresh connections, each timed."""

    def __init__(self, url: str):
        self.url, self.worst, self.errors, self.n = url, 0.0, [], 0
        self._done = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        body = json.dumps({"prompt": "def f(x):", "max_tokens": 1, "temperature": 0}).encode()
        while not self._done.is_set():
            for req in (urllib.request.Request(self.url + "/health"),
                        urllib.request.Request(self.url + "/v1/completions", data=body,
                                               headers={"Content-Type": "application/json"})):
                t0 = time.monotonic()
                try:
                    with urllib.request.urlopen(req, timeout=10) as r:
                        r.read()
                        if r.status != 200:
                            self.errors.append(r.status)
                except Exception as e:               # noqa: BLE001 - every failure is a finding
                    self.errors.append(repr(e))
                self.worst = max(self.worst, time.monotonic() - t0)
                self.n += 1
            time.sleep(0.05)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._t.join(15)


def test_stalled_heads_and_bodies_get_408_and_are_closed_while_health_answers(loris):
    addr = _addr(loris)
    heads, bodies = [], []
    with Canary(loris.url) as canary:
        t0 = time.monotonic()
        for i in range(100):
            s = _connect(addr)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")              # a head that never ends
            heads.append(s)
            s = _connect(addr)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")                 # a body that never ends
            bodies.append(s)
        opened = time.monotonic() - t0
        deadline = time.monotonic() + READ_TIMEOUT_S + 10
        answers = [_read_until_closed(s, deadline) for s in heads + bodies]
        closed_in = time.monotonic() - t0
        time.sleep(0.5)
    for s in heads + bodies:
        s.close()
    still_open = sum(a.endswith(b"<still open>") for a in answers)
    assert still_open == 0, f"{still_open} of 200 stalled sockets still open after {closed_in:.1f} s"
    assert all(a.startswith(b"HTTP/1.1 408") and b"serve.request_read_timeout_s" in a for a in answers), \
        [a[:200] for a in answers if not a.startswith(b"HTTP/1.1 408")][:3]
    assert closed_in < opened + READ_TIMEOUT_S + 5, closed_in
    assert not canary.errors and canary.n >= 4 and canary.worst < 1.0, (canary.errors[:3], canary.n, canary.worst)


def test_a_head_trickled_a_byte_at_a_time_is_cut_at_the_deadline(loris):
    s = _connect(_addr(loris))
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    t0 = time.monotonic()
    cut = None
    for b in head:
        try:
            s.sendall(bytes([b]))
        except (BrokenPipeError, ConnectionResetError):
            cut = time.monotonic() - t0
            break
        time.sleep(0.1)                      # every byte well inside any idle timeout
        if time.monotonic() - t0 > READ_TIMEOUT_S + 5:
            break
    raw = _read_until_closed(s, time.monotonic() + 5)
    elapsed = time.monotonic() - t0
    s.close()
    assert raw.startswith(b"HTTP/1.1 408"), raw[:200]
    assert (cut or elapsed) < READ_TIMEOUT_S + 3, (cut, elapsed)


def test_one_client_address_cannot_take_every_socket(loris):
    addr = _addr(loris)
    mine = [_connect(addr, "127.0.0.2") for _ in range(PER_CLIENT + 10)]   # a second loopback address
    deadline = time.monotonic() + 5
    refused = []
    for s in mine[PER_CLIENT:]:
        refused.append(_read_until_closed(s, deadline))
    t0 = time.monotonic()
    with urllib.request.urlopen(loris.url + "/health", timeout=5) as r:     # from 127.0.0.1: still served
        assert r.status == 200
    health_s = time.monotonic() - t0
    for s in mine:
        s.close()
    assert all(a.startswith(b"HTTP/1.1 503") and b"serve.max_connections_per_client" in a
               and b"127.0.0.2" in a for a in refused), [a[:200] for a in refused][:2]
    assert health_s < 1.0


@pytest.mark.parametrize("sources", [1, 10], ids=["one-address", "ten-addresses"])
def test_1100_partial_heads_and_1100_partial_bodies_never_lock_out_health_or_a_completion(loris, sources):
    """Issue 37 acceptance: the row-1 attack at its full size, 1100 sockets that stall in a request head and 1100 in
    a body, opened as fast as possible from one attacker address (127.0.0.2), or spread over ten (127.0.0.2-11:
    past serve.max_connections all together). A canary on 127.0.0.1 times /health and a one-token completion on
    fresh connections the whole time, and /health once right after the last attack socket opened (every slot
    held): every one answers 200 within 1 s (main: 503 `too many open connections` with ten addresses; a stalled
    reader is now closed to make room). Every attack socket ends answered (408 at the read deadline, or 503 at a
    cap) and closed."""
    addr = _addr(loris)
    socks = []
    with Canary(loris.url) as canary:
        t0 = time.monotonic()
        for i in range(1100):
            for head in (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ",
                         b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": \""):
                try:
                    s = _connect(addr, f"127.0.0.{2 + len(socks) % sources}")
                    s.sendall(head)
                except OSError:                         # refused at a cap before the head went out: answered too
                    continue
                socks.append(s)
        opened = time.monotonic() - t0
        t1 = time.monotonic()                           # every slot held now (ten addresses: past the global cap)
        try:
            with urllib.request.urlopen(loris.url + "/health", timeout=5) as r:
                full = (r.status, time.monotonic() - t1)
        except urllib.error.HTTPError as e:
            full = (e.code, time.monotonic() - t1)
        deadline = time.monotonic() + READ_TIMEOUT_S + 20
        answers = [_read_until_closed(s, deadline) for s in socks]
        closed_in = time.monotonic() - t0
        time.sleep(1.0)                                 # the canary after the last close, too
    for s in socks:
        s.close()
    still_open = sum(a.endswith(b"<still open>") for a in answers)
    codes = {}
    for a in answers:
        codes[a[9:12].decode() or "closed"] = codes.get(a[9:12].decode() or "closed", 0) + 1
    print(f"{sources} address(es): {len(socks)} sockets opened in {opened:.1f} s, all closed after {closed_in:.1f} s "
          f"({codes}); /health with every slot held: {full}; canary: {canary.n} requests, worst {canary.worst * 1000:.0f} ms, errors {canary.errors[:3]}")
    # within 1 s both ways. One address: measured ~0.3-0.5 s. Ten addresses past serve.max_connections: the server
    # works through the whole flood (2200 connects, ~1180 of them closing another to make room) on 2 shared cores
    # before it reaches the probe: measured 0.4-0.75 s (it was 0.9-1.7 s while every full collection walked the
    # loaded heap, a stalled body ran the app, and each connection left a reference cycle behind)
    bound = 1.0
    assert full[0] == 200 and full[1] < bound, f"/health with every slot held: {full}"
    assert still_open == 0, f"{still_open} stalled sockets still open after {closed_in:.1f} s"
    assert set(codes) <= {"408", "503", "closed"}, codes
    assert not canary.errors and canary.n >= 6 and canary.worst < bound, (canary.errors[:3], canary.n, canary.worst)
    with urllib.request.urlopen(loris.url + "/metrics", timeout=5) as r:   # the operator sees the flood as counts
        closed = {line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                  for line in r.read().decode().splitlines() if line.startswith("kdtree_connections_closed_total{")}
    assert closed.get("read_timeout", 0) >= codes.get("408", 0) > 0, (closed, codes)
    assert sum(v for k, v in closed.items() if k != "read_timeout") >= codes.get("503", 0) > 0, (closed, codes)
