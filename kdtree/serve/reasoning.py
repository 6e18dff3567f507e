"""Thinking output -> `reasoning_content` and `content`, as vLLM's `--reasoning-parser kimi_k2` splits it.

    reasoning, content = parse_reasoning(text)
    rs = ReasoningStream(); rs.push(piece) -> [("reasoning_content" | "content", text), ...]; rs.finish()

K2.6 thinks first: everything up to `</think>` is reasoning (a leading `<think>` is consumed: the model may
write it, or the chat template may already have opened it in the generation prompt, then the output starts inside
the block); the answer after `</think>` is content (None when empty). A tool-call section that begins before any
`</think>` ends the reasoning implicitly (the section and what follows are content, for the tool parser). When
`</think>` never comes (max_tokens ran out while thinking): all of it is reasoning, content is None. With thinking
off (chat_template_kwargs {"thinking": false}) the parser is not used: everything is content.

Streaming holds back a tail that could still become `<think>` (at the very start), `</think>` or the section
marker, so streamed reasoning + content equal the whole split.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from kdtree.serve.tools import SECTION_BEGIN, held

THINK, END_THINK = "<think>", "</think>"


def parse_reasoning(text: str) -> Tuple[Optional[str], Optional[str]]:
    """(reasoning, content) of a whole thinking output (vLLM kimi_k2's extract_reasoning); "" is None."""
    start = len(THINK) if text.startswith(THINK) else 0
    end = text.find(END_THINK)
    if end >= 0:
        return text[start:end] or None, text[end + len(END_THINK):] or None
    sec = text.find(SECTION_BEGIN)
    if sec >= 0:
        return text[start:sec] or None, text[sec:] or None
    return text[start:] or None, None


class ReasoningStream:
    """parse_reasoning, piece by piece: (field, text) pairs, field "reasoning_content" or "content"."""

    def __init__(self):
        self.buf, self.started, self.thinking = "", False, True
        self.reasoning = ""

    def push(self, piece: str) -> List[Tuple[str, str]]:
        self.buf += piece
        if not self.thinking:
            out, self.buf = self.buf, ""
            return [("content", out)] if out else []
        if not self.started:
            if len(self.buf) < len(THINK) and THINK.startswith(self.buf):
                return []                                 # could still be the opening <think>
            if self.buf.startswith(THINK):
                self.buf = self.buf[len(THINK):]
            self.started = True
        b = self.buf
        hits = [(i, m) for m in (END_THINK, SECTION_BEGIN) for i in (b.find(m),) if i >= 0]
        if not hits:
            keep = held(b, (END_THINK, SECTION_BEGIN))
            self.buf = b[keep:]
            return self._reason(b[:keep])
        i, m = min(hits)
        self.thinking, self.buf = False, ""
        rest = b[i + len(END_THINK):] if m == END_THINK else b[i:]
        return self._reason(b[:i]) + ([("content", rest)] if rest else [])

    def finish(self) -> List[Tuple[str, str]]:
        out, self.buf = self.buf, ""
        if not out:
            return []
        return self._reason(out) if self.thinking else [("content", out)]

    def _reason(self, s: str) -> List[Tuple[str, str]]:
        self.reasoning += s
        return [("reasoning_content", s)] if s else []


__all__ = ["END_THINK", "THINK", "ReasoningStream", "parse_reasoning"]
