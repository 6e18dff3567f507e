"""The HTTP layer before any model is loaded (a real uvicorn server on a free port, no engine attached yet, as in
the first seconds of a cold start): completions 503 until ready, CORS on request only, connection limits and
idle sockets closed."""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from kdtree.serve.app import ServeApp
from kdtree.serve.status import StatusFile


@pytest.fixture
def start(tmp_path):
    apps = []

    def _start(**kw) -> ServeApp:
        app = ServeApp(StatusFile(tmp_path / f"status{len(apps)}.json"), port=0, model_name="tiny", **kw).start()
        apps.append(app)
        return app

    yield _start
    for app in apps:
        app.drain(5)


def request(url, method="GET", data=None, headers=None):
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_port_answers_before_the_load_and_completions_are_503_until_ready(start):
    app = start()
    code, headers, body = request(app.url + "/v1/completions", "POST", b'{"prompt": "2+2="}',
                                  {"Content-Type": "application/json"})
    assert code == 503 and headers["Retry-After"] == "1"
    assert json.loads(body)["error"]["code"] == "not_ready" and "loading" in json.loads(body)["error"]["message"]
    assert request(app.url + "/health")[0] == 200 and request(app.url + "/ready")[0] == 503
    assert request(app.url + "/health", "HEAD")[0] == 200              # load balancers' HEAD checks
    assert json.loads(request(app.url + "/status")[2])["phase"] == "loading"


def test_cors_only_for_the_configured_origins(start):
    plain, cors = start(), start(cors_origins=("https://app.example",))
    pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    code, headers, body = request(plain.url + "/v1/completions", "OPTIONS", headers=pre)
    assert code == 405 and headers.get("access-control-allow-origin") is None
    assert json.loads(body)["error"]["message"].endswith("not OPTIONS")
    code, headers, _ = request(cors.url + "/v1/completions", "OPTIONS", headers=pre)
    assert code == 200 and headers["access-control-allow-origin"] == "https://app.example"
    code, headers, _ = request(cors.url + "/v1/completions", "OPTIONS", headers={**pre, "Origin": "https://evil.example"})
    assert code == 400 and headers.get("access-control-allow-origin") is None


def _recv_all(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk
    except socket.timeout:
        return out + b"<still open>"


def test_connections_over_the_limit_get_503_and_idle_ones_are_closed(start):
    app = start(max_connections=2, keepalive_s=1.0)
    addr = ("127.0.0.1", app.port)
    idle = [socket.create_connection(addr) for _ in range(2)]
    time.sleep(0.2)
    over = socket.create_connection(addr)
    raw = _recv_all(over, 5)
    assert raw.startswith(b"HTTP/1.1 503") and b"serve.max_connections=2" in raw, raw[:300]
    t0 = time.monotonic()
    for s in idle:                                     # they never sent a request: closed after keepalive_s
        assert _recv_all(s, 10) == b""
    assert time.monotonic() - t0 < 8
    for s in (*idle, over):
        s.close()
    time.sleep(0.3)
    assert request(app.url + "/health")[0] == 200      # and the server still answers
