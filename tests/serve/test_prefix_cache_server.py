"""The prefix cache as an operator sees it, on a real engine process (`python -m kdtree.run`, tiny model, ddtree) with a
paged latent-cache pool far smaller than its working set (serve.kv_pool_tokens=640: 40 pages of 16, the running
requests' pages and the cached ones together): a repeated prompt is served from the cache with the same answer,
concurrent distinct long prompts evict pages and still answer as on their first (uncached) run, /status shows the
pool's pages used / cached / free adding up to its total, and /metrics exports them as
kdtree_prefix_cache_pages{state} with the same numbers.

Run: .venv/bin/python -m pytest -q tests/serve/test_prefix_cache_server.py
"""
from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from served_engine import alive, start_served, stop

KEY = "k-" + os.urandom(6).hex()
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
TEXT = ("You are a careful assistant. Answer briefly and exactly. Tools: search(q), calc(expr), read(path). "
        "Always cite the tool you used. ") * 2


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory, kdtree_cache):
    s = start_served(tmp_path_factory, kdtree_cache, "serve.kv_pool_tokens=640", "serve.prefix_cache_page=16",
                     extra_env={"KDTREE_API_KEY": KEY})
    yield s
    if alive(s.pid):
        stop(s.pid, signal.SIGKILL)


def post(url, prompt, max_tokens=8):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, AUTH)
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def toggle(url, body, headers=AUTH):
    req = urllib.request.Request(url + "/prefix_cache", json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def pages(url):
    with urllib.request.urlopen(url + "/status", timeout=30) as r:
        batch = json.loads(r.read())["batch"]
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        lines = dict(l.rsplit(" ", 1) for l in r.read().decode().splitlines() if l and not l.startswith("#"))
    st = {k: batch[f"prefix_cache_pages_{k}"] for k in ("used", "cached", "free", "total")}
    gauges = {k: float(lines[f'kdtree_prefix_cache_pages{{state="{k}"}}']) for k in ("used", "cached", "free")}
    return st, gauges, batch


def test_pages_add_up_and_answers_stay_exact_under_pressure(small_cache):
    url = small_cache.url
    st, gauges, batch = pages(url)
    assert st["total"] == 40 and st["used"] == 0 and st["cached"] + st["free"] == 40   # (warm-up's rows are cached)
    assert batch["kv_pool_tokens"] == 640 and batch["kv_pool_used"] == 0
    first, c0 = post(url, TEXT + "Q: 2+2?")
    again, c1 = post(url, TEXT + "Q: 2+2?")
    assert c0 == 0 and c1 > 0 and again == first                  # a hit, the same answer
    st, gauges, _ = pages(url)
    assert st["cached"] > 0 and st["used"] + st["cached"] + st["free"] == st["total"] == 40
    assert gauges == {k: float(st[k]) for k in ("used", "cached", "free")}
    # 6 distinct long prompts (~16 pages each with their answers), 3 at a time, twice: far more than 40 pages
    prompts = [f"Question {i}: " + TEXT[i * 7:] + f" Q{i}: what is {i} * {i + 3}?" for i in range(6)]
    with ThreadPoolExecutor(3) as ex:
        one = list(ex.map(lambda p: post(url, p), prompts))
        two = list(ex.map(lambda p: post(url, p), prompts))
    assert [t for t, _ in one] == [t for t, _ in two]              # cached or not, evicted or not: the same answers
    st, gauges, batch = pages(url)
    assert batch["prefix_cache_evictions"] > 0
    assert st["used"] == 0 and st["cached"] + st["free"] == 40 and batch["prefix_cache_tokens"] <= 640
    assert gauges == {k: float(st[k]) for k in ("used", "cached", "free")}


def test_toggle_turns_the_cache_off_and_on_for_new_requests(small_cache):
    """POST /prefix_cache {"enabled": false}: no lookups (cached_tokens 0), no inserts, the same answer; the key when
    one is set (401 without it), 400 for a body without a bool."""
    url, prompt = small_cache.url, TEXT[:60] + " Q: toggle?"
    assert toggle(url, {"enabled": False}, {"Content-Type": "application/json"})[0] == 401
    assert toggle(url, {"enabled": "no"})[0] == 400
    code, body = toggle(url, {"enabled": False})
    assert code == 200 and body["enabled"] is False and body["pages_total"] == 40
    off = [post(url, prompt) for _ in range(2)]
    assert [c for _, c in off] == [0, 0]
    with urllib.request.urlopen(url + "/status", timeout=30) as r:
        assert json.loads(r.read())["batch"]["prefix_cache_enabled"] is False
    assert toggle(url, {"enabled": True}) == (200, toggle(url, {"enabled": True})[1])
    on = [post(url, prompt) for _ in range(2)]
    assert on[0][1] == 0 and on[1][1] > 0                          # the first run inserted it: enabled again
    assert {t for t, _ in off + on} == {off[0][0]}
