"""`pipeline=stop` under load loses nothing: 32 requests in flight (streamed and not) when the stop comes; every
accepted one completes (or got a clean 503 before it started), no stream is cut, a request arriving during the
drain gets 503 + Retry-After, the engine exits 0, and the stop reports how many requests it drained."""
from __future__ import annotations

import http.client
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from served_engine import alive, kdtree_run, start_served, stop

MAX_TOKENS = 400        # 32 x 400 tokens is several seconds of batched decoding: outlasts the stop command's start-up


def _complete(url: str, i: int):
    body = {"prompt": f"request {i}: def ", "max_tokens": MAX_TOKENS, "temperature": 0}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return "plain", r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return "plain", e.code, json.loads(e.read())


def _stream(url: str, i: int):
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    body = {"prompt": f"stream {i}: class ", "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        return "stream", r.status, json.loads(r.read())
    events = []
    for line in r:
        if line.startswith(b"data: "):
            data = line[6:].strip()
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    conn.close()
    return "stream", 200, events


def test_pipeline_stop_with_32_requests_in_flight_loses_none(tmp_path_factory, kdtree_cache):
    s = start_served(tmp_path_factory, kdtree_cache)
    try:
        with ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(_stream if i % 4 == 0 else _complete, s.url, i) for i in range(32)]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and s.status().get("phase") == "ready":
                st = json.loads(urllib.request.urlopen(s.url + "/status", timeout=10).read())
                if st["queue_depth"] + st["in_flight"] >= 16:   # most of them accepted (batched or waiting): stop now
                    break
                time.sleep(0.01)
            out = {}
            stopper = threading.Thread(target=lambda: out.update(r=kdtree_run(
                ["pipeline=stop", f"stop.run_dir={s.run_dir}", f"hydra.run.dir={s.run_dir.parent / 'stop'}"],
                kdtree_cache, s.run_dir.parent, timeout=300)))
            stopper.start()
            late = None
            while stopper.is_alive() and s.status().get("phase") != "draining":
                time.sleep(0.02)
            try:                                            # a request arriving during the drain
                urllib.request.urlopen(urllib.request.Request(
                    s.url + "/v1/completions", data=b'{"prompt": "late", "max_tokens": 2}', method="POST",
                    headers={"Content-Type": "application/json"}), timeout=30)
            except urllib.error.HTTPError as e:
                late = (e.code, e.headers.get("Retry-After"), json.loads(e.read()))
            stopper.join(300)
            results = [f.result(timeout=300) for f in futures]
    finally:
        if alive(s.pid):
            stop(s.pid, signal.SIGKILL)
    r = out["r"]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (s.run_dir / "engine.exit").read_text().strip() == "0"
    completed = 0
    for kind, code, body in results:
        if code == 503:                                     # refused before it started: a clean JSON answer
            assert body["error"]["code"] == "draining", body
            continue
        assert code == 200, (kind, code, body)
        completed += 1
        if kind == "plain":
            assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["finish_reason"] in ("length", "stop")
        else:                                               # never cut: a finish_reason, then [DONE], no error
            assert body[-1] == "[DONE]" and not any("error" in e for e in body[:-1] if isinstance(e, dict))
            assert [c["finish_reason"] for e in body[:-1] for c in e["choices"] if c["finish_reason"]]
    assert completed >= 16                                  # at least the ones queued when the stop came
    assert late is not None and late[1] == "1" and late[2]["error"]["code"] == "draining", late
    m = [line for line in r.stdout.splitlines() if "drained" in line]
    assert m and m[-1].endswith("cut 0"), r.stdout[-1500:]
    assert 1 <= int(m[-1].split("drained ")[1].split()[0]) <= completed


def test_a_stream_cut_by_the_drain_timeout_ends_with_an_error_event(tmp_path_factory, kdtree_cache):
    """serve.drain_timeout_s=1 and a stream of 1500 slow tokens: the stream is not silently cut, it gets an
    `error` event (code cut_by_shutdown) and [DONE]; the engine still exits 0 and counts it as cut."""
    s = start_served(tmp_path_factory, kdtree_cache, "model.init=random", "serve.drain_timeout_s=1")
    try:
        host, port = s.url.split("//", 1)[1].rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "cut me", "max_tokens": 1500, "stream": True,
                                                         "temperature": 0}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        assert r.readline().startswith(b"data: ")           # streaming has begun
        assert stop(s.pid, signal.SIGTERM, timeout=60)
        events = [json.loads(line[6:]) if line[6:].strip() != b"[DONE]" else "[DONE]"
                  for line in r if line.startswith(b"data: ")]
        conn.close()
    finally:
        if alive(s.pid):
            stop(s.pid, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "cut_by_shutdown", events[-3:]
    assert (s.run_dir / "engine.exit").read_text().strip() == "0"
    assert s.status()["cut"] == 1 and s.status()["drained"] == 0
