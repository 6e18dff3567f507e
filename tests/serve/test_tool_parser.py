"""K2's tool-call and reasoning parsers against recorded examples written from vLLM's documented behaviour
(`--tool-call-parser kimi_k2`, `--reasoning-parser kimi_k2`), whole and streamed at every chunking."""
from __future__ import annotations

import json

import pytest

from kdtree.serve.chat_output import OutputStream, parse_output
from kdtree.serve.reasoning import parse_reasoning
from kdtree.serve.tools import parse_tool_calls

B, E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def call(cid, args):
    return f"<|tool_call_begin|>{cid}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


def tc(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


# (model output, content, tool_calls) -- what vLLM's kimi_k2 parser answers on that text
RECORDED = [
    ("The weather is nice.", "The weather is nice.", []),
    ("", "", []),
    (B + call("functions.get_weather:0", '{"city": "Beijing"}') + E, None,
     [tc("functions.get_weather:0", "get_weather", '{"city": "Beijing"}')]),
    ("Let me check. " + B + call("functions.get_weather:0", '{"city":"Paris"}')
     + call("functions.get_time:1", '{"tz":"CET"}') + E, "Let me check. ",
     [tc("functions.get_weather:0", "get_weather", '{"city":"Paris"}'),
      tc("functions.get_time:1", "get_time", '{"tz":"CET"}')]),
    # an id without the functions. prefix: the name is what precedes ':'
    (B + call("search:3", "{}") + E, None, [tc("search:3", "search", "{}")]),
    # whitespace around the id and the arguments is not part of them
    (B + "<|tool_call_begin|> functions.f:2 <|tool_call_argument_begin|> {\"a\": 1} \n<|tool_call_end|>" + E, None,
     [tc("functions.f:2", "f", '{"a": 1}')]),
    # truncated (max_tokens): the unclosed call is dropped, the complete one kept
    (B + call("functions.a:0", "{}") + "<|tool_call_begin|>functions.b:1<|tool_call_argument_begin|>{\"x\": ", None,
     [tc("functions.a:0", "a", "{}")]),
    # a section that never got a complete call: no calls, content is the text before it
    ("Hi" + B + "<|tool_call_begin|>functions.a", "Hi", []),
    # an id that is not NAME:IDX is not a call
    (B + call("functions.a", "{}") + E, None, []),
    # text after the section is not content
    (B + call("functions.a:0", "{}") + E + " trailing", None, [tc("functions.a:0", "a", "{}")]),
]


def streamed(text, cuts, reasoning=False, tools=True):
    os = OutputStream(reasoning=reasoning, tools=tools)
    deltas, last = [], 0
    for c in list(cuts) + [len(text)]:
        deltas += os.push(text[last:c])
        last = c
    deltas += os.finish()
    return os, deltas


def assemble(deltas):
    """What the openai client's stream helpers build from the deltas (by index; arguments concatenated)."""
    content, reasoning, calls = "", "", {}
    for d in deltas:
        content += d.get("content") or ""
        reasoning += d.get("reasoning_content") or ""
        for t in d.get("tool_calls", []):
            c = calls.setdefault(t["index"], {"id": None, "type": None, "function": {"name": "", "arguments": ""}})
            c["id"] = t.get("id", c["id"])
            c["type"] = t.get("type", c["type"])
            c["function"]["name"] += t.get("function", {}).get("name", "")
            c["function"]["arguments"] += t.get("function", {}).get("arguments", "")
    return content, reasoning, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("text,content,calls", RECORDED, ids=[f"rec{i}" for i in range(len(RECORDED))])
def test_recorded_whole(text, content, calls):
    assert parse_tool_calls(text) == (content, calls)


@pytest.mark.parametrize("text,content,calls", RECORDED, ids=[f"rec{i}" for i in range(len(RECORDED))])
def test_recorded_streamed_at_every_cut(text, content, calls):
    for cuts in [[]] + [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]:
        os, deltas = streamed(text, cuts)
        got_content, _, got_calls = assemble(deltas)
        assert got_content == (content or ""), cuts
        assert os.calls == calls and os.ts.final_content == content
        complete = got_calls[:len(calls)]                  # a truncated call was streamed, then not kept
        assert complete == calls, cuts
        for d in deltas:                                   # a delta is never empty text
            assert all(v for v in d.values())


REASONING = [
    ("<think>Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    # the generation prompt opened <think>: the output starts inside the block
    ("Hmm, 2+2.</think>4", "Hmm, 2+2.", "4"),
    # </think> never came: all reasoning, no content
    ("<think>still thinking", "still thinking", None),
    ("</think>only answer", None, "only answer"),
    # a tool section ends the reasoning implicitly
    ("<think>I need the weather" + B + call("functions.w:0", "{}") + E, "I need the weather",
     B + call("functions.w:0", "{}") + E),
]


@pytest.mark.parametrize("text,reasoning,content", REASONING, ids=[f"think{i}" for i in range(len(REASONING))])
def test_reasoning_whole_and_streamed(text, reasoning, content):
    assert parse_reasoning(text) == (reasoning, content)
    for cuts in [[]] + [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]:
        os, deltas = streamed(text, cuts, reasoning=True, tools=False)
        got_content, got_reasoning, _ = assemble(deltas)
        assert (got_reasoning or None, got_content or None) == (reasoning, content), cuts


def test_reasoning_then_tool_calls_whole_and_streamed():
    text = "<think>weather?</think>Checking. " + B + call("functions.get_weather:0", '{"city":"Oslo"}') + E
    out = parse_output(text, reasoning=True, tools=True)
    want = [tc("functions.get_weather:0", "get_weather", '{"city":"Oslo"}')]
    assert (out.reasoning, out.content, out.calls) == ("weather?", "Checking. ", want)
    for cut in range(1, len(text)):
        os, deltas = streamed(text, [cut], reasoning=True, tools=True)
        assert assemble(deltas) == ("Checking. ", "weather?", want) and os.calls == want
        assert json.loads(os.calls[0]["function"]["arguments"]) == {"city": "Oslo"}


def test_a_call_cut_by_max_tokens_finishes_length_not_tool_calls():
    from kdtree.serve.tools import finish_reason, open_call
    cut = B + call("functions.a:0", "{}") + "<|tool_call_begin|>functions.b:1<|tool_call_argument_begin|>{\"x\""
    done = B + call("functions.a:0", "{}") + E
    assert open_call(cut) and not open_call(done) and not open_call("plain") and not open_call(B)
    for text, want in ((cut, "length"), (done, "tool_calls")):
        out = parse_output(text, reasoning=False, tools=True)
        assert finish_reason(out.calls, out.open, "length") == want
        for k in range(1, len(text)):
            os, _ = streamed(text, [k])
            assert os.open == out.open and finish_reason(os.calls, os.open, "length") == want
    assert finish_reason([], False, "stop") == "stop"
    out = parse_output(cut, reasoning=False, tools=True)
    assert finish_reason(out.calls, out.open, "stop") == "tool_calls"       # a stop string inside: calls kept
