"""Tools, tool_choice, response_format and reasoning as an agent builder meets them: the official `openai` client
against one real `pipeline=serve` process on the tiny model (ddtree). The output of every constrained request
parses and validates (jsonschema) against the schema it asked for, streamed and not, greedy and seeded sampling."""
from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kdtree.serve.chat_template import ChatTemplate
from test_server_process import post

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SECTION = "<|tool_calls_section_begin|>"
USER = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]


def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def leaf(rng: random.Random) -> dict:
    kind = rng.choice(["enum", "str", "bool", "int", "intenum"])
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["red", "green", "blue", "cyan", "gray"], rng.randint(1, 4))}
    if kind == "str":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "int":
        return {"type": "integer", "minimum": 0, "maximum": rng.choice([9, 99])}
    return {"type": "integer", "enum": rng.sample([1, 2, 3, 5, 8, 13], 3)}


def obj(rng: random.Random, depth: int = 0) -> dict:
    """A closed object schema of 1-3 properties: leaves, arrays (maxItems), nested objects; some required."""
    props = {}
    for k in range(rng.randint(1, 3)):
        r = rng.random()
        if r < 0.2 and depth == 0:
            props[f"p{k}"] = obj(rng, depth + 1)
        elif r < 0.4:
            props[f"p{k}"] = {"type": "array", "items": leaf(rng), "maxItems": rng.randint(1, 3)}
        else:
            props[f"p{k}"] = leaf(rng)
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def tools_for(i: int):
    rng = random.Random(i)
    names = rng.sample(["get_weather", "search", "lookup", "send_mail", "calc"], rng.randint(1, 2))
    return [{"type": "function", "function": {"name": n, "parameters": obj(rng),
                                              "strict": True}} for n in names]


