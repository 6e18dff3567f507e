"""Issue 37 row 8 against a real server process: a body over serve.max_body_bytes (8 MiB) sent whole by an ordinary
client gets the 413 with its JSON error, not a broken pipe / connection reset: the server reads and drops the rest of
the body (up to a bound) before it answers and closes. curl exits 0 with the 413 (not `(55) Send failure`), a client
that sends in pieces never sees its send fail, `requests` reads the 413 (Content-Length or chunked), and a client that
sent only the head still gets the 413 at once.

Run: .venv/bin/python -m pytest -q tests/serve/test_body_limit.py
"""
from __future__ import annotations

import json
import socket
import subprocess
import time

import requests

BIG = b'{"prompt": "' + b"x" * (12 << 20) + b'"}'


def _addr(served):
    host, port = served.url.rsplit("//", 1)[1].rsplit(":", 1)
    return host, int(port)


def test_curl_gets_the_413_not_a_send_failure(served, tmp_path):
    body = tmp_path / "big.json"
    body.write_bytes(BIG)
    for expect in ([], ["-H", "Expect:"]):        # curl's default (Expect: 100-continue for big bodies), and without
        r = subprocess.run(["curl", "-sS", "-o", str(tmp_path / "out"), "-w", "%{http_code}", "-H",
                            "Content-Type: application/json", *expect, "--data-binary", f"@{body}",
                            served.url + "/v1/completions"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout == "413", (expect, r.returncode, r.stdout, r.stderr)
        assert "serve.max_body_bytes" in json.loads((tmp_path / "out").read_text())["error"]["message"]


def test_a_client_sending_in_pieces_never_sees_its_send_fail_and_reads_the_413(served):
    for _ in range(2):
        with socket.create_connection(_addr(served), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(BIG))
            for i in range(0, len(BIG), 1 << 16):
                s.sendall(BIG[i:i + (1 << 16)])          # main: BrokenPipeError here
                time.sleep(0.0005)
            assert s.recv(65536).startswith(b"HTTP/1.1 413 ")


def test_requests_reads_the_413_and_a_head_alone_is_answered_at_once(served):
    url = served.url + "/v1/completions"
    r = requests.post(url, data=BIG, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "serve.max_body_bytes" in r.json()["error"]["message"], r.text[:200]
    r = requests.post(url, data=(BIG[i:i + (1 << 20)] for i in range(0, len(BIG), 1 << 20)),
                      headers={"Content-Type": "application/json"}, timeout=60)          # chunked
    assert r.status_code == 413 and "serve.max_body_bytes" in r.json()["error"]["message"], r.text[:200]
    with socket.create_connection(_addr(served), timeout=30) as s:     # only the head of a 9 MB body
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 9000000\r\n"
                  b"Content-Type: application/json\r\n\r\n{")
        reply = s.recv(65536)
        assert reply.startswith(b"HTTP/1.1 413") and time.monotonic() - t0 < 3.0, reply[:200]
    r = requests.post(url, json={"prompt": "2+2=", "max_tokens": 2}, timeout=60)      # the server serves on
    assert r.status_code == 200, r.text[:200]
