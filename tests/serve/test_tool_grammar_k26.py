"""The output grammar on k26's vocabulary (the synthetic K2.6 tokenizer of tests/tokenizer/k26_files.py): K2's
markers are single special tokens there, so the grammar takes the special ids and refuses the same text spelled in
ordinary tokens; `tool_choice: none` masks the section token; the turn end (<|im_end|>) stays reachable; the text
decoded with its specials parses back into the calls."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llguidance")
pytest.importorskip("tiktoken")

from kdtree.decode.grammar import Grammars  # noqa: E402
from kdtree.serve.chat_output import parse_output  # noqa: E402
from kdtree.serve.tool_grammar import output_grammar  # noqa: E402
from tests.tokenizer.k26_files import VOCAB, k26_tokenizer, write_k26_tokenizer  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city":"Oslo"}<|tool_call_end|><|tool_calls_section_end|>')


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return k26_tokenizer(write_k26_tokenizer(tmp_path_factory.mktemp("k26tok")))


@pytest.fixture(scope="module")
def g(tok):
    return Grammars.for_tokenizer(tok, VOCAB)


def walk(spec, ids):
    """How many of `ids` the grammar takes in order; and the final state's mask."""
    st = spec.start()
    for k, t in enumerate(ids):
        if not st.allows(t):
            return k, st.mask()
        st.consume([t])
    return len(ids), st.mask()


def test_required_takes_the_special_markers_and_refuses_them_spelled_out(tok, g):
    spec = output_grammar(g, TOOLS, "required", None, None)
    ids = tok.encode(CALL, allow_special=True)
    assert ids[0] == tok.special_tokens["<|tool_calls_section_begin|>"]
    n, mask = walk(spec, ids)
    assert n == len(ids) and mask[tok.special_tokens["<|im_end|>"]]           # the turn can end
    assert walk(spec, tok.encode(CALL, allow_special=False))[0] == 0           # the same text as plain tokens
    out = parse_output(tok.decode(ids, skip_special_tokens=False), reasoning=False, tools=True)
    assert [c["function"]["name"] for c in out.calls] == ["get_weather"]
    assert json.loads(out.calls[0]["function"]["arguments"]) == {"city": "Oslo"} and out.content is None


def test_thinking_then_the_call(tok, g):
    spec = output_grammar(g, TOOLS, "required", None, None, thinking=True)
    text = "<think>Oslo, then.</think>" + CALL
    ids = tok.encode(text, allow_special=True)
    assert walk(spec, ids)[0] == len(ids)
    out = parse_output(tok.decode(ids, skip_special_tokens=False), reasoning=True, tools=True)
    assert out.reasoning == "Oslo, then." and len(out.calls) == 1


def test_none_masks_the_section_token_and_keeps_the_end(tok, g):
    spec = output_grammar(g, TOOLS, "none", None, None)
    section, end = tok.special_tokens["<|tool_calls_section_begin|>"], tok.special_tokens["<|im_end|>"]
    ids = tok.encode("The weather is fine <|tool_calls_section_begin|> as text", allow_special=False)
    n, mask = walk(spec, ids)
    assert n == len(ids) and not mask[section] and mask[end]
    assert not np.any([walk(spec, [section])[0]])
