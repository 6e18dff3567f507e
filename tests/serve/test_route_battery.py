"""Issue 37 acceptance: the same bad-input battery against every route the server publishes in /openapi.json (kept
in the suite, so a new route meets it too). For every operation with a JSON body: an empty body, a non-object,
deep nesting, and per declared field a wrong type, a lone surrogate and (required fields) a null — each a 4xx
with a JSON error body that names the field — and a huge number (10**40: a 4xx naming it, or taken, never a 5xx); body-less operations get the same junk
as a body and answer < 500 with JSON. After every case /health answers: the server still serves. (It found POST
/prefix_cache answering a 100000-deep body with a 500 RecursionError.)

Run: .venv/bin/python -m pytest -q tests/serve/test_route_battery.py
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

DEEP = b"[" * 100000 + b"]" * 100000
VALID = {"messages": [{"role": "user", "content": "x"}], "prompt": "x"}    # a required field's valid value


def _request(url: str, method: str, path: str, body: bytes = None):
    req = urllib.request.Request(url + path, data=body, method=method,
                                 headers={"Content-Type": "application/json"} if body is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _resolve(schema: dict, spec: dict) -> dict:
    while isinstance(schema, dict) and "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        schema = spec["components"]["schemas"][name]
    return schema or {}


def _types(prop: dict, spec: dict) -> set:
    prop = _resolve(prop, spec)
    if "type" in prop:
        return {prop["type"]}
    out = set()
    for alt in prop.get("anyOf", []) + prop.get("oneOf", []):
        out |= _types(alt, spec)
    return out


def _wrong(types: set):
    """A value of a type the field does not take (None when it takes nearly anything)."""
    for v, t in (({"x": 1}, "object"), ([1], "array"), ("x", "string"), (True, "boolean")):
        if t not in types and not (t == "boolean" and types & {"integer", "number"}):
            return v
    return None


def battery(spec: dict):
    """(route id, method, path, body bytes, field expected in the error or None, expect 4xx)."""
    for path, ops in sorted(spec["paths"].items()):
        for method, op in sorted(ops.items()):
            m = method.upper()
            content = (op.get("requestBody") or {}).get("content", {})
            if "application/json" not in content:
                for name, body in (("empty", b""), ("truncated", b"{"), ("deep", DEEP)):
                    yield f"{m} {path} {name} (as a body)", m, path, body, None, False
                continue
            schema = _resolve(content["application/json"].get("schema", {}), spec)
            props, required = schema.get("properties", {}), set(schema.get("required", []))
            base = {k: VALID.get(k, "x") for k in required}
            for name, body in (("empty", b""), ("not-object", b"[1, 2]"), ("deep", DEEP), ("truncated", b'{"a": ')):
                yield f"{m} {path} {name}", m, path, body, None, True
            for field, prop in props.items():
                types = _types(prop, spec)
                wrong = _wrong(types)
                if wrong is not None:
                    yield f"{m} {path} {field}=wrong", m, path, json.dumps({**base, field: wrong}).encode(), field, True
                if types & {"integer", "number"}:      # may be taken (top_k 1e40 = every token): never a 5xx
                    yield (f"{m} {path} {field}=huge", m, path,
                           json.dumps({**base, "max_tokens": 1, field: 10 ** 40}).encode(), field, False)
                if types == {"string"}:
                    yield (f"{m} {path} {field}=surrogate", m, path,
                           ('{"%s": "a\\ud800b"%s}' % (field, "".join(f', "{k}": {json.dumps(VALID.get(k, "x"))}'
                                                                       for k in required if k != field))).encode(),
                           field, True)
                if field in required:
                    yield f"{m} {path} {field}=null", m, path, json.dumps({**base, field: None}).encode(), field, True


@pytest.fixture(scope="module")
def spec(served):
    code, raw = _request(served.url, "GET", "/openapi.json")
    assert code == 200
    return json.loads(raw)


def test_the_battery_covers_every_published_route(spec):
    cases = list(battery(spec))
    routes = {(m, p) for _, m, p, *_ in cases}
    published = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    assert routes == published and len(cases) >= 3 * len(published), (published - routes, len(cases))
    assert ("POST", "/v1/completions") in routes and ("POST", "/v1/chat/completions") in routes


def _check(url: str, case) -> str:
    """'' when the case holds, else what went wrong."""
    name, method, path, body, field, must_4xx = case
    code, raw = _request(url, method, path, body)
    if code >= 500 or (must_4xx and not 400 <= code < 500):
        return f"{name}: HTTP {code} {raw[:200]!r}"
    if code >= 400:
        try:
            err = json.loads(raw)["error"]
        except (ValueError, KeyError, TypeError):
            return f"{name}: HTTP {code}, not a JSON error: {raw[:200]!r}"
        if must_4xx and not err.get("message"):
            return f"{name}: no message: {err}"
        if field is not None and err.get("param") != field and field not in err.get("message", ""):
            return f"{name}: the error does not name {field!r}: {err}"
    if _request(url, "GET", "/health")[0] != 200:
        return f"{name}: /health did not answer after it"
    return ""


def test_bad_input_on_every_route_is_a_json_4xx_naming_the_field_and_the_server_serves(served, spec):
    cases = list(battery(spec))
    failures = [f for f in (_check(served.url, c) for c in cases) if f]
    print(f"{len(cases)} cases over {len(spec['paths'])} paths: {len(failures)} failed")
    assert not failures, "\n".join(failures[:40])
