"""Issue 37's route rows against a real server process (tiny model, a 1024-token cache pool, a queue of 8):
`"max_tokens": null` is the default (16), not a 500; a chat without max_tokens whose context is longer than the
pool is admitted and capped by the pool (finish_reason "length"); `len(prompt) x n` beyond the queue is a 400
naming the field and the limit before any tokenizing (also for a list of 200000 prompts), and /health keeps
answering meanwhile; tokenizing 60000 prompts runs off the event loop (/health within 1 s throughout).

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


def _while_health_polled(url: str, body: bytes, path: str = "/v1/completions"):
    """POST `body` while /health is polled every 20 ms: (code, error body, seconds, worst /health seconds)."""
    worst = []
    done = threading.Event()

    def probe():
        while not done.is_set():
            t0 = time.monotonic()
            with urllib.request.urlopen(url + "/health", timeout=30) as r:
                assert r.status == 200
            worst.append(time.monotonic() - t0)
            time.sleep(0.02)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t0 = time.monotonic()
    code, err = post(url, path, body, timeout=120)
    seconds = time.monotonic() - t0
    done.set()
    t.join(30)
    return code, err, seconds, max(worst or [0.0])


def test_a_huge_prompt_list_is_refused_before_tokenizing_and_health_answers(small):
    big = json.dumps({"prompt": ["ab"] * 200000, "max_tokens": 1}).encode()      # ~1.4 MB
    code, err, seconds, worst = _while_health_polled(small.url, big)
    assert code == 400 and err["error"]["param"] == "prompt", err
    assert seconds < 10 and worst < 1.0, (seconds, worst)


@pytest.fixture(scope="module")
def wide(tmp_path_factory, kdtree_cache):
    s = start_served(tmp_path_factory, kdtree_cache, "serve.max_queue=100000")
    yield s
    if alive(s.pid):
        stop(s.pid, signal.SIGKILL)


@pytest.mark.parametrize("kind", ["text", "token_ids"])
def test_tokenizing_a_request_of_many_prompts_never_blocks_health(wide, kind):
    """Issue 37 row 2: 60000 prompts (each tokenized; or 40000 id lists checked and decoded), the last one too long for the
    context, so the request ends as a 400 after every prompt was tokenized: /health answers within 1 s meanwhile
    (tokenizing runs in a worker thread, not on the event loop)."""
    # (fewer id lists: FastAPI parses the body on the loop, ~10 us per list)
    many = ["x y"] * 59999 + ["z" * 5000] if kind == "text" else [[120, 32, 121]] * 39999 + [[122] * 5000]
    code, err, seconds, worst = _while_health_polled(wide.url, json.dumps({"prompt": many, "max_tokens": 1}).encode())
    assert code == 400 and err["error"]["code"] == "context_length_exceeded", err
    assert worst < 1.0, f"/health took {worst:.2f} s while {seconds:.2f} s of tokenizing ran"
    print(f"{kind}: the request took {seconds:.2f} s, /health at worst {worst * 1000:.0f} ms")


@pytest.mark.parametrize("body,param,words", [
    (b"", None, "request body is empty; send a JSON object"),
    (b'{"prompt": [-1]}', "prompt", "prompt.0: Input should be greater than or equal to 0; got -1"),
    (b'{"prompt": "x", "max_tokens": 5000}', "max_tokens", "maximum context length is 2048 tokens"),
    (json.dumps({"prompt": "x", "stop": [f"s{i}" for i in range(17)]}).encode(), "stop", "at most 16 items"),
])
def test_bad_input_messages_name_the_field_and_the_limit(small, body, param, words):
    """Issue 37 row 9: not "missing required field 'None'", "valid string" or `param: prompt` for a max_tokens."""
    code, err = post(small.url, "/v1/completions", body)
    assert code == 400 and err["error"]["param"] == param and words in err["error"]["message"], err
    assert "None" not in err["error"]["message"] and "valid string" not in err["error"]["message"], err


def test_a_million_prompt_body_is_refused_while_health_and_a_canary_completion_answer(small):
    """Issue 37 acceptance (row 2 at full size): one ~4 MB completion whose prompt is a list of 1,000,000 strings is
    a 400 naming `prompt` and serve.max_queue, while /health and a one-token canary completion, timed on fresh
    connections the whole time, answer 200 within 1 s."""
    from test_slowloris import Canary

    big = json.dumps({"prompt": ["a"] * 1_000_000, "max_tokens": 1}, separators=(",", ":")).encode()
    assert 3_900_000 < len(big) < 8 << 20                           # under serve.max_body_bytes: parsed, not a 413
    with Canary(small.url) as canary:
        time.sleep(0.5)
        t0 = time.monotonic()
        code, err = post(small.url, "/v1/completions", big, timeout=120)
        seconds = time.monotonic() - t0
        time.sleep(0.5)
    print(f"1M prompts: {code} in {seconds:.2f} s; canary {canary.n} requests, worst {canary.worst * 1000:.0f} ms")
    assert code == 400 and err["error"]["param"] == "prompt" and "serve.max_queue" in err["error"]["message"], err
    assert not canary.errors and canary.n >= 4 and canary.worst < 1.0, (canary.errors[:3], canary.n, canary.worst)
