"""Continuous batching through the real server process: concurrent clients (completions and chat, streamed and not,
multi-token stop strings) are decoded together (/status and /metrics show the batch) and every answer equals the
answer to the same request sent alone; usage counts the same tokens streamed or not; a client that disconnects,
streaming or not, frees the engine within a step.

Run: .venv/bin/python -m pytest -q tests/serve/test_batching.py
"""
from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

from test_server_process import get, post

PROMPTS = ["def __init__(self, ", "import os\nimport sys\n\n", "Return a new list containing ", "    for i in range(",
           "class Connection:\n    \"\"\"", "The following example shows how to "]


def sse(url: str, body: dict, path="/v1/completions"):
    """A streamed request's text and final usage chunk (urllib reads the SSE body to [DONE])."""
    import urllib.request
    req = urllib.request.Request(url + path, data=json.dumps({**body, "stream": True,
                                                              "stream_options": {"include_usage": True}}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    text, usage, finish = "", None, None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                finish = ch.get("finish_reason") or finish
    return text, usage, finish


def requests_mix():
    out = []
    for i, p in enumerate(PROMPTS * 2):
        body = {"prompt": p, "max_tokens": [4, 40, 90, 17][i % 4], "temperature": 0}
        if i % 3 == 1:
            body["stop"] = ["self.", "\n\n    "]        # multi-token stop strings
        out.append(body)
    return out


def status_batch(url):
    code, text = get(url, "/status")
    return json.loads(text)["batch"]


def test_concurrent_clients_are_batched_and_each_gets_its_solo_answer(served):
    bodies = requests_mix()
    alone = [post(served.url, b)[1] for b in bodies]
    seen = {"running": 0, "batch_size": 0, "speculating": set()}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            b = status_batch(served.url)
            seen["running"] = max(seen["running"], b["running"])
            seen["batch_size"] = max(seen["batch_size"], b["batch_size"])
            seen["speculating"].add(b["speculating"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(bodies)) as pool:
            plain = list(pool.map(lambda b: post(served.url, b)[1], bodies))
            streamed = list(pool.map(lambda b: sse(served.url, b), bodies))
    finally:
        stop.set()
        watcher.join()
    for a, p, (text, usage, finish) in zip(alone, plain, streamed):
        assert p["choices"][0]["text"] == a["choices"][0]["text"] == text
        assert p["choices"][0]["finish_reason"] == a["choices"][0]["finish_reason"] == finish
        for u in (p["usage"], a["usage"], usage):               # cached_tokens: a repeat may hit the prefix cache
            u.pop("prompt_tokens_details", None)
        assert p["usage"] == a["usage"] == usage               # the same tokens counted streamed or not
    assert any(a["choices"][0]["finish_reason"] == "stop" for a in alone)
    assert seen["running"] >= 4 and seen["batch_size"] >= 4, seen
    code, metrics = get(served.url, "/metrics")
    assert "kdtree_batch_size" in metrics and "kdtree_num_requests_waiting" in metrics
    assert "kdtree_speculating" in metrics and seen["speculating"] <= {True, False} and seen["speculating"], seen


def test_chat_requests_batch_with_completions(served):
    msgs = [{"role": "user", "content": "def fib(n):"}]
    body = {"messages": msgs, "max_tokens": 30, "temperature": 0}
    alone = post(served.url, body, path="/v1/chat/completions")[1]
    with ThreadPoolExecutor(6) as pool:
        chats = [pool.submit(post, served.url, body, "/v1/chat/completions") for _ in range(3)]
        others = [pool.submit(post, served.url, {"prompt": p, "max_tokens": 30, "temperature": 0}) for p in PROMPTS[:3]]
        for f in chats:
            assert f.result()[1]["choices"] == alone["choices"]
        assert all(f.result()[0] == 200 for f in others)


def _send_and_hang_up(url: str, body: dict, wait_s: float, read_first: bool) -> None:
    u = urlparse(url)
    data = json.dumps(body).encode()
    s = socket.create_connection((u.hostname, u.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    if read_first:
        s.recv(1)                                   # the stream has started
    time.sleep(wait_s)
    s.close()


def _engine_free_after(url: str, limit_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        b = status_batch(url)
        if b["running"] == 0 and b["waiting"] == 0:
            return time.monotonic() - t0
        time.sleep(0.01)
    raise AssertionError(f"engine still busy {limit_s} s after the client left: {status_batch(url)}")


def test_a_client_that_disconnects_cancels_its_request(served):
    long = {"prompt": "def __init__(self, ", "max_tokens": 1500, "temperature": 0}
    for stream in (False, True):
        _send_and_hang_up(served.url, {**long, "stream": stream}, 0.5, read_first=stream)
        # a step is one verify round (~20-50 ms here); the server polls for a disconnect every 50 ms
        assert _engine_free_after(served.url, 2.0) < 2.0
        code, r = post(served.url, {"prompt": "2+2=", "max_tokens": 4, "temperature": 0})
        assert code == 200 and r["usage"]["completion_tokens"] == 4


def test_prefix_cache_hit_same_answer_and_counted(served):
    """A second turn that extends the first turn's prompt + answer is served from the prefix cache:
    usage.prompt_tokens_details.cached_tokens > 0 (streamed too), /metrics counts it (exactness: tests/decode)."""
    prompt = "class Connection:\n    \"\"\"A connection to the server, with its socket and its buffers.\"\"\"\n\n    def "
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
    code, first = post(served.url, body)
    assert code == 200
    turn2 = {"prompt": prompt + first["choices"][0]["text"] + "\n    def close(self", "max_tokens": 12, "temperature": 0}
    code, hit = post(served.url, turn2)
    assert code == 200 and hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, hit["usage"]
    _, stream_usage, _ = sse(served.url, turn2)
    assert stream_usage["prompt_tokens_details"]["cached_tokens"] > 0
    code, metrics = get(served.url, "/metrics")
    hits = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("kdtree_prefix_cache_hits_total")]
    queries = [float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("kdtree_prefix_cache_queries_total")]
    assert hits and queries and 0 < hits[0] <= queries[0], (hits, queries)
