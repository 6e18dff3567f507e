"""The server as users meet it: a real engine process started by `python -m kdtree.run`, real HTTP (curl, 16
concurrent clients, live streams), SIGTERM draining, sd_notify and the API key. (The OpenAI API surface and bad
inputs: test_openai_api.py; pipeline=stop under load: test_stop_drain.py.)"""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from served_engine import alive, start_served, stop


def post(url: str, body, path="/v1/completions", raw: bytes = None, headers=None, timeout=60):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str, path: str, headers=None):
    req = urllib.request.Request(url + path, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_curl_post_returns_choices_text(served):
    body = json.dumps({"model": "tiny", "prompt": "2+2=", "max_tokens": 4, "temperature": 0})
    out = subprocess.run(["curl", "-sS", "-H", "Content-Type: application/json", "-d", body,
                          served.url + "/v1/completions"], capture_output=True, text=True, timeout=60)
    resp = json.loads(out.stdout)
    assert resp["object"] == "text_completion" and resp["model"] == "tiny"
    assert isinstance(resp["choices"][0]["text"], str)
    assert resp["usage"]["prompt_tokens"] == 4
    assert resp["choices"][0]["finish_reason"] in ("length", "eos", "stop")
    # the same prompt as token ids is the same request
    code, by_ids = post(served.url, {"prompt": [50, 43, 50, 61], "max_tokens": 4, "temperature": 0})
    assert code == 200 and by_ids["choices"][0]["text"] == resp["choices"][0]["text"]


def test_sixteen_clients_get_the_single_client_greedy_answers(served):
    prompts = [f"client prompt {i}: " for i in range(8)]
    single = {}
    for p in prompts:                                   # one client, one request at a time
        code, r = post(served.url, {"prompt": p, "max_tokens": 4, "temperature": 0})
        assert code == 200
        single[p] = r["choices"][0]["text"]

    def client(c: int):
        out = []
        for j in range(8):
            p = prompts[(c + j) % 8]
            code, r = post(served.url, {"model": "tiny", "prompt": p, "max_tokens": 4, "temperature": 0}, timeout=120)
            out.append((p, code, r["choices"][0]["text"] if code == 200 else r))
        return out

    with ThreadPoolExecutor(16) as pool:
        results = [x for batch in pool.map(client, range(16)) for x in batch]
    assert len(results) == 128
    assert all(code == 200 for _, code, _ in results), [r for r in results if r[1] != 200][:3]
    assert all(text == single[p] for p, _, text in results)


def test_operator_endpoints(served):
    code, text = get(served.url, "/health")
    assert code == 200 and json.loads(text)["phase"] == "ready"
    assert get(served.url, "/ready")[0] == 200
    st = json.loads(get(served.url, "/status")[1])
    assert st["phase"] == "ready" and st["bytes_done"] == st["bytes_total"] > 0
    # every verify block size of the tree (root + 0..budget=4 nodes), prefill lengths, one decode round, one step of
    # 4 requests batched (the server's shape)
    assert set(st["warmup_seconds"]) == {"prefill_1", "prefill_16", "prefill_128", "decode_tree_4", "batch_4", "grammar_vocab",
                                         *(f"verify_{t}" for t in range(1, 6))}
    assert "seconds" in st["phases"]["loading"] and "seconds" in st["phases"]["warmup"]
    post(served.url, {"prompt": "metrics", "max_tokens": 3})
    code, metrics = get(served.url, "/metrics")
    assert code == 200
    lines = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
    assert float(lines['kdtree_requests_total{code="200",endpoint="/v1/completions"}']) >= 1
    assert float(lines["kdtree_generation_tokens_total"]) >= 3
    assert float(lines["kdtree_acceptance_length_count"]) >= 1
    assert float(lines['kdtree_stage_seconds_total{stage="verify"}']) > 0
    assert float(lines['kdtree_phase_seconds{phase="loading"}']) > 0
    assert float(lines['kdtree_phase{phase="ready"}']) == 1


def sse(url: str, body: dict, timeout: float = 120):
    """POST a streamed completion; [(arrival time, parsed data event)] up to and including [DONE]."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream"), r.read()[:300]
    events = []
    while True:
        line = r.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            data = line[6:].strip()
            events.append((time.monotonic() - t0, "[DONE]" if data == b"[DONE]" else json.loads(data)))
            if data == b"[DONE]":
                break
    conn.close()
    return events


def streamed_text(events, index=0):
    return "".join(c["text"] for _, e in events if isinstance(e, dict) for c in e.get("choices", [])
                   if c["index"] == index)


def finish_reason(events, index=0):
    (reason,) = [c["finish_reason"] for _, e in events if isinstance(e, dict) for c in e.get("choices", [])
                 if c["index"] == index and c["finish_reason"]]
    return reason


@pytest.fixture(scope="module")
def slow_served(tmp_path_factory, kdtree_cache):
    """Random weights: the drafter never agrees, so one verify per token and generation lasts long enough to
    watch a stream arrive (the trained tiny model accepts ~7 tokens per round and finishes too fast)."""
    s = start_served(tmp_path_factory, kdtree_cache, "model.init=random")
    yield s
    if alive(s.pid):
        stop(s.pid, signal.SIGKILL)


def test_stream_is_live_and_equals_the_non_streamed_text(slow_served):
    served = slow_served
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0}
    code, plain = post(served.url, body, timeout=120)
    assert code == 200
    text, gen_s = plain["choices"][0]["text"], plain["kdtree"]["seconds"]
    assert plain["usage"]["completion_tokens"] == 400 and gen_s > 0.5, plain   # long enough to watch it stream
    events = sse(served.url, body)
    assert events[-1][1] == "[DONE]"
    chunks = [(t, e) for t, e in events if isinstance(e, dict) and e["choices"] and e["choices"][0]["text"]]
    first_t, last_t = chunks[0][0], chunks[-1][0]
    # the first text arrives while the engine still generates: long before the last, not all at the end
    assert last_t - first_t > 0.5 * gen_s, (first_t, last_t, gen_s)
    assert first_t < 0.5 * last_t
    assert len(chunks) > 10
    assert streamed_text(events) == text
    assert finish_reason(events) == plain["choices"][0]["finish_reason"] == "length"


def test_stream_with_stop_strings_echo_usage_and_two_prompts_equals_non_streamed(served):
    base = {"prompt": "Once upon a time", "max_tokens": 60, "temperature": 0}
    code, plain = post(served.url, base)
    full = plain["choices"][0]["text"]
    # a multi-character stop string from the middle of the text (held back while it could be starting), one
    # that is never generated, and a single-character one (a stop token id: the engine itself stops)
    mid = next(full[i:i + 3] for i in range(len(full) // 2, len(full) - 3) if "\ufffd" not in full[i:i + 3])
    single = next(ch for ch in full[5:] if len(ch.encode()) == 1)
    for stop_at in ([mid], ["never-generated-zzz", mid], [single], "never-generated-zzz"):
        body = dict(base, stop=stop_at)
        code, want = post(served.url, body)
        assert code == 200
        events = sse(served.url, body)
        assert streamed_text(events) == want["choices"][0]["text"], stop_at
        assert finish_reason(events) == want["choices"][0]["finish_reason"], stop_at
        if stop_at != "never-generated-zzz":
            assert finish_reason(events) == "stop" and len(want["choices"][0]["text"]) < len(full)
    body = {"prompt": ["2+2=", "Once upon a time"], "max_tokens": 20, "stop": [mid], "echo": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    code, want = post(served.url, body)
    events = sse(served.url, body)
    for i in (0, 1):
        assert streamed_text(events, i) == want["choices"][i]["text"]
        assert finish_reason(events, i) == want["choices"][i]["finish_reason"]
    usage = [e["usage"] for _, e in events if isinstance(e, dict) and e.get("usage")]
    assert usage and usage[-1]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert usage[-1]["completion_tokens"] <= want["usage"]["completion_tokens"]
    # errors before the first token still answer as JSON, and the server streams on afterwards
    # (2040 + 8 tokens fit the context, but not with the tree's verify block)
    code, err = post(served.url, {"prompt": "x" * 2040, "max_tokens": 8, "stream": True})
    assert code == 400 and err["error"]["code"] == "context_length_exceeded", err
    assert streamed_text(sse(served.url, {"prompt": "2+2=", "max_tokens": 3, "temperature": 0})) == \
        post(served.url, {"prompt": "2+2=", "max_tokens": 3, "temperature": 0})[1]["choices"][0]["text"]


def test_a_client_leaving_a_stream_frees_the_engine(served):
    host, port = served.url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "leave", "max_tokens": 1500, "stream": True,
                                                        "temperature": 0}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.readline().startswith(b"data: ")
    r.close()
    conn.close()                                           # gone after the first chunk
    t0 = time.monotonic()
    code, resp = post(served.url, {"prompt": "2+2=", "max_tokens": 2}, timeout=60)
    assert code == 200
    assert time.monotonic() - t0 < 10                     # 1500 tokens would take far longer


def test_sigterm_drains_the_request_in_flight_and_exits_0(served):
    """Last in this module: it stops the shared server."""
    result = {}
    t = threading.Thread(target=lambda: result.update(r=post(served.url, {"prompt": "drain me", "max_tokens": 40,
                                                                                 "temperature": 0})))
    t.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:                  # wait until the worker has it
        st = json.loads(get(served.url, "/status")[1])
        if st["in_flight"] or st["queue_depth"]:
            break
        time.sleep(0.01)
    assert stop(served.pid, signal.SIGTERM, timeout=60), "the engine did not exit after SIGTERM"
    t.join(60)
    code, body = result["r"]
    assert code == 200 and body["usage"]["completion_tokens"] >= 1
    assert (served.run_dir / "engine.exit").read_text().strip() == "0"
    assert served.status()["phase"] == "stopped"
    assert "draining" in served.status()["phases"]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(served.url.rsplit(":", 1)[1])), timeout=2).close()


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_sd_notify_and_api_key(tmp_path_factory, kdtree_cache, tmp_path):
    """Under systemd (NOTIFY_SOCKET): STATUS + EXTEND_TIMEOUT_USEC while loading, READY=1 when serving."""
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.2)
    messages = []
    done = threading.Event()

    def listen():
        while not done.is_set():
            try:
                messages.append(sock.recv(4096).decode())
            except socket.timeout:
                continue

    th = threading.Thread(target=listen, daemon=True)
    th.start()
    key = "s3cret-" + os.urandom(8).hex()
    s = start_served(tmp_path_factory, kdtree_cache, extra_env={"NOTIFY_SOCKET": str(sock_path), "KDTREE_API_KEY": key})
    try:
        code, body = post(s.url, {"prompt": "2+2=", "max_tokens": 2})
        assert code == 401 and "Bearer" in body["error"]["message"]
        # the key is checked before the body is read: no key + a malformed body is a 401, not a 400
        assert post(s.url, None, raw=b'{"prompt": ')[0] == 401
        code, body = post(s.url, {"prompt": "2+2=", "max_tokens": 2}, headers={"Authorization": f"Bearer {key}"})
        assert code == 200
        openai = pytest.importorskip("openai")
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=60)
        assert c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=2).usage.completion_tokens == 2
        assert get(s.url, "/health")[0] == 200             # operator endpoints stay open for monitors
        leaks = [pid for pid in os.listdir("/proc") if pid.isdigit() and key.encode() in _cmdline(pid)]
        assert not leaks, f"the API key is on the command line of {leaks}"
    finally:
        stop(s.pid, signal.SIGTERM)
        time.sleep(0.3)
        done.set()
        th.join(2)
        sock.close()
    # the monitor probed with the key (READY needs a 200), yet no file of the run holds it
    assert "READY" in s.stdout
    files = [p for p in s.run_dir.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert not files, files
    text = "\n".join(messages)
    assert "STATUS=loading" in text and "EXTEND_TIMEOUT_USEC=" in text
    assert any("READY=1" in m for m in messages) and "STOPPING=1" in text
    ready_at = next(i for i, m in enumerate(messages) if "READY=1" in m)
    assert all("READY=1" not in m for m in messages[:ready_at]) and "STATUS=ready" in messages[ready_at]


def test_cpu_server_leaves_a_core_to_http(tmp_path_factory, kdtree_cache):
    """backend=cpu, backend.threads=0 (auto): the serving process runs its native forward on every core but one
    (the HTTP front end's), and says so in the ready event; an explicit backend.threads wins."""
    omp = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    auto = int(omp) if omp.isdigit() and int(omp) > 0 else max(1, len(os.sched_getaffinity(0)) - 1)
    for overrides, want in ((("backend=cpu",), auto), (("backend=cpu", "backend.threads=3"), 3)):
        s = start_served(tmp_path_factory, kdtree_cache, *overrides)
        try:
            events = [json.loads(line) for line in (s.run_dir / "events.jsonl").read_text().splitlines()]
            ready = [e for e in events if e["kind"] == "ready"]
            assert ready and ready[-1]["threads"] == want, ready
            assert f"native forward on {want} thread(s)" in (s.run_dir / "engine.log").read_text()
            code, out = post(s.url, {"prompt": "the", "max_tokens": 4, "temperature": 0})
            assert code == 200 and out["usage"]["completion_tokens"] == 4
        finally:
            if alive(s.pid):
                stop(s.pid, signal.SIGKILL)
