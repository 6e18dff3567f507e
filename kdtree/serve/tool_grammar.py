"""The grammar a chat request's output must follow (llguidance Lark, compiled by kdtree/decode/grammar.py), from
`tool_choice`, `tools`, `parallel_tool_calls` and `response_format`:

    tool_choice required         one or more K2 calls (exactly one with parallel_tool_calls=false), any declared
                                 function, each call's arguments valid under that function's `parameters` schema
    tool_choice {function: f}    the same, function f only
    tool_choice auto             no constraint (free text; calls parsed when the model writes them); with a
                                 response_format: the calls or the JSON answer
    tool_choice none             no tool-call marker can be written (with a response_format: the JSON answer)
    response_format json_object  a JSON object; json_schema: a JSON value valid under its schema

    spec = output_grammar(grammars, tools, tool_choice, parallel, response_format, thinking)  # None: unconstrained

The markers are `Grammars.marker(...)`: the special token itself for k26, the quoted text for tiny's bytes. With
thinking on, a `<think>...</think>` block (its `<think>` optional: the template may have opened it) may come first.
After the last call (or the JSON) the grammar is complete: only the end tokens (eos, k26's <|im_end|>) remain. A
schema that does not compile is a GrammarError naming the request field (an HTTP 400).
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from kdtree.decode.grammar import GrammarError, Grammars, GrammarSpec
from kdtree.serve.reasoning import END_THINK, THINK
from kdtree.serve.tools import ARG_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END

ANY_OBJECT = {"type": "object"}
IDX = r"/[0-9]|[1-9][0-9]{1,2}/"          # K2's call index: bounded (the tiny model must not write digits forever)


def _rx(text: str) -> str:
    """`text` as a literal inside a Lark /regex/."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)


def _without(text: str) -> str:
    """A Lark regex: any text that does not contain `text` (llguidance: intersection with a negation)."""
    return f"/(?s:.*)/ & ~/(?s:.*){_rx(text)}(?s:.*)/"


def _schema(grammars: Grammars, schema: Any, param: str) -> str:
    """`%json {...}` of a schema compiled alone first (its own error names `param`); compact as
    Grammars.json_schema compiles it (llguidance's %json default lets whitespace run on unbounded)."""
    grammars.json_schema(schema, param=param)
    return grammars.json_rule(schema, param=param)


def _tool_rules(grammars: Grammars, tools: List[Dict[str, Any]], only: Optional[str]) -> List[str]:
    m = grammars.marker
    alts, rules = [], []
    for i, t in enumerate(tools):
        fn = t["function"]
        if only is not None and fn["name"] != only:
            continue
        params = fn.get("parameters") or ANY_OBJECT
        rules.append(f'f{i}: {json.dumps("functions." + fn["name"] + ":")} IDX {m(ARG_BEGIN)} a{i} {m(CALL_END)}')
        rules.append(f"a{i}: {_schema(grammars, params, 'tools')}")
        alts.append(f"f{i}")
    return [f"call: {m(CALL_BEGIN)} ({' | '.join(alts)})", *rules, f"IDX: {IDX}"]


def _think_rules(grammars: Grammars) -> List[str]:
    m = grammars.marker
    if END_THINK in grammars.special:                 # k26: special tokens, which text never spells
        return [f"think: {m(THINK)}? THINK_TEXT {m(END_THINK)}", "THINK_TEXT: /(?s:.*)/"]
    # tiny: one lexeme up to the first </think> (the lexer does not backtrack out of a text terminal into a
    # literal), never holding the section marker (where the reasoning parser ends the reasoning anyway)
    end = _rx(END_THINK)
    return ["think: THINK_BLOCK", f"THINK_BLOCK: /(?s:.*){end}/ & ~/(?s:.*){end}(?s:.+)/ & "
                                  f"~/(?s:.*){_rx(SECTION_BEGIN)}(?s:.*)/"]


def _response_json(response_format: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    if not response_format or response_format.get("type") == "text":
        return None
    if response_format["type"] == "json_object":
        return ANY_OBJECT
    return response_format["json_schema"]["schema"]


def output_grammar(grammars: Grammars, tools: Optional[List[Dict[str, Any]]], tool_choice: Any,
                   parallel_tool_calls: Optional[bool], response_format: Optional[Dict[str, Any]],
                   thinking: bool = False) -> Optional[GrammarSpec]:
    tools = tools or []
    schema = _response_json(response_format)
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    if not forced and tool_choice != "none" and (schema is None or not tools):
        if schema is None:
            return None                                   # auto / no tools: free text
        if not thinking:
            return grammars.json_schema(schema, param="response_format")
    m = grammars.marker
    rules: List[str] = []
    alts: List[str] = []
    if forced or (tools and tool_choice in (None, "auto")):
        only = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        rules += _tool_rules(grammars, tools, only)
        one = parallel_tool_calls is False
        alts.append("calls")
        rules.append(f"calls: {m(SECTION_BEGIN)} call{'' if one else '+'} {m(SECTION_END)}")
    if not forced:
        if schema is not None:
            alts.append("answer")
            rules.append(f"answer: {_schema(grammars, schema, 'response_format')}")
        elif tool_choice == "none":
            alts.append("TEXT")
            rules.append("TEXT: /(?s:.*)/" if SECTION_BEGIN in grammars.special else f"TEXT: {_without(SECTION_BEGIN)}")
    if thinking:
        rules += _think_rules(grammars)
    # tiny's think lexeme and a JSON answer can both begin with "{" (the lexer cannot take both): with an answer
    # the block is required there (the template opened <think>, so </think> comes first); k26: optional
    optional = END_THINK in grammars.special or "answer" not in alts
    start = f"start: {('think? ' if optional else 'think ') if thinking else ''}({' | '.join(alts)})"
    return grammars.lark("\n".join([start, *rules]) + "\n", param="tool_choice" if forced else "response_format")


def check_tool_choice(tools: Optional[List[Dict[str, Any]]], tool_choice: Any) -> None:
    """tool_choice required / named needs tools, and a named one must be declared: else a GrammarError (400)."""
    if tool_choice in (None, "auto", "none"):
        return
    names = [t["function"]["name"] for t in tools or []]
    if not names:
        raise GrammarError(f"tool_choice={json.dumps(tool_choice)} needs `tools`; declare the functions the "
                           f"model may call", param="tool_choice")
    if isinstance(tool_choice, dict) and tool_choice["function"]["name"] not in names:
        raise GrammarError(f"tool_choice names function {tool_choice['function']['name']!r}, which is not in "
                           f"tools ({', '.join(names)})", param="tool_choice")


__all__ = ["check_tool_choice", "output_grammar"]
