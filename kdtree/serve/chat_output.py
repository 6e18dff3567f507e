"""An assistant turn's text -> message fields: reasoning (kdtree/serve/reasoning.py), then tool calls in what is
left (kdtree/serve/tools.py), as vLLM chains its reasoning parser and tool parser.

    out = parse_output(text, reasoning=True, tools=True)     # Output(reasoning, content, calls)
    os = OutputStream(reasoning=True, tools=True)
    os.push(piece) -> [delta, ...]; os.finish() -> [delta, ...]; os.calls, os.reasoning
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from kdtree.serve.reasoning import ReasoningStream, parse_reasoning
from kdtree.serve.tools import ToolStream, open_call, parse_tool_calls


@dataclass
class Output:
    reasoning: Optional[str]
    content: Optional[str]
    calls: List[Dict[str, Any]] = field(default_factory=list)
    open: bool = False                 # the text ended inside a call (tools.open_call)


def parse_output(text: str, reasoning: bool, tools: bool) -> Output:
    r, content = parse_reasoning(text) if reasoning else (None, text)
    calls: List[Dict[str, Any]] = []
    cut = False
    if tools and content is not None:
        cut = open_call(content)
        content, calls = parse_tool_calls(content)
    return Output(r, content, calls, cut)


class OutputStream:
    """parse_output piece by piece as OpenAI chat deltas ({"reasoning_content"}, {"content"}, {"tool_calls"})."""

    def __init__(self, reasoning: bool, tools: bool):
        self.rs = ReasoningStream() if reasoning else None
        self.ts = ToolStream() if tools else None

    @property
    def calls(self) -> List[Dict[str, Any]]:
        return self.ts.calls if self.ts is not None else []

    @property
    def open(self) -> bool:
        return self.ts is not None and self.ts.open

    @property
    def reasoning(self) -> str:
        return self.rs.reasoning if self.rs is not None else ""

    def push(self, piece: str) -> List[Dict[str, Any]]:
        pairs = self.rs.push(piece) if self.rs is not None else [("content", piece)]
        return self._route(pairs)

    def finish(self) -> List[Dict[str, Any]]:
        out = self._route(self.rs.finish()) if self.rs is not None else []
        return out + (self.ts.finish() if self.ts is not None else [])

    def _route(self, pairs) -> List[Dict[str, Any]]:
        out: List[Dict[str, Any]] = []
        for name, text in pairs:
            if name == "content" and self.ts is not None:
                out.extend(self.ts.push(text))
            elif text:
                out.append({name: text})
        return _merged(out)


def _merged(deltas: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Adjacent text deltas of the same field in one (fewer SSE events; the same text)."""
    out: List[Dict[str, Any]] = []
    for d in deltas:
        if out and len(d) == 1 and list(d) == list(out[-1]) and isinstance(next(iter(d.values())), str):
            k = next(iter(d))
            out[-1] = {k: out[-1][k] + d[k]}
        else:
            out.append(d)
    return out


__all__ = ["Output", "OutputStream", "parse_output"]
