"""The output grammar of tool_choice / response_format (kdtree/serve/tool_grammar.py) on tiny's byte vocabulary:
what it lets through and what it refuses, byte by byte, without a model."""
from __future__ import annotations

import pytest

pytest.importorskip("llguidance")

from kdtree.decode.grammar import GrammarError, Grammars  # noqa: E402
from kdtree.serve.tool_grammar import check_tool_choice, output_grammar  # noqa: E402
from kdtree.tokenizer.byte import ByteTokenizer  # noqa: E402

B, E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noargs"}}]


def call(i, name, args):
    return f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


@pytest.fixture(scope="module")
def g():
    return Grammars.for_tokenizer(ByteTokenizer(), 260)


def accepts(spec, text) -> bool:
    """The grammar takes every byte of `text` and is complete after it (eos allowed)."""
    st = spec.start()
    for b in text.encode():
        if not st.allows(b):
            return False
        st.consume([b])
    return st.accepting and st.allows(257)


def test_required_any_function_one_or_more_and_parallel_false_exactly_one(g):
    two = B + call(0, "get_weather", '{"city":"Oslo"}') + call(1, "noargs", "{}") + E
    spec = output_grammar(g, TOOLS, "required", None, None)
    assert accepts(spec, two) and accepts(spec, B + call(0, "noargs", "{}") + E)
    assert not accepts(spec, "hello") and not accepts(spec, B + E)
    assert not accepts(spec, B + call(0, "get_weather", '{"city":"Oslo123"}') + E)      # maxLength
    assert not accepts(spec, B + call(0, "get_weather", "{}") + E)                       # required
    assert not accepts(spec, B + call(0, "other", "{}") + E)                             # not declared
    one = output_grammar(g, TOOLS, "required", False, None)
    assert accepts(one, B + call(0, "noargs", "{}") + E) and not accepts(one, two)


def test_named_function_only(g):
    spec = output_grammar(g, TOOLS, {"type": "function", "function": {"name": "noargs"}}, None, None)
    assert accepts(spec, B + call(3, "noargs", "{}") + E)
    assert not accepts(spec, B + call(0, "get_weather", '{"city":"Oslo"}') + E)


def test_none_never_lets_the_section_marker_through_and_the_chat_end_stays_reachable(g):
    spec = output_grammar(g, TOOLS, "none", None, None)
    assert accepts(spec, "def f(x): return x <|tool_calls_section_begi")
    assert accepts(spec, "done<|im_end|>")
    assert not accepts(spec, "sure " + B + call(0, "noargs", "{}") + E)


def test_response_format_and_auto_with_response_format(g):
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    spec = output_grammar(g, None, None, None, rf)
    assert accepts(spec, '{"city":"Rome"}') and not accepts(spec, '{"city":1}')
    assert output_grammar(g, TOOLS, "auto", None, None) is None                      # auto: free text
    both = output_grammar(g, TOOLS, "auto", None, rf)
    assert accepts(both, '{"city":"Rome"}') and accepts(both, B + call(0, "noargs", "{}") + E)
    obj = output_grammar(g, None, None, None, {"type": "json_object"})
    assert accepts(obj, '{"a":[1,2]}') and not accepts(obj, "[1]")


def test_thinking_block_first(g):
    spec = output_grammar(g, TOOLS, "required", None, None, thinking=True)
    assert accepts(spec, "<think>weather?</think>" + B + call(0, "noargs", "{}") + E)
    assert accepts(spec, "opened by the template</think>" + B + call(0, "noargs", "{}") + E)
    assert accepts(spec, B + call(0, "noargs", "{}") + E)


def test_bad_schemas_and_choices_name_the_parameter(g):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(GrammarError) as e:
        output_grammar(g, None, None, None, rf)
    assert e.value.param == "response_format"
    lookaround = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}}}}]
    with pytest.raises(GrammarError) as e:
        output_grammar(g, lookaround, "required", None, None)
    assert e.value.param == "tools" and "look-around" in str(e.value)
    with pytest.raises(GrammarError) as e:
        check_tool_choice(TOOLS, {"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice" and "nope" in str(e.value)
    with pytest.raises(GrammarError):
        check_tool_choice(None, "required")


def test_thinking_then_a_json_answer(g):
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    for choice, tools in (("auto", TOOLS), (None, None), ("none", TOOLS)):
        spec = output_grammar(g, tools, choice, None, rf, thinking=True)
        assert accepts(spec, '<think>hm</think>{"city":"Rome"}') and accepts(spec, 'hm</think>{"city":"Rome"}')
        assert not accepts(spec, 'hm</think>{"city":7}')


def test_embedded_json_is_compact(g):
    """%json in Lark defaults to flexible whitespace; the tool arguments are compiled compact (no "{\\n   ...")."""
    spec = output_grammar(g, TOOLS, "required", None, None)
    assert not accepts(spec, B + call(0, "get_weather", '{ "city":"Oslo"}') + E)
    assert not accepts(spec, B + call(0, "get_weather", '{\n"city":"Oslo"}') + E)