def assemble(chunks):
    """content, tool calls and finish_reason from raw streamed chunks (by index, arguments concatenated)."""
    content, calls, finish = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            c = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = t.id or c["id"]
            c["name"] += (t.function.name or "") if t.function else ""
            c["arguments"] += (t.function.arguments or "") if t.function else ""
        finish = ch.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def tool_request(c, i: int):
    """Request i of the 100: required or named, parallel or not, streamed (raw or the client's helper) or not,
    greedy or seeded. Returns (tools, the name it had to call or None, [(id, name, arguments)], finish_reason)."""
    tools = tools_for(i)
    named = tools[i % len(tools)]["function"]["name"] if i % 3 == 0 else None
    choice = {"type": "function", "function": {"name": named}} if named else "required"
    parallel = i % 4 == 1                   # one or more calls: the tiny model may go on calling to max_tokens
    kw = dict(model="tiny", messages=USER, tools=tools, tool_choice=choice, max_tokens=400,
              parallel_tool_calls=parallel, **({"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}))
    mode = (i // 2) % 3 if not parallel else (i // 4) % 2       # (the helper refuses a finish "length" by design)
    if mode == 0:
        r = c.chat.completions.create(**kw)
        m = r.choices[0].message
        return tools, named, [(t.id, t.function.name, t.function.arguments) for t in m.tool_calls or []], \
            r.choices[0].finish_reason
    if mode == 1:
        _, calls, finish = assemble(list(c.chat.completions.create(stream=True, **kw)))
        if finish == "length":                 # cut inside its last call: that one was streamed partly
            calls = calls[:-1]
        return tools, named, [(t["id"], t["name"], t["arguments"]) for t in calls], finish
    with c.chat.completions.stream(**kw) as s:
        r = s.get_final_completion()
    m = r.choices[0].message
    for t in m.tool_calls or []:              # the helper parsed the arguments of these strict tools
        assert t.function.parsed_arguments == json.loads(t.function.arguments)
    return tools, named, [(t.id, t.function.name, t.function.arguments) for t in m.tool_calls or []], \
        r.choices[0].finish_reason


def check_calls(tools, named, calls, finish, i):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    # finish "length": parallel calls went on to max_tokens, the last one cut (dropped); the others are complete
    assert calls and (finish == "tool_calls" or (finish == "length" and i % 4 == 1)), (i, calls, finish)
    for cid, name, args in calls:
        assert name in schemas and (named is None or name == named), (i, name)
        assert cid.startswith(f"functions.{name}:") and cid.split(":")[1].isdigit(), cid
        jsonschema.validate(json.loads(args), schemas[name])


def test_a_tool_call_decoded_alone_under_ddtree(served):
    """Request 5 alone (greedy, the tree speculating): its verify rows must be masked by their own paths' states
    (a tree whose depth-first order differs from its node order once committed a token the grammar refused: 500;
    kdtree/decode/grammar.py constrain_tree's unchanged-tree return must stack the masks in node order)."""
    c = client(served)
    r = c.chat.completions.create(model="tiny", messages=USER, tools=tools_for(5), tool_choice="required",
                                  max_tokens=400, temperature=0)
    check_calls(tools_for(5), None, [(t.id, t.function.name, t.function.arguments)
                                     for t in r.choices[0].message.tool_calls or []], r.choices[0].finish_reason, 5)


def test_tool_choice_required_and_named_100_of_100_validate(served):
    c = client(served)
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: tool_request(c, i), range(100)))
    for i, (tools, named, calls, finish) in enumerate(results):
        check_calls(tools, named, calls, finish, i)
    cut = sum(r[3] == "length" for r in results)
    print(f"100/100 requests made valid tool calls ({sum(len(r[2]) for r in results)} calls, {cut} cut by "
          f"max_tokens after complete ones) in {time.monotonic() - t0:.1f} s")


def format_request(c, i: int):
    rng = random.Random(1000 + i)
    schema = obj(rng) if i % 5 else {"type": "array", "items": leaf(rng), "minItems": 1, "maxItems": 3}
    rf = {"type": "json_schema", "json_schema": {"name": f"answer{i}", "schema": schema, "strict": True}}
    kw = dict(model="tiny", messages=USER, response_format=rf, max_tokens=200,
              **({"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "seed": i}))
    if (i // 2) % 2:
        content, calls, finish = assemble(list(c.chat.completions.create(stream=True, **kw)))
    else:
        r = c.chat.completions.create(**kw)
        content, calls, finish = r.choices[0].message.content, r.choices[0].message.tool_calls, \
            r.choices[0].finish_reason
    return schema, content, calls, finish


def test_response_format_json_schema_100_of_100_validate(served):
    c = client(served)
    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: format_request(c, i), range(100)))
    for i, (schema, content, calls, finish) in enumerate(results):
        assert finish == "stop" and not calls, (i, finish, content)
        jsonschema.validate(json.loads(content), schema)
    r = c.completions.create(model="tiny", prompt="x = ", max_tokens=60, temperature=0,
                             extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)               # /v1/completions takes it too
    print(f"100/100 JSON answers valid in {time.monotonic() - t0:.1f} s")


def test_tool_choice_none_never_emits_markers(served):
    """A history with a K2 call invites the model to write another; under tool_choice none it cannot (the grammar
    refusing the marker byte by byte: tests/serve/test_tool_grammar.py)."""
    tools = tools_for(7)[:1]
    name = tools[0]["function"]["name"]
    history = []
    for k in range(1):
        cid = f"functions.{name}:{k}"
        history += [{"role": "user", "content": "call it"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": cid, "type": "function", "function": {"name": name, "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": cid, "content": "ok"}]
    c = client(served)
    kw = dict(model="tiny", messages=history + [{"role": "user", "content": "call it"}], tools=tools,
              tool_choice="none", max_tokens=40)       # (a long prompt: ~0.1 s a token on the shared CPUs)
    for seed in range(3):
        r = c.chat.completions.create(temperature=1.0, seed=seed, **kw)
        m = r.choices[0].message
        assert m.tool_calls is None and SECTION not in (m.content or "") and r.choices[0].finish_reason != "tool_calls"
    content, calls, _ = assemble(list(c.chat.completions.create(stream=True, temperature=0, **kw)))
    assert SECTION not in content and not calls


def test_agent_round_trip_tool_call_result_answer(served):
    c = client(served)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}}}]
    r = c.chat.completions.create(model="tiny", messages=USER, tools=tools, tool_choice="required", max_tokens=200,
                                  temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    messages = USER + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                       {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'}]
    r2 = c.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=12, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = ChatTemplate.for_checkpoint(None, "tiny").render(
        [{"role": "user", "content": USER[0]["content"]},
         {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
         {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'}], tools=tools)
    assert f"<|tool_call_begin|>{call.id}<|tool_call_argument_begin|>{call.function.arguments}" in rendered
    assert f"## Return of {call.id}" in rendered
    assert r2.usage.prompt_tokens == len(rendered.encode())            # the server rendered exactly this


def test_thinking_is_reasoning_content(served):
    """chat_template_kwargs {"thinking": true}: the template opens <think>; the output up to </think> (here: all
    of it, the tiny model never closes it) is reasoning_content, counted in usage."""
    c = client(served)
    kw = dict(model="tiny", messages=USER, max_tokens=10, temperature=0,
              extra_body={"chat_template_kwargs": {"thinking": True}})
    r = c.chat.completions.create(**kw)
    m = r.choices[0].message
    reasoning = m.model_extra.get("reasoning_content")
    assert reasoning and m.content is None
    assert r.usage.completion_tokens_details.reasoning_tokens == len(reasoning.encode()) == 10
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    streamed = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                       for ch in chunks if ch.choices)
    assert streamed == reasoning and chunks[-1].usage.completion_tokens_details.reasoning_tokens == 10
    plain = c.chat.completions.create(model="tiny", messages=USER, max_tokens=10, temperature=0)
    assert plain.choices[0].message.content and "reasoning_content" not in (plain.choices[0].message.model_extra or {})


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "invalid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(?<=a)b"}}}}}], "tool_choice": "required"}, "tools", "look-around"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"tools": [{"type": "function"}]}, "tools.0.function", "missing"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
]


@pytest.mark.parametrize("extra,param,words", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_tools_and_formats_are_a_400_naming_the_param_and_the_server_keeps_serving(served, extra, param, words):
    code, resp = post(served.url, {"messages": USER, "max_tokens": 2, **extra}, path="/v1/chat/completions")
    assert code == 400 and resp["error"]["param"] == param and words in resp["error"]["message"], resp
    code, ok = post(served.url, {"messages": USER, "max_tokens": 2, "temperature": 0}, path="/v1/chat/completions")
    assert code == 200 and ok["choices"][0]["message"]["content"] is not None
    assert "tool_calls" not in ok["choices"][0]["message"] and "completion_tokens_details" not in ok["usage"]


def test_n_samples_each_decode_under_their_own_matcher(served):
    c = client(served)
    tools = tools_for(3)
    r = c.chat.completions.create(model="tiny", messages=USER, tools=tools, tool_choice="required", n=3,
                                  parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=5)
    assert len(r.choices) == 3
    for ch in r.choices:
        check_calls(tools, None, [(t.id, t.function.name, t.function.arguments) for t in ch.message.tool_calls],
                    ch.finish_reason, 0)
