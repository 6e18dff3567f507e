"""Issue 37's route rows against a real server process (tiny model, a 1024-token cache pool, a queue of 8):
`"max_tokens": null` is the default (16), not a 500; a chat without max_tokens whose context is longer than the
pool is admitted and capped by the pool (finish_reason "length"); `len(prompt) x n` beyond the queue is a 400
naming the field and the limit before any tokenizing (also for a list of 200000 prompts), and /health keeps
answering meanwhile.

Run: .venv/bin/python -m pytest -q tests/serve/test_route_limits.py
"""
from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from served_engine import alive, start_served, stop


@pytest.fixture(scope="module")
def small(tmp_path_factory, kdtree_cache):
    s = start_served(tmp_path_factory, kdtree_cache, "serve.kv_pool_tokens=1024", "serve.max_queue=8")
    yield s
    if alive(s.pid):
        stop(s.pid, signal.SIGKILL)


def post(url: str, path: str, body, timeout: float = 60):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_null_max_tokens_is_the_default(small):
    code, body = post(small.url, "/v1/completions", {"prompt": "def f(x):", "max_tokens": None, "temperature": 0})
    assert code == 200, body
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"


def test_chat_without_max_tokens_is_capped_by_the_pool_not_refused(small):
    # context 2048 > pool 1024: the default (the rest of the context) would never fit; it is capped instead
    code, body = post(small.url, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "def f(x):"}], "temperature": 0}, timeout=300)
    assert code == 200, body
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert body["usage"]["total_tokens"] <= 1024


@pytest.mark.parametrize("body,param", [
    ({"prompt": ["a"] * 3, "n": 3, "temperature": 1.0}, "n"),
    ({"prompt": ["x"] * 9}, "prompt"),
])
def test_more_completions_than_the_queue_can_ever_hold_is_a_400(small, body, param):
    code, err = post(small.url, "/v1/completions", {**body, "max_tokens": 2})
    assert code == 400 and err["error"]["param"] == param, err
    assert "serve.max_queue" in err["error"]["message"] and " 8 " in err["error"]["message"]


def test_a_huge_prompt_list_is_refused_before_tokenizing_and_health_answers(small):
    big = json.dumps({"prompt": ["ab"] * 200000, "max_tokens": 1}).encode()      # ~1.4 MB
    worst = []
    done = threading.Event()

    def probe():
        while not done.is_set():
            t0 = time.monotonic()
            with urllib.request.urlopen(small.url + "/health", timeout=10) as r:
                assert r.status == 200
            worst.append(time.monotonic() - t0)
            time.sleep(0.05)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t0 = time.monotonic()
    code, err = post(small.url, "/v1/completions", big)
    seconds = time.monotonic() - t0
    done.set()
    t.join(10)
    assert code == 400 and err["error"]["param"] == "prompt", err
    assert seconds < 10 and worst and max(worst) < 1.0, (seconds, max(worst or [0]))
