"""The OpenAI API as clients meet it, on a real engine process: the official `openai` client (completions and chat,
streamed and not, models), schemathesis fuzzing /openapi.json, and a suite of bad inputs that must each get a
JSON 4xx while the server keeps answering correctly."""
from __future__ import annotations

import json
import socket
import subprocess

import pytest
from hypothesis import HealthCheck, Phase, settings

from test_server_process import get, post

openai = pytest.importorskip("openai")
schemathesis = pytest.importorskip("schemathesis")


def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_client_completions_streamed_and_not(served):
    c = client(served)
    r = c.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=12, temperature=0)
    text = r.choices[0].text
    assert r.object == "text_completion" and r.usage.prompt_tokens == 14 and r.usage.completion_tokens == 12
    assert r.choices[0].finish_reason == "length" and len(text) > 0
    chunks = list(c.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="Hello", max_tokens=2, temperature=-1)
    assert e.value.body["param"] == "temperature"


def test_openai_client_chat_streamed_and_not_and_models(served):
    c = client(served)
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    text = r.choices[0].message.content
    assert r.usage.completion_tokens <= 10 and r.choices[0].finish_reason in ("length", "stop")
    # the prompt is the tiny chat template rendered with add_generation_prompt: its tokens are its bytes
    rendered = ("<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\ndef fib(n):<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert r.usage.prompt_tokens == len(rendered.encode())
    code, plain = post(served.url, {"prompt": rendered, "max_tokens": 10, "stop": "<|im_end|>", "temperature": 0})
    assert code == 200 and plain["choices"][0]["text"] == text        # chat = completion of the rendered template
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert [m.id for m in c.models.list().data] == ["tiny"]
    m = c.models.retrieve("tiny")
    assert m.id == "tiny" and m.model_extra["max_model_len"] == 2048
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")


def test_context_check_counts_the_tree_budget(served):
    # tree.budget=4: 2048 - 16 - (4 + 1) = 2027 prompt tokens fit; one more does not, with a code to act on
    assert post(served.url, {"prompt": [65] * 2027, "max_tokens": 16})[0] == 200
    code, body = post(served.url, {"prompt": [65] * 2028, "max_tokens": 16})
    assert code == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "verify block" in body["error"]["message"] and body["error"]["param"] == "prompt"


def raw_http(served, data: bytes, timeout=30) -> bytes:
    host, port = served.url.split("//", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk


def json_error(raw: bytes):
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    assert b"content-type: application/json" in head.lower(), head
    return status, json.loads(body)["error"]


BAD_BODIES = [
    # (body bytes, status, param, words)
    (b'{"prompt": "a\\ud800b"}', 400, "prompt", "lone UTF-16 surrogate"),
    (b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None, "nested too deeply"),
    (b'{"prompt": "x", "echo": "false"}', 400, "echo", "valid boolean"),
    (b'{"prompt": "x", "stream": "false"}', 400, "stream", "valid boolean"),
    (b'{"prompt": "x", "stream_options": {"include_usage": "false"}}', 400, "stream_options.include_usage",
     "valid boolean"),
    (b'{"prompt": "x", "temperature": NaN}', 400, "temperature", "finite number"),
    (b'{"prompt": "x", "temperature": "0"}', 400, "temperature", "valid number"),
    (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens", "greater than or equal to 1"),
    (b'{"prompt": "x", "max_tokens": 2.5}', 400, "max_tokens", "valid integer"),
    (b'{"prompt": "x", "max_tokens": true}', 400, "max_tokens", "valid integer"),
    (b'{"prompt": "x", "temperature": -1}', 400, "temperature", "greater than or equal to 0"),
    (b'{"prompt": "x", "top_p": 0}', 400, "top_p", "greater than 0"),
    (b'{"prompt": "x", "top_k": -2}', 400, "top_k", "greater than or equal to -1"),
    (b'{"prompt": "x", "repetition_penalty": 0}', 400, "repetition_penalty", "greater than 0"),
    (b'{"prompt": "x", "presence_penalty": 3}', 400, "presence_penalty", "less than or equal to 2"),
    (b'{"prompt": "x", "seed": 1.5}', 400, "seed", "valid integer"),
    (b'{"prompt": "x", "logit_bias": {"5": 10}}', 400, "logit_bias", "not supported"),
    (b'{"prompt": "x", "suffix": "y"}', 400, "suffix", "not supported"),
    (b'{"prompt": "x", "best_of": 2}', 400, "best_of", "not supported"),
    (b'{"prompt": "x", "n": 0}', 400, "n", "greater than or equal to 1"),
    (b'{"prompt": "x", "n": 2, "temperature": 0}', 400, "n", "greedy decoding has one answer"),
    (b'{"prompt": "x", "logprobs": 9}', 400, "logprobs", "less than or equal to 5"),
    (b'{"prompt": "x", "frobnicate": 1}', 400, "frobnicate", "unknown parameter 'frobnicate'"),
    (b'{"model": "tiny", "max_tokens": 4}', 400, "prompt", "missing required field 'prompt'"),
    (b'{"prompt": "x", "stop": 5}', 400, "stop", "valid string"),
    (b'{"prompt": [1, 99999]}', 400, "prompt", "token id 99999"),
    (b'{"prompt": [-1]}', 400, "prompt", "prompt"),
    (b'{"prompt": ""}', 400, "prompt", "prompt is empty"),
    (b'{"prompt": []}', 400, "prompt", "prompt must be"),
    (b'{"model": "gpt-4", "prompt": "x"}', 404, "model", "'gpt-4' is not served here"),
    (b'{"model": "tiny", "prompt": "2+2=", ', 400, None, "not valid JSON"),
    (b'[1, 2]', 400, None, "JSON object"),
    (b'"just a string"', 400, None, "JSON object"),
    (b'\xff\xfe', 400, None, "JSON"),
]


@pytest.mark.parametrize("body,status,param,words", BAD_BODIES, ids=[f"bad{i}" for i in range(len(BAD_BODIES))])
def test_bad_completion_body_is_a_json_4xx_naming_the_param(served, body, status, param, words):
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got, err = json_error(raw_http(served, req))
    assert got == status and err["param"] == param and words in err["message"], err
    assert err["type"] == "invalid_request_error"


CHAT_BAD = [
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "'system'"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", ""),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "retrieval"}]}, "tools",
     "tools.0.type: Input should be 'function'"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "less than or equal to 20"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature", "greater than or equal"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 3}, "max_tokens",
     "not both"),
    ({"messages": [{"role": "user", "content": "x" * 2100}], "max_tokens": 3}, "messages", "maximum context length"),
]


@pytest.mark.parametrize("body,param,words", CHAT_BAD, ids=[f"chat{i}" for i in range(len(CHAT_BAD))])
def test_bad_chat_body_is_a_400_naming_the_param(served, body, param, words):
    code, resp = post(served.url, body, path="/v1/chat/completions")
    assert code == 400 and resp["error"]["param"] == param and words in resp["error"]["message"], resp


def test_http_level_errors_are_json_and_the_server_answers_after(served):
    url = served.url
    for method in ("OPTIONS", "PUT", "DELETE", "TRACE", "PATCH"):
        got, err = json_error(raw_http(served, f"{method} /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                                f"Connection: close\r\n\r\n".encode()))
        assert got == 405 and "takes POST" in err["message"], (method, err)
    got, err = json_error(raw_http(served, b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
    assert got == 404 and "no endpoint /v1/nothing" in err["message"]
    got, err = json_error(raw_http(served, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 +
                                   b"\r\nConnection: close\r\n\r\n"))
    assert got == 431 and "serve.max_header_bytes" in err["message"]
    got, err = json_error(raw_http(served, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" +
                                   b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 1000) for i in range(80)) + b"\r\n"))
    assert got == 431
    got, err = json_error(raw_http(served, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 9000000\r\n"
                                           b"Content-Type: application/json\r\n\r\n{"))
    assert got == 413 and "serve.max_body_bytes" in err["message"]
    got, err = json_error(raw_http(served, b"THIS IS NOT HTTP\r\n\r\n"))
    assert got == 400 and "malformed HTTP request" in err["message"]
    got, err = json_error(raw_http(served, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n"))
    assert got == 501 and "not implemented" in err["message"]
    # curl's default Content-Type (form) with a JSON body: told what to send
    out = subprocess.run(["curl", "-sS", "-d", '{"prompt":"x"}', url + "/v1/completions"], capture_output=True,
                         text=True, timeout=30)
    assert "JSON object" in json.loads(out.stdout)["error"]["message"]
    # headers every response carries: a request id (echoed or made), a Server header that names no Python
    raw = raw_http(served, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: trace-42\r\nConnection: close\r\n\r\n")
    head = raw.partition(b"\r\n\r\n")[0].lower()
    assert b"x-request-id: trace-42" in head and b"server: kdtree" in head and b"python" not in head
    code, resp = post(url, {"prompt": "2+2=", "max_tokens": 3})
    assert code == 200 and resp["usage"]["completion_tokens"] == 3
    log = (served.run_dir / "engine.log").read_text()
    assert '"GET /health HTTP/1.1" 200' in log and "rid=trace-42" in log          # the access log
    assert "kdtree-monitor" not in log


def test_metrics_are_prometheus_histograms_counters_and_gauges(served):
    post(served.url, {"prompt": "metrics", "max_tokens": 5})
    code, text = get(served.url, "/metrics")
    assert code == 200
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("kdtree_time_to_first_token_seconds", "kdtree_time_per_output_token_seconds",
                 "kdtree_e2e_request_latency_seconds", "kdtree_request_queue_time_seconds"):
        assert fams[name].type == "histogram"
        count = [s.value for s in fams[name].samples if s.name == name + "_count"]
        assert count and count[0] >= 1, name
    for name in ("kdtree_requests", "kdtree_prompt_tokens", "kdtree_generation_tokens"):
        assert fams[name].type == "counter"
    for name in ("kdtree_num_requests_running", "kdtree_num_requests_waiting", "kdtree_kv_cache_usage_perc",
                 "kdtree_phase"):
        assert fams[name].type == "gauge" and not name.endswith("_total")
    ok = [s for s in fams["kdtree_requests"].samples if s.name == "kdtree_requests_total"
          and s.labels == {"code": "200", "endpoint": "/v1/completions"}]
    assert ok and ok[0].value >= 1
    gen = [s.value for s in fams["kdtree_generation_tokens"].samples if s.name == "kdtree_generation_tokens_total"]
    assert gen[0] >= 5


def test_openapi_schema_fuzzed_no_5xx_no_schema_violation(served):
    """schemathesis generates requests from the published schema (valid and not); every answer is < 500, has the
    documented content type, and matches the documented response schema (the errors' one included)."""
    from hypothesis import given

    code, text = get(served.url, "/openapi.json")
    assert code == 200
    doc = json.loads(text)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model_id}"} <= set(doc["paths"])
    schema = schemathesis.openapi.from_url(served.url + "/openapi.json")
    checks = [schemathesis.checks.not_a_server_error, schemathesis.checks.response_schema_conformance,
              schemathesis.checks.content_type_conformance]
    seen = []

    for result in schema.get_all_operations():
        op = result.ok()

        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  derandomize=True, phases=[Phase.explicit, Phase.generate])
        @given(case=op.as_strategy())
        def fuzz(case):
            if isinstance(case.body, dict):          # keep generation short (chat's default is the rest of the context)
                if "max_tokens" not in case.body and "max_completion_tokens" not in case.body:
                    case.body["max_tokens"] = 16
                for key, most in (("max_tokens", 32), ("max_completion_tokens", 32), ("n", 4)):
                    if isinstance(case.body.get(key), int) and not isinstance(case.body.get(key), bool):
                        case.body[key] = min(case.body[key], most)
            response = case.call(timeout=60)
            case.validate_response(response, checks=checks)
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            seen.append(response.status_code)

        fuzz()
    assert any(c == 200 for c in seen) and any(400 <= c < 500 for c in seen), seen


# -- sampling (#20): the OpenAI fields map onto SamplingParams; output replays by seed --------------------------
@pytest.fixture(scope="module")
def engine(kdtree_cache):
    """An in-process engine of the same tiny model and tree as `served` (tests/serve/served_engine.py)."""
    from hydra import compose, initialize_config_dir

    from kdtree.pipeline.registry import register_schema as register
    from kdtree.engine import Engine
    from served_engine import TREE
    from tests.conftest import REPO

    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"cache_dir={kdtree_cache}", "load.progress=false", *TREE])
    eng = Engine.from_config(cfg)
    yield eng
    eng.close()


def test_sampled_completion_replays_by_seed_and_equals_the_engine(served, engine):
    from kdtree.decode.sampling import SamplingParams
    from kdtree.engine import AR_TREE

    c = client(served)
    kw = dict(model="tiny", prompt="def add(a, b):", max_tokens=12, temperature=0.8, seed=7)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.model_extra["kdtree"]["seed"] == 7
    params = SamplingParams.merged(engine.sampling_defaults(), {"temperature": 0.8, "seed": 7})
    ids = engine.tokenizer.encode("def add(a, b):")
    for tree in (None, AR_TREE):                     # the served ddtree = the engine's ddtree = AR, same seed
        r = engine.generate(ids, 12, sampling=params, tree=tree)
        assert engine.tokenizer.decode(r.tokens) == a.choices[0].text and a.usage.completion_tokens == len(r.tokens)
    streamed = list(c.completions.create(**kw, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == a.choices[0].text
    # no seed: one is drawn and reported; replaying it gives the same text
    code, r1 = post(served.url, {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0})
    seed = r1["kdtree"]["seed"]
    assert code == 200 and isinstance(seed, int)
    code, r2 = post(served.url, {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "seed": seed})
    assert r2["choices"][0]["text"] == r1["choices"][0]["text"] and r2["kdtree"]["seed"] == seed
    # temperature omitted: the checkpoint's default (or OpenAI's 1) samples, and reports a seed
    code, r3 = post(served.url, {"prompt": "Once upon a time", "max_tokens": 4})
    assert code == 200 and (r3["kdtree"]["seed"] is None) == (engine.sampling_defaults()["temperature"] < 1e-5)
    # greedy reports no seed
    assert post(served.url, {"prompt": "2+2=", "max_tokens": 2, "temperature": 0})[1]["kdtree"]["seed"] is None


def test_n_choices_each_with_its_derived_seed(served, engine):
    from kdtree.decode.sampling import SamplingParams

    c = client(served)
    r = c.completions.create(model="tiny", prompt="import ", max_tokens=8, temperature=1.2, seed=11, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2] and r.model_extra["kdtree"]["seed"] == 11
    base = SamplingParams.merged(engine.sampling_defaults(), {"temperature": 1.2, "seed": 11, "n": 3})
    ids = engine.tokenizer.encode("import ")
    for i, ch in enumerate(r.choices):
        want = engine.generate(ids, 8, sampling=base.for_sample(i))
        assert ch.text == engine.tokenizer.decode(want.tokens), i
    # two prompts x n=2: prompt-major choice indexes, streamed too
    body = {"prompt": ["a", "b"], "max_tokens": 4, "temperature": 1.0, "seed": 3, "n": 2}
    code, plain = post(served.url, body)
    assert code == 200 and [ch["index"] for ch in plain["choices"]] == [0, 1, 2, 3]
    chunks = list(c.completions.create(model="tiny", stream=True, **{k: v for k, v in body.items()}))
    for i in range(4):
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i) == \
            plain["choices"][i]["text"]
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                     temperature=0.9, seed=5, n=2)
    assert [ch.index for ch in chat.choices] == [0, 1]


def test_n_choices_stream_interleaved_as_they_decode(served):
    """n > 1 streamed: the choices decode in the same steps, and their chunks arrive interleaved (as vLLM sends
    them), not one choice after another (issue 37 row 10); each choice's text is still its own, whole."""
    c = client(served)
    body = dict(model="tiny", prompt="def main(", max_tokens=32, temperature=1.0, seed=21, n=3)
    plain = c.completions.create(**body)
    order = [ch.choices[0].index for ch in c.completions.create(stream=True, **body) if ch.choices and
             ch.choices[0].text]
    assert sorted(set(order)) == [0, 1, 2]
    last0 = max(k for k, i in enumerate(order) if i == 0)
    assert min(k for k, i in enumerate(order) if i == 2) < last0, order    # choice 2 started before 0 ended
    for i in range(3):
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **body)
                           if ch.choices and ch.choices[0].index == i)
        assert streamed == plain.choices[i].text


def test_completion_logprobs_streamed_and_not_with_echo(served):
    c = client(served)
    r = c.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, temperature=0.7, seed=1, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) == 2 and all(v <= 0 for v in top.values()) for top in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset[0] == len("def f(x):")
    streamed = [ch.choices[0].logprobs for ch in c.completions.create(
        model="tiny", prompt="def f(x):", max_tokens=8, temperature=0.7, seed=1, logprobs=2, stream=True)
        if ch.choices and ch.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    # echo: the prompt's tokens first (the first has no logprob), then the completion's
    e = c.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, temperature=0.7, seed=1, logprobs=2,
                             echo=True).choices[0]
    p = r.usage.prompt_tokens
    assert len(e.logprobs.tokens) == p + n and e.logprobs.token_logprobs[0] is None
    assert e.logprobs.token_logprobs[p:] == lp.token_logprobs and e.text == "def f(x):" + r.choices[0].text
    assert e.logprobs.text_offset[0] == 0
    # greedy with logprobs: the chosen token is the top one
    g = c.completions.create(model="tiny", prompt="2+2=", max_tokens=4, temperature=0, logprobs=1).choices[0]
    assert all(max(top.values()) == v for top, v in zip(g.logprobs.top_logprobs, g.logprobs.token_logprobs))


def test_chat_logprobs_streamed_and_not(served):
    c = client(served)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "def fib(n):"}], max_tokens=8, temperature=0.8,
              seed=9, logprobs=True, top_logprobs=3)
    r = c.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 and isinstance(t.bytes, list) for t in content)
    streamed = [t for ch in c.chat.completions.create(**kw, stream=True)
                if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == [t.logprob for t in content]
    plain = c.chat.completions.create(**dict(kw, logprobs=None, top_logprobs=None))
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("n", 0), ("logprobs", 9)])
def test_bad_sampling_values_are_a_400_naming_the_param(served, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client(served).completions.create(model="tiny", prompt="x", max_tokens=2, **{field: value})
    assert e.value.body["param"] == field
