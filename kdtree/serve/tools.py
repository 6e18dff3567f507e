"""Kimi K2's tool calls in the model's output text -> OpenAI `tool_calls`, whole (a response) and incremental (SSE).

K2 writes its calls as (special tokens for k26; the same text spelled in bytes for tiny)

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}
    <|tool_call_end|><|tool_calls_section_end|>

and this parser answers what vLLM's `--tool-call-parser kimi_k2` answers on the same text: ids `functions.NAME:IDX`
as written, name = id.split(":")[0].split(".")[-1], arguments the JSON text between the markers (surrounding
whitespace stripped), content = the text before the section (None when empty); no section: the whole text is
content; a call whose `<|tool_call_end|>` never came (max_tokens) is dropped; text after the section is dropped.

    content, calls = parse_tool_calls(text)
    ts = ToolStream(); ts.push(piece) -> [delta, ...]; ts.finish() -> [delta, ...]; ts.calls (the complete ones)

The stream's deltas are OpenAI chat deltas ({"content": ...} or {"tool_calls": [{"index", "id", "type",
"function": {"name", "arguments"}}]}): a call's first delta carries id, type, name and arguments "", the next
ones its arguments as they come (the official client's stream helpers assemble them by index). A tail of the text
that could still be the start of a marker is held back until it is one or is not (tiny's markers come byte by
byte: "<|tool" can end a chunk). Streamed and whole agree on the content and on every complete call; a truncated
call's head and arguments were already streamed (as vLLM streams them) but are not in the final `calls`, and the
finish_reason is then "length" (vLLM says "tool_calls"; a client must know the last streamed call is cut).
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)

# the same pattern as vLLM's kimi_k2 parser: an id `[^<]+:\d+`, arguments without a nested call begin
_CALL = re.compile(r"<\|tool_call_begin\|>\s*(?P<id>[^<]+:\d+)\s*<\|tool_call_argument_begin\|>\s*"
                   r"(?P<args>(?:(?!<\|tool_call_begin\|>).)*?)\s*<\|tool_call_end\|>", re.DOTALL)
_ID = re.compile(r"[^<]+:\d+")


def tool_name(call_id: str) -> str:
    """functions.get_weather:0 -> get_weather (get_weather:0 -> get_weather)."""
    return call_id.split(":")[0].split(".")[-1]


def tool_call(call_id: str, arguments: str) -> Dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": tool_name(call_id), "arguments": arguments}}


def parse_tool_calls(text: str) -> Tuple[Optional[str], List[Dict[str, Any]]]:
    """(content, calls) of a whole output. No section: (text, [])."""
    at = text.find(SECTION_BEGIN)
    if at < 0:
        return text, []
    calls = [tool_call(m.group("id").strip(), m.group("args")) for m in _CALL.finditer(text, at)]
    return (text[:at] or None), calls


def open_call(text: str) -> bool:
    """A call begun and not ended when the output stopped (max_tokens cut it): its partial head and arguments
    were streamed, so the finish is "length", not "tool_calls"."""
    at = text.find(SECTION_BEGIN)
    return at >= 0 and SECTION_END not in text[at:] and text.rfind(CALL_BEGIN) > text.rfind(CALL_END)


def finish_reason(calls: List[Dict[str, Any]], cut: bool, finish: str) -> str:
    """"tool_calls" when the output made calls, unless it was cut by max_tokens inside one ("length")."""
    return finish if not calls or (cut and finish == "length") else "tool_calls"


def held(buf: str, markers) -> int:
    """Where a tail of `buf` that is a proper prefix of one of `markers` starts (len(buf) when none)."""
    longest = max(len(m) for m in markers)
    for i in range(max(0, len(buf) - longest + 1), len(buf)):
        tail = buf[i:]
        if any(len(m) > len(tail) and m.startswith(tail) for m in markers):
            return i
    return len(buf)


class ToolStream:
    """The incremental form of parse_tool_calls (see the module doc)."""

    def __init__(self):
        self.buf = ""
        self.mode = "content"          # content | section | head | args | after
        self.content = ""              # content emitted so far
        self.calls: List[Dict[str, Any]] = []      # complete calls, as parse_tool_calls gives them
        self.started = 0               # calls whose first delta went out (the next call's index)
        self._id = ""
        self._args = ""                # arguments emitted for the open call
        self._lead = True              # the open call's arguments: leading whitespace still to strip

    def push(self, piece: str) -> List[Dict[str, Any]]:
        self.buf += piece
        out: List[Dict[str, Any]] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> List[Dict[str, Any]]:
        out: List[Dict[str, Any]] = []
        if self.mode == "content" and self.buf:       # a marker prefix that never completed: it was text
            out.append(self._text(self.buf))
        self.buf = ""
        return out

    @property
    def open(self) -> bool:
        """A call's head or arguments were being read when the text ended (open_call of the whole text)."""
        return self.mode in ("head", "args")

    @property
    def final_content(self) -> Optional[str]:
        """parse_tool_calls' content: the text before the section (None when empty); no section: all of it."""
        return self.content if self.mode == "content" else (self.content or None)

    def _text(self, s: str) -> Dict[str, Any]:
        self.content += s
        return {"content": s}

    def _step(self, out: List[Dict[str, Any]]) -> bool:
        """Consume what `buf` allows in the current mode; True when the mode changed (step again)."""
        b = self.buf
        if self.mode == "content":
            at = b.find(SECTION_BEGIN)
            end = at if at >= 0 else held(b, (SECTION_BEGIN,))
            if end > 0:
                out.append(self._text(b[:end]))
            if at < 0:
                self.buf = b[end:]
                return False
            self.buf, self.mode = b[at + len(SECTION_BEGIN):], "section"
            return True
        if self.mode == "section":
            hits = [(i, m) for m in (CALL_BEGIN, SECTION_END) for i in (b.find(m),) if i >= 0]
            if not hits:
                self.buf = b[held(b, (CALL_BEGIN, SECTION_END)):]
                return False
            i, m = min(hits)
            self.buf, self.mode = b[i + len(m):], ("head" if m == CALL_BEGIN else "after")
            return True
        if self.mode == "head":
            return self._head(out)
        if self.mode == "args":
            return self._arguments(out)
        self.buf = ""                                 # after the section: dropped
        return False

    def _head(self, out: List[Dict[str, Any]]) -> bool:
        b = self.buf
        nested, at = b.find(CALL_BEGIN), b.find(ARG_BEGIN)
        if nested >= 0 and (at < 0 or nested < at):   # a new call begins before this one's arguments
            self.buf = b[nested + len(CALL_BEGIN):]
            return True
        if at < 0:
            return False
        head = b[:at].strip()
        self.buf = b[at + len(ARG_BEGIN):]
        if not _ID.fullmatch(head):                   # not a call vLLM's pattern takes: skip it
            self.mode = "section"
            return True
        self._id, self._args, self._lead, self.mode = head, "", True, "args"
        out.append({"tool_calls": [{"index": self.started, "id": head, "type": "function",
                                    "function": {"name": tool_name(head), "arguments": ""}}]})
        self.started += 1
        return True

    def _arguments(self, out: List[Dict[str, Any]]) -> bool:
        b = self.buf
        at = b.find(CALL_END)
        if self._lead:
            b = b.lstrip()
            at = b.find(CALL_END)
            self._lead = not b
        if at >= 0:
            new, self.buf, done = b[:at].rstrip(), b[at + len(CALL_END):], True
        else:
            keep = held(b, (CALL_END,))
            keep = len(b[:keep].rstrip())                 # trailing whitespace may be the stripped tail
            new, self.buf, done = b[:keep], b[keep:], False
        if new:
            self._args += new
            out.append({"tool_calls": [{"index": self.started - 1, "function": {"arguments": new}}]})
        if done:
            self.calls.append(tool_call(self._id, self._args))
            self.mode = "section"
        return done


__all__ = ["CALL_BEGIN", "CALL_END", "ARG_BEGIN", "MARKERS", "SECTION_BEGIN", "SECTION_END", "ToolStream",
           "finish_reason", "held", "open_call", "parse_tool_calls", "tool_call", "tool_name"]
