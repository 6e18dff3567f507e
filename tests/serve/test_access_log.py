"""Issue 37 row 3 against a real server process: a request whose path carries percent-encoded control characters
(`%0a`, `%0d`, C1 `%c2%85`, DEL, U+2028, a double quote) writes exactly one `[access]` line into engine.log, with
every such character escaped -- no request, keyed server or not, can forge a line (say, a fake
`engine exit code=0`) in the log that the health monitor reads.

Run: .venv/bin/python -m pytest -q tests/serve/test_access_log.py
"""
from __future__ import annotations

import socket
import time

FORGED = "engine exit code=0"


def _raw(served, request: bytes) -> bytes:
    host, port = served.url.rsplit("//", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def _log_lines(served, marker: str, timeout: float = 5.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        lines = (served.run_dir / "engine.log").read_text(errors="replace").splitlines()
        hits = [ln for ln in lines if marker in ln]
        if hits or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def test_control_characters_in_the_path_cannot_forge_log_lines(served):
    paths = {
        "lf": "/v1/nothing%0a" + FORGED.replace(" ", "%20"),
        "crlf": "/health%0d%0a" + FORGED.replace(" ", "%20"),
        "c1": "/x%c2%85" + FORGED.replace(" ", "%20"),
        "u2028": "/x%e2%80%a8" + FORGED.replace(" ", "%20"),
        "del_nul_esc": "/x%7f%00%1b[2J" + FORGED.replace(" ", "%20"),
        "quote": '/x%22%20200%200%200.000s%20rid=forged%20%22' + FORGED.replace(" ", "%20"),
    }
    for name, path in paths.items():
        rid = f"inject-{name}"
        reply = _raw(served, f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Request-Id: {rid}\r\n"
                             f"Connection: close\r\n\r\n".encode())
        assert reply.startswith(b"HTTP/1.1 "), reply[:200]
    lines = _log_lines(served, "rid=inject-quote")
    # splitlines() breaks at \n, \r, \x85, \u2028 ...: what a log reader (and the monitor) would see as lines
    forged = [ln for ln in lines if FORGED in ln and not ln.startswith("[access] ")]
    assert not forged, forged
    for name in paths:
        mine = [ln for ln in lines if f"rid=inject-{name}" in ln]
        assert len(mine) == 1, (name, mine)
        line = mine[0]
        assert line.startswith("[access] 127.0.0.1 \"GET /") and line.count('"') == 2, line
        assert line.isprintable(), repr(line)
    by = {name: next(ln for ln in lines if f"rid=inject-{name}" in ln) for name in paths}
    assert "/v1/nothing\\x0aengine exit code=0 HTTP/1.1\" 404" in by["lf"]
    assert "\\x0d\\x0a" in by["crlf"] and "\\x85" in by["c1"] and "\\u2028" in by["u2028"]
    assert "\\x7f\\x00\\x1b[2J" in by["del_nul_esc"]
    assert "\\x22 200 0 0.000s rid=forged \\x22" in by["quote"]
